"""The dynamic loss-scale rules (Apex, torch GradScaler, DeepSpeed) as pure tensor functions.

`next_scale_state` is written with selects only, so the fused optimizer step traces it into its
prologue graph and the scale moves on the device; `LossScaler.update` runs it on its own.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.optim.functional.kinds import CompiledPerKind

__all__ = ["ScaleRule", "SEMANTICS", "UNSET", "DEFAULT_MIN_LOSS_SCALE", "build_rule",
           "next_scale_state", "after_step", "update_in_place", "compiled_update",
           "forget_compiled_update",
           "check_scale_value", "check_new_scale", "check_growth_factor", "check_backoff_factor",
           "check_growth_interval", "scale_is_valid"]

SEMANTICS = ("apex", "torch", "deepspeed")

# Note [The scale has a floor]
# A dynamic scale that halves on every overflow reaches exactly 0 in fp32 after ~166 overflows
# in a row (a NaN loss does that), and at 0 nothing can grow it back: every later step would be
# skipped, or worse apply 0 * inf. Apex kept its scale as a Python float (about 1000 halvings
# from 0) and DeepSpeed floors it at 1; torch's GradScaler has no floor. fxamp floors every
# dynamic scale at `min_loss_scale`, 1.0 unless given: below 1 a scale only shrinks gradients
# that overflow unscaled, which loss scaling cannot fix. A lower floor can be asked for (any
# positive number); none at all cannot.
DEFAULT_MIN_LOSS_SCALE = 1.0

# Note [Growth stays finite]
# No dynamic scale grows to a non-finite value, whatever its semantics or cap: a growth that
# would give inf keeps the scale where it is, as torch's `_amp_update_scale_` and Apex's
# `amp_C.update_scale_hysteresis` kernels do. DeepSpeed's Python scaler has no cap, so an
# overflow-free run doubled it to inf (after ~112k steps at the default interval), where every
# step was skipped. `growth_factor` may be 1.0 (the scale never grows), as those kernels allow.
_FLOOR_HINT = (f" (the floor of a dynamic scale, {DEFAULT_MIN_LOSS_SCALE} by default; pass a "
               "smaller positive number such as 2**-24 for a lower floor)")


# Defaults per semantics, as each project ships them: Apex amp's dynamic LossScaler (at most
# 2**24), torch.amp.GradScaler (no maximum), DeepSpeed's DynamicLossScaler (grows every 1000
# clean steps, floor 1, a hysteresis of 2 overflows).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "apex": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 min_loss_scale=DEFAULT_MIN_LOSS_SCALE, max_loss_scale=2.0**24, hysteresis=1),
    "torch": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                  min_loss_scale=DEFAULT_MIN_LOSS_SCALE, max_loss_scale=None,
                  hysteresis=1),
    "deepspeed": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=1000, min_loss_scale=1.0, max_loss_scale=None, hysteresis=2),
}
UNSET: Any = object()  # an argument left out


class ScaleRule(NamedTuple):
    """How a dynamic scale moves; primitives only: in a compiled step its numbers are symbols,
    its flags and which of them are None part of the graph's kind (kinds.py)."""

    dynamic: bool
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: Optional[float]
    hysteresis: int
    consecutive_hysteresis: bool
    # False for the step of an optimizer driven through GradScaler's protocol, which moves the
    # scale (and counts the skip) at `update()` instead (Note [GradScaler's protocol]).
    moves: bool = True


def next_scale_state(scale: torch.Tensor, tracker: torch.Tensor, hysteresis: torch.Tensor,
                     found_inf: torch.Tensor, rule: ScaleRule):
    """(scale, growth tracker, hysteresis left) after a step whose overflow flag is `found_inf`.

    Apex: halve on overflow (floored at min), double after `growth_interval` clean steps (capped
    at max). torch: the same without caps, growth only to a finite value. DeepSpeed: back off only
    once `hysteresis` overflows have been seen since the last growth (or the last clean step with
    `consecutive_hysteresis`). A scale that is not a positive finite number (written into
    `scale_tensor` by hand) restarts at the floor. All selects, no host reads.
    """
    if not rule.dynamic:
        return scale, tracker, hysteresis
    backed = (scale * rule.backoff_factor).clamp_min(rule.min_scale)
    clean = tracker + 1
    grow = ~found_inf & (clean >= rule.growth_interval)
    grown = scale * rule.growth_factor
    if rule.max_scale is not None:
        grown = grown.clamp_max(rule.max_scale)
    grown = torch.where(torch.isfinite(grown), grown, scale)  # Note [Growth stays finite]
    back_off = found_inf & (hysteresis <= 1)
    new_scale = torch.where(back_off, backed, torch.where(grow, grown, scale))
    new_scale = torch.where(scale_is_valid(scale), new_scale,
                            torch.full_like(scale, rule.min_scale))
    new_tracker = torch.where(found_inf | grow, torch.zeros_like(clean), clean)
    reset = ~found_inf if rule.consecutive_hysteresis else grow
    full = torch.full_like(hysteresis, rule.hysteresis)
    new_hysteresis = torch.where(found_inf, (hysteresis - 1).clamp_min(1),
                                 torch.where(reset, full, hysteresis))
    return new_scale, new_tracker, new_hysteresis


def scale_is_valid(scale: torch.Tensor) -> torch.Tensor:
    """Whether a scale tensor is a positive finite number (a device bool, no host read); a step
    whose scale is not is skipped (Note [Skipping without a host read] in docs/design.md)."""
    return torch.isfinite(scale) & (scale > 0)


def after_step(state: tuple[torch.Tensor, ...], found_inf: torch.Tensor, rule: ScaleRule):
    """A scaler's (scale, growth tracker, hysteresis left, skipped steps) after a step whose
    overflow flag is `found_inf`: the scale moves by the rule, the skip is counted."""
    scale, tracker, hysteresis, skipped = state
    moved = next_scale_state(scale, tracker, hysteresis, found_inf, rule)
    return (*moved, skipped + found_inf.to(skipped.dtype))


def update_in_place(state: tuple[torch.Tensor, ...], found_inf: torch.Tensor,
                    rule: ScaleRule) -> None:
    for dst, src in zip(state, after_step(state, found_inf, rule)):
        dst.copy_(src)


_COMPILED_UPDATE = CompiledPerKind(update_in_place)


def compiled_update() -> CompiledPerKind:
    """`update_in_place` compiled once per kind of rule (whether it is dynamic, capped,
    consecutive; its numbers are symbols) and shared by every LossScaler of the process
    (Note [One compiled step per kind] in docs/design.md)."""
    return _COMPILED_UPDATE


def forget_compiled_update() -> None:
    """A new cache for `compiled_update` (fused_step.forget_compiled)."""
    global _COMPILED_UPDATE
    _COMPILED_UPDATE = CompiledPerKind(update_in_place)


def build_rule(semantics: str, dynamic: bool, consecutive_hysteresis: bool,
               overrides: dict[str, Any]) -> tuple[ScaleRule, float]:
    """The checked rule of `semantics` with `overrides` applied, and the initial scale.

    None keeps a default, except for `max_loss_scale`, where it means "no cap". Every value is
    checked (ConfigError names it and its valid range).
    """
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics={semantics!r} is not one of {', '.join(SEMANTICS)}")
    d = dict(_DEFAULTS[semantics])
    d.update((k, v) for k, v in overrides.items()
             if v is not UNSET and (v is not None or k == "max_loss_scale"))
    max_scale = d["max_loss_scale"]
    rule = ScaleRule(
        dynamic=dynamic,
        growth_factor=check_growth_factor(d["growth_factor"]),
        backoff_factor=check_backoff_factor(d["backoff_factor"]),
        growth_interval=check_growth_interval(d["growth_interval"]),
        min_scale=validation.positive_finite(d["min_loss_scale"], "min_loss_scale",
                                             _FLOOR_HINT),
        max_scale=None if max_scale is None else validation.positive_finite(
            max_scale, "max_loss_scale", " or None (no cap)"),
        hysteresis=validation.positive_int(d["hysteresis"], "hysteresis"),
        consecutive_hysteresis=validation.boolean(consecutive_hysteresis,
                                                  "consecutive_hysteresis"))
    return rule, _initial_scale(d["init_scale"], rule)


def check_growth_factor(value: Any, what: str = "growth_factor") -> float:
    factor = validation.real(value, what, "a finite number >= 1")
    if not (factor >= 1 and math.isfinite(factor)):
        raise ConfigError(f"{what}={value!r} must be a finite number >= 1 (1.0: the "
                          "scale never grows)")
    return factor


def check_backoff_factor(value: Any, what: str = "backoff_factor") -> float:
    return validation.fraction(value, what, closed_low=False)


def check_growth_interval(value: Any, what: str = "growth_interval") -> int:
    return validation.positive_int(value, what)


def _initial_scale(value: Any, rule: ScaleRule) -> float:
    init = validation.positive_finite(value, "init_scale")
    if rule.max_scale is not None:
        if rule.min_scale > rule.max_scale:
            raise ConfigError(f"min_loss_scale={rule.min_scale} exceeds max_loss_scale="
                              f"{rule.max_scale}; the floor must be <= the cap")
        init = min(init, rule.max_scale)  # Apex caps the initial scale too
    if init < rule.min_scale:
        raise ConfigError(f"init_scale={value!r} is below min_loss_scale={rule.min_scale}; "
                          "start at or above the floor, or lower min_loss_scale")
    return init


def check_scale_value(value: Any, what: str = "loss scale") -> float:
    """A scale set by hand or loaded from a state dict: a positive finite number."""
    return validation.positive_finite(value, what)


def check_new_scale(value: Any) -> Any:
    """GradScaler's `update(new_scale)`: a positive finite number, or a 1-element floating
    tensor without grad (copied on the device, not checked there: no host read)."""
    if not isinstance(value, torch.Tensor):
        return check_scale_value(value, "update(new_scale)")
    if value.numel() != 1 or value.requires_grad or not value.is_floating_point():
        raise ConfigError(f"update(new_scale) takes a number or a 1-element floating tensor "
                          f"without grad, not a {tuple(value.shape)} {value.dtype} tensor")
    return value
