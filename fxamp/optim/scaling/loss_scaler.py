"""LossScaler: a static or dynamic loss scale held on the device, its state-dict formats, and
torch.amp.GradScaler's protocol (Note [GradScaler's protocol] in scaler_protocol.py).

The scale, the growth tracker, the hysteresis counter and the skipped-step count are 0-dim
tensors, so scaling a loss and updating the scale after a step never read a value back to the
host. The rules themselves are in scale_rule.py; the fused optimizer step traces them into its
own graph, `LossScaler.advance` runs them on its own for the other paths (several losses,
FP16_Optimizer, GradScaler's `update()`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional, Union

import torch

from fxamp import validation
from fxamp.config import AmpConfig
from fxamp.config.keywords import as_loss_scale
from fxamp.errors import ConfigError
from fxamp.optim.functional.scale_rule import (UNSET, build_rule, check_backoff_factor,
                                    check_growth_factor, check_growth_interval,
                                    check_new_scale, check_scale_value, compiled_update,
                                    update_in_place)
from fxamp.optim.scaling.scale_round import ScaleRound
from fxamp.optim.scaling.scaled_graphs import ScaledGraphs
from fxamp.optim.scaling.scaler_protocol import OptimizerStates, OptState
from fxamp.optim.state_checks import parse_scaler_state, single_scaler_entry

__all__ = ["LossScaler", "OptState"]

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
        enabled: False makes every call a no-op, as GradScaler(enabled=False): `scale` returns
            the loss unchanged, `step(opt)` is `opt.step()`, `get_scale()` is 1.0.

    It speaks torch.amp.GradScaler's protocol (`scale`, `unscale_(opt)`, `step(opt)`,
    `update()`, the getters and setters): `LossScaler(semantics="torch")` replaces
    `torch.amp.GradScaler(device)` in code written for it, with torch.optim optimizers (what
    GradScaler does) and with fxamp's (their fused step, no host read); docs/integrations.md.
    fxamp's own loop calls `opt.step(scaler)` instead, which also moves the scale.

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
                 compile: bool = True, enabled: bool = True) -> None:
        overrides = dict(init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         hysteresis=hysteresis, min_loss_scale=min_loss_scale,
                         max_loss_scale=max_loss_scale)
        static = as_loss_scale(loss_scale)  # "dynamic" or a checked float, as in AmpConfig
        self.semantics = semantics
        self.rule, init = build_rule(semantics, static == "dynamic", consecutive_hysteresis,
                                     overrides)
        self._enabled = validation.boolean(enabled, "enabled")
        self._init = (init if static == "dynamic" else static, 0, self.rule.hysteresis, 0)
        self._state: Optional[tuple[torch.Tensor, ...]] = None
        self.scale_round = ScaleRound()  # what exits.py and folding.py owe before it moves
        self._update = compiled_update() if compile else update_in_place
        self.scaled_graphs = ScaledGraphs(self)  # Note [A scaled backward awaits its step]
        self._optimizers = OptimizerStates()  # Note [GradScaler's protocol]

    @classmethod
    def from_config(cls, config: AmpConfig, **kwargs: Any) -> "LossScaler":
        """The scaler an opt level asks for: its loss_scale ("dynamic" or a number) and its
        min/max_loss_scale, with Apex's rule; `kwargs` as for the constructor."""
        return cls(config.loss_scale, min_loss_scale=config.min_loss_scale,
                   max_loss_scale=config.max_loss_scale, **kwargs)

    @property
    def dynamic(self) -> bool:
        return self.rule.dynamic

    def state_tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(scale, growth tracker, hysteresis left, skipped steps) as 0-dim tensors on `device`."""
        if self._state is None:
            scale, tracker, hyst, skipped = self._init
            # torch.full is a fill on the device; torch.tensor(x, device=...) would be a copy
            # that synchronises.
            self._state = (torch.full((), scale, dtype=torch.float32, device=device),
                           torch.full((), tracker, dtype=torch.int32, device=device),
                           torch.full((), hyst, dtype=torch.int32, device=device),
                           torch.full((), skipped, dtype=torch.int64, device=device))
        elif self._state[0].device != torch.device(device):
            self._state = tuple(t.to(device) for t in self._state)  # type: ignore[assignment]
        return self._state

    def scale(self, loss: Any) -> Any:
        """`loss` in fp32 times the current scale (a device multiply, no host read); a list or
        tuple of losses (or any iterable: a map) is scaled one by one, as GradScaler does.

        Step the optimizers this loss reaches with `opt.step(scaler)` or `scaler.step(opt)`: a
        step without the scaler would apply scaled gradients, and is refused (Note [A scaled
        backward awaits its step] in scaled_graphs.py).
        """
        if not self._enabled:
            return loss
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(x) for x in loss)
        if isinstance(loss, Iterable) and not isinstance(loss, torch.Tensor):
            return map(self.scale, loss)
        _check_loss(loss)
        scaled = loss.float() * self.state_tensors(loss.device)[0]
        self.scaled_graphs.watch(scaled)
        return scaled

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 device tensor (created on the CPU if unused yet)."""
        return self.state_tensors(self._device())[0]

    @property
    def skipped_steps(self) -> torch.Tensor:
        """How many step rounds saw inf/nan gradients (and skipped the steps they reached), as a
        0-dim int64 device tensor: counted on the device, read only by whoever logs it."""
        return self.state_tensors(self._device())[3]

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reads it from the device."""
        if not self._enabled:
            return 1.0
        return float(self._init[0]) if self._state is None else self._state[0].item()

    def is_enabled(self) -> bool:
        return self._enabled

    def set_scale(self, value: float) -> None:
        """Overwrite the current scale (for static scales set by hand, like Apex's setter)."""
        self._set_scale(check_scale_value(value, "set_scale(value)"))

    def _set_scale(self, value: Any) -> None:
        if self._state is None:
            self._init = (float(value), *self._init[1:])
        elif isinstance(value, torch.Tensor):
            self._state[0].copy_(value.reshape(()))
        else:
            self._state[0].fill_(float(value))

    # ------------------------------------------------------ torch.amp.GradScaler's protocol
    def unscale_(self, optimizer: Any) -> None:
        """GradScaler's `unscale_`: `.grad` of `optimizer`'s parameters holds the unscaled
        gradients until its `step` (to clip or read them); at most once per step.

        Raises:
            ConfigError: a second call before `update()`, float16 parameters in a torch.optim
                optimizer (no fp32 masters; fxamp.optim.AdamW keeps them), not an optimizer.
        """
        if self._enabled:
            self._optimizers.unscale_(self, optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """GradScaler's `step`: unscale (unless `unscale_` did), skip on inf/nan, else
        `optimizer.step(*args, **kwargs)`. fxamp's optimizers take their fused step (no host
        read; returns None); a torch.optim step reads the overflow flag, as GradScaler does.

        Raises:
            ConfigError: a closure, a second step before `update()`, what `unscale_` refuses.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        return self._optimizers.step(self, optimizer, args, kwargs)

    def update(self, new_scale: Any = None) -> None:
        """GradScaler's `update`: move the scale by the overflow of every optimizer unscaled or
        stepped since the last update (no host read), or set it to `new_scale` (a number or a
        1-element tensor); every optimizer is READY again.

        fxamp's older form `update(found_inf)`, a 0-dim bool tensor, is `advance(found_inf)`.

        Raises:
            ConfigError: no `step`/`unscale_` since the last update (with `opt.step(scaler)` the
                scale moved already), or a bad `new_scale`.
        """
        if isinstance(new_scale, torch.Tensor) and new_scale.dtype == torch.bool:
            self.advance(new_scale)
            return
        if not self._enabled:
            return
        value = None if new_scale is None else check_new_scale(new_scale)
        found = self._optimizers.pop_found(self.scale_tensor.device, needed=value is None)
        if found is not None:
            self.advance(found, move=value is None)
        if value is not None:
            self._set_scale(value)

    def advance(self, found_inf: torch.Tensor, *, move: bool = True) -> None:
        """Count a step round whose overflow flag is `found_inf` (0-dim) and move the dynamic
        scale by it (`move=False`: count only)."""
        if not self.rule.moves:
            return  # a held view (scaler_protocol.held): update() moves the scale
        rule = self.rule if move else self.rule._replace(dynamic=False)
        fn = self._update if rule.dynamic else update_in_place
        fn(self.state_tensors(found_inf.device), found_inf.bool(), rule)

    def optimizer_state(self, optimizer: Any) -> OptState:
        """Where `optimizer` is in GradScaler's protocol since the last `update()`."""
        return self._optimizers.stage(optimizer)

    def get_growth_factor(self) -> float:
        return self.rule.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.rule = self.rule._replace(growth_factor=check_growth_factor(new_factor))

    def get_backoff_factor(self) -> float:
        return self.rule.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.rule = self.rule._replace(backoff_factor=check_backoff_factor(new_factor))

    def get_growth_interval(self) -> int:
        return self.rule.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.rule = self.rule._replace(growth_interval=check_growth_interval(new_interval))

    def _device(self) -> torch.device:
        return torch.device("cpu") if self._state is None else self._state[0].device

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus fxamp's ({} when disabled, as GradScaler's); reads the scale
        back from the device."""
        if not self._enabled:
            return {}
        scale, tracker, hyst, skipped = self._init if self._state is None else (
            t.item() for t in self._state)
        return {"scale": scale, "growth_factor": self.rule.growth_factor,
                "backoff_factor": self.rule.backoff_factor,
                "growth_interval": self.rule.growth_interval, "_growth_tracker": int(tracker),
                "hysteresis_left": int(hyst), "skipped_steps": int(skipped),
                "semantics": self.semantics, "dynamic": self.rule.dynamic}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load fxamp's, torch GradScaler's or one Apex loss scaler's state.

        Apex's `amp.state_dict()` holds one entry per loss ("loss_scaler0", ...); pass the entry
        of this scaler, or use `fxamp.optim.load_amp_state_dict` for all of them.
        """
        if not self._enabled:
            return
        *values, rule_fields = parse_scaler_state(single_scaler_entry(state_dict), self.rule)
        self.rule = self.rule._replace(**rule_fields)  # every value was checked first
        if self._state is None:
            self._init = tuple(values)
        else:
            for t, v in zip(self._state, values):
                t.fill_(v)
        log.debug("loaded loss scaler: scale %s, tracker %s", *values[:2])

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
