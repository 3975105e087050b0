"""LossScaler: a static or dynamic loss scale held on the device, and its state-dict formats.

The scale, the growth tracker and the hysteresis counter are 0-dim tensors, so scaling a loss and
updating the scale after a step never read a value back to the host. The rules themselves are in
scale_rule.py; the fused optimizer step traces them into its own graph, `LossScaler.update` runs
them on its own for the other paths (several losses, FP16_Optimizer).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch

from fxamp.config import AmpConfig
from fxamp.config_parts import as_loss_scale
from fxamp.errors import ConfigError
from fxamp.optim.scale_rule import (UNSET, build_rule, check_scale_value, compiled_update,
                                    update_in_place)
from fxamp.optim.scaled_graphs import ScaledGraphs
from fxamp.optim.state_checks import parse_scaler_state

if TYPE_CHECKING:
    from fxamp.optim.folding import FoldRound

__all__ = ["LossScaler"]

log = logging.getLogger(__name__)


class LossScaler:
    """A static or dynamic loss scale kept on the device.

    Args:
        loss_scale: "dynamic", or a positive number (or numeric string) for a static scale.
        semantics: the dynamic rule: "apex" (default: start 2**16, halve on overflow floored at
            `min_loss_scale`, double after 2000 clean steps capped at `max_loss_scale` = 2**24),
            "torch" (GradScaler: no cap, growth only while finite) or "deepspeed" (back off after
            `hysteresis` = 2 overflows, double after 1000 clean steps).
        init_scale, growth_factor, backoff_factor, growth_interval, min_loss_scale,
        max_loss_scale, hysteresis: override the semantics' defaults. `min_loss_scale` (None:
            the default 1.0) is the floor of every dynamic scale and must be positive (Note [The
            scale has a floor] in scale_rule.py); `max_loss_scale=None` means no cap.
        consecutive_hysteresis: DeepSpeed's option: refill the hysteresis on every clean step
            rather than only when the scale grows.
        compile: trace the standalone update with torch.compile (the fused optimizer step always
            traces it into its own graph when it compiles).

    A static scale never changes, but a step with inf/nan gradients is still skipped (Apex would
    apply it). DeepSpeed raises at the minimum scale; here the scale stays at the floor instead,
    because raising would need a host read every step. A step is also skipped if the scale is
    not a positive finite number (only a hand-written `scale_tensor` can make it so).

    Raises:
        ConfigError: any value outside its range, named with the range.
    """

    def __init__(self, loss_scale: Union[float, str] = "dynamic", *, semantics: str = "apex",
                 init_scale: Optional[float] = None, growth_factor: Optional[float] = None,
                 backoff_factor: Optional[float] = None, growth_interval: Optional[int] = None,
                 min_loss_scale: Any = UNSET, max_loss_scale: Any = UNSET,
                 hysteresis: Optional[int] = None, consecutive_hysteresis: bool = False,
                 compile: bool = True) -> None:
        overrides = dict(init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                         max_loss_scale=max_loss_scale)
        static = as_loss_scale(loss_scale)  # "dynamic" or a checked float, as in AmpConfig
        self.semantics = semantics
        self.rule, init = build_rule(semantics, static == "dynamic", consecutive_hysteresis,
                                     overrides)
        self._init = (init if static == "dynamic" else static, 0, self.rule.hysteresis)
        self._state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.pending_exit: Optional[tuple] = None  # Note [Apex's scale_loss exits] (exits.py)
        self.fold_round: Optional[FoldRound] = None  # folds awaiting their steps (folding.py)
        self._update = compiled_update() if compile else update_in_place
        self.scaled_graphs = ScaledGraphs(self)  # Note [A scaled backward awaits its step]

    @classmethod
    def from_config(cls, config: AmpConfig, **kwargs: Any) -> "LossScaler":
        """The scaler an opt level asks for: its loss_scale ("dynamic" or a number) and its
        min/max_loss_scale, with Apex's rule; `kwargs` as for the constructor."""
        return cls(config.loss_scale, min_loss_scale=config.min_loss_scale,
                   max_loss_scale=config.max_loss_scale, **kwargs)

    @property
    def dynamic(self) -> bool:
        return self.rule.dynamic

    def state_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
        """(scale, growth tracker, hysteresis left) as 0-dim tensors on `device`."""
        if self._state is None:
            scale, tracker, hyst = self._init
            # torch.full is a fill on the device; torch.tensor(x, device=...) would be a copy
            # that synchronises.
            self._state = (torch.full((), scale, dtype=torch.float32, device=device),
                           torch.full((), tracker, dtype=torch.int32, device=device),
                           torch.full((), hyst, dtype=torch.int32, device=device))
        elif self._state[0].device != torch.device(device):
            self._state = tuple(t.to(device) for t in self._state)  # type: ignore[assignment]
        return self._state

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` in fp32 times the current scale (a device multiply, no host read).

        Step the optimizers this loss reaches with `opt.step(scaler)`: a step without the
        scaler would apply scaled gradients, and is refused (Note [A scaled backward awaits its
        step] in scaled_graphs.py).
        """
        _check_loss(loss)
        scaled = loss.float() * self.state_tensors(loss.device)[0]
        self.scaled_graphs.watch(scaled)
        return scaled

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 device tensor (created on the CPU if unused yet)."""
        return self.state_tensors(self._device())[0]

    def get_scale(self) -> float:
        """The current scale as a Python float. Reads it back from the device."""
        return float(self._init[0]) if self._state is None else self._state[0].item()

    def set_scale(self, value: float) -> None:
        """Overwrite the current scale (for static scales set by hand, like Apex's setter)."""
        value = check_scale_value(value, "set_scale(value)")
        if self._state is None:
            self._init = (float(value), *self._init[1:])
        else:
            self._state[0].fill_(float(value))

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the dynamic scale by one step whose overflow flag is `found_inf` (0-dim)."""
        if self.rule.dynamic:
            self._update(*self.state_tensors(found_inf.device), found_inf.bool(), self.rule)

    def _device(self) -> torch.device:
        return torch.device("cpu") if self._state is None else self._state[0].device

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus fxamp's; reads the scale back from the device."""
        scale, tracker, hyst = self._init if self._state is None else (
            t.item() for t in self._state)
        return {"scale": scale, "growth_factor": self.rule.growth_factor,
                "backoff_factor": self.rule.backoff_factor,
                "growth_interval": self.rule.growth_interval, "_growth_tracker": int(tracker),
                "hysteresis_left": int(hyst), "semantics": self.semantics,
                "dynamic": self.rule.dynamic}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load fxamp's, torch GradScaler's or one Apex loss scaler's state.

        Apex's `amp.state_dict()` holds one entry per loss ("loss_scaler0", ...); pass the entry
        of this scaler, or use `fxamp.optim.load_amp_state_dict` for all of them.
        """
        scale, tracker, hyst, rule_fields = parse_scaler_state(
            _single_scaler_entry(state_dict), self.rule)
        self.rule = self.rule._replace(**rule_fields)  # every value was checked first
        if self._state is None:
            self._init = (scale, tracker, hyst)
        else:
            for t, v in zip(self._state, (scale, tracker, hyst)):
                t.fill_(v)
        log.debug("loaded loss scaler: scale %s, tracker %s", scale, tracker)

    def __repr__(self) -> str:
        kind = "dynamic" if self.rule.dynamic else "static"
        return f"LossScaler({kind}, semantics={self.semantics!r}, device={self._device()})"


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"LossScaler.scale(loss) takes the loss tensor, not "
                          f"{type(loss).__name__}")
    if not loss.is_floating_point():
        raise ConfigError(f"LossScaler.scale(loss) got a {loss.dtype} tensor; the loss must be "
                          "a floating-point tensor computed from the model's output (an "
                          "integer tensor has no gradient to scale)")


def _single_scaler_entry(sd: Mapping[str, Any]) -> Mapping[str, Any]:
    entries = [k for k in sd if k.startswith("loss_scaler")]
    if not entries:
        return sd
    if len(entries) == 1:
        return sd[entries[0]]
    raise ConfigError(f"this Apex amp state dict holds {len(entries)} loss scalers "
                      f"({', '.join(sorted(entries))}); pass one entry to LossScaler."
                      "load_state_dict or use fxamp.optim.load_amp_state_dict")
