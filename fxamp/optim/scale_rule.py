"""The dynamic loss-scale rules (Apex, torch GradScaler, DeepSpeed) as pure tensor functions.

`next_scale_state` is written with selects only, so the fused optimizer step traces it into its
prologue graph and the scale moves on the device; `LossScaler.update` runs it on its own.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from fxamp._compat import compile_fresh
from fxamp.errors import ConfigError

__all__ = ["ScaleRule", "SEMANTICS", "UNSET", "build_rule", "next_scale_state",
           "update_in_place", "compiled_update"]

SEMANTICS = ("apex", "torch", "deepspeed")

# Defaults per semantics (see ../../../shared/reference/AMP_SEMANTICS.md, "Loss scaling").
_DEFAULTS: dict[str, dict[str, Any]] = {
    "apex": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 min_loss_scale=None, max_loss_scale=2.0**24, hysteresis=1),
    "torch": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                  min_loss_scale=None, max_loss_scale=None, hysteresis=1),
    "deepspeed": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                      growth_interval=1000, min_loss_scale=1.0, max_loss_scale=None, hysteresis=2),
}
UNSET: Any = object()  # an argument left out; None means no floor/cap


class ScaleRule(NamedTuple):
    """How a dynamic scale moves; primitives only, so a compiled step specialises on its value."""

    dynamic: bool
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: Optional[float]
    max_scale: Optional[float]
    hysteresis: int
    consecutive_hysteresis: bool
    finite_growth_only: bool


def next_scale_state(scale: torch.Tensor, tracker: torch.Tensor, hysteresis: torch.Tensor,
                     found_inf: torch.Tensor, rule: ScaleRule):
    """(scale, growth tracker, hysteresis left) after a step whose overflow flag is `found_inf`.

    Apex: halve on overflow (floored at min), double after `growth_interval` clean steps (capped
    at max). torch: the same without caps, growth only to a finite value. DeepSpeed: back off only
    once `hysteresis` overflows have been seen since the last growth (or the last clean step with
    `consecutive_hysteresis`). All selects, no host reads.
    """
    if not rule.dynamic:
        return scale, tracker, hysteresis
    backed = scale * rule.backoff_factor
    if rule.min_scale is not None:
        backed = backed.clamp_min(rule.min_scale)
    clean = tracker + 1
    grow = ~found_inf & (clean >= rule.growth_interval)
    grown = scale * rule.growth_factor
    if rule.max_scale is not None:
        grown = grown.clamp_max(rule.max_scale)
    if rule.finite_growth_only:
        grown = torch.where(torch.isfinite(grown), grown, scale)
    back_off = found_inf & (hysteresis <= 1)
    new_scale = torch.where(back_off, backed, torch.where(grow, grown, scale))
    new_tracker = torch.where(found_inf | grow, torch.zeros_like(clean), clean)
    reset = ~found_inf if rule.consecutive_hysteresis else grow
    full = torch.full_like(hysteresis, rule.hysteresis)
    new_hysteresis = torch.where(found_inf, (hysteresis - 1).clamp_min(1),
                                 torch.where(reset, full, hysteresis))
    return new_scale, new_tracker, new_hysteresis


def update_in_place(scale, tracker, hysteresis, found_inf, rule: ScaleRule) -> None:
    new = next_scale_state(scale, tracker, hysteresis, found_inf, rule)
    for dst, src in zip((scale, tracker, hysteresis), new):
        dst.copy_(src)


def compiled_update():
    """`update_in_place` compiled for one LossScaler (Note [One compiled step per optimizer]
    in fused_step.py)."""
    return compile_fresh(update_in_place, fullgraph=True, dynamic=False)


def _opt_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def build_rule(semantics: str, dynamic: bool, consecutive_hysteresis: bool,
                overrides: dict[str, Any]) -> tuple[ScaleRule, float]:
    """The checked rule of `semantics` with `overrides` applied, and the initial scale."""
    if semantics not in SEMANTICS:
        raise ConfigError(f"semantics={semantics!r} is not one of {', '.join(SEMANTICS)}")
    d = dict(_DEFAULTS[semantics])
    # None keeps a default, except for min/max where None means "no floor/cap".
    d.update((k, v) for k, v in overrides.items()
             if v is not UNSET and (v is not None or k.endswith("loss_scale")))
    rule = ScaleRule(
        dynamic=dynamic, growth_factor=float(d["growth_factor"]),
        backoff_factor=float(d["backoff_factor"]), growth_interval=int(d["growth_interval"]),
        min_scale=_opt_float(d["min_loss_scale"]) or None,  # Apex: 0 means no floor
        max_scale=_opt_float(d["max_loss_scale"]), hysteresis=int(d["hysteresis"]),
        consecutive_hysteresis=bool(consecutive_hysteresis),
        finite_growth_only=semantics == "torch")
    _check_rule(rule)
    init = float(d["init_scale"])
    if rule.max_scale is not None:
        init = min(init, rule.max_scale)  # Apex caps the initial scale too
    return rule, init


def _check_rule(rule: ScaleRule) -> None:
    if not (rule.growth_factor > 1 and 0 < rule.backoff_factor < 1):
        raise ConfigError(f"growth_factor={rule.growth_factor} must be > 1 and backoff_factor="
                          f"{rule.backoff_factor} in (0, 1)")
    if rule.growth_interval < 1 or rule.hysteresis < 1:
        raise ConfigError(f"growth_interval={rule.growth_interval} and hysteresis="
                          f"{rule.hysteresis} must be positive ints")
    if rule.min_scale and rule.max_scale and rule.min_scale > rule.max_scale:
        raise ConfigError(f"min_loss_scale={rule.min_scale} exceeds max_loss_scale="
                          f"{rule.max_scale}")
