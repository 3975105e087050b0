"""Apex's `amp.state_dict()` / `amp.load_state_dict(sd)`: the loss scalers of an `initialize`
call, in Apex's format (`{"loss_scaler0": {"loss_scale", "unskipped"}, ...}`).

# Note [Where amp.state_dict() finds its scalers]
Apex kept its scalers in a module global (`_amp_state.loss_scalers`), so `amp.state_dict()`
took no argument. fxamp keeps no state of its own: the scalers of an `initialize` call are held
by the optimizers it returned (`opt.loss_scalers`, shared by all of them) and live exactly as
long as they do. What `amp.state_dict()` needs is only a way to *find* them, so `initialize`
enters each optimizer it returns in `_RETURNED`, a weak set: it holds nothing alive and
decides nothing, it is an index of objects the user holds. The scalers of the live optimizers,
grouped by the scalers they share, are the live `initialize` calls. One: that call's scalers.
None, or several (two `initialize` calls whose optimizers are both alive, which Apex did not
support either): a ConfigError that names the fix, passing the optimizer
(`amp.state_dict(optimizer)`). Before refusing several, a garbage collection drops optimizers
that only reference cycles kept in the set.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Mapping, Optional

from fxamp.errors import ConfigError
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.state_checks import parse_scaler_state

__all__ = ["state_dict", "load_state_dict", "amp_state_dict", "load_amp_state_dict",
           "register"]

_RETURNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # see the Note


def register(optimizers: list) -> None:
    """`initialize` returned these optimizers (Note [Where amp.state_dict() finds its
    scalers])."""
    _RETURNED.update(optimizers)


def state_dict(optimizer: Any = None) -> dict[str, dict[str, Any]]:
    """Apex's `amp.state_dict()`: `{"loss_scaler0": {"loss_scale", "unskipped"}, ...}` for the
    loss scalers of the one live `initialize` call, or of the one that returned `optimizer`.
    Reads the scales back from the device.

    Raises:
        ConfigError: no `initialize` call with optimizers is alive, or several are and no
            optimizer says which (Note [Where amp.state_dict() finds its scalers]).
    """
    out = {}
    for i, scaler in enumerate(_scalers(optimizer, "state_dict")):
        sd = scaler.state_dict()
        out[f"loss_scaler{i}"] = {"loss_scale": sd["scale"], "unskipped": sd["_growth_tracker"]}
    return out


def load_state_dict(state_dict: Mapping[str, Any], optimizer: Any = None) -> None:
    """Apex's `amp.load_state_dict(sd)`: load `{"loss_scalerK": ...}` into the scalers that
    `state_dict()` would save. Every entry is checked before any scaler changes.

    Raises:
        ConfigError: as `state_dict`; or entries that are not the scalers' `loss_scaler0` ..
            `loss_scaler{num_losses-1}`, or a bad value (named).
    """
    scalers = _scalers(optimizer, "load_state_dict")
    if not isinstance(state_dict, Mapping):
        raise ConfigError(f"amp.load_state_dict takes the dict amp.state_dict() returned, not "
                          f"{type(state_dict).__name__}")
    expected = [f"loss_scaler{i}" for i in range(len(scalers))]
    if sorted(state_dict) != sorted(expected):
        raise ConfigError(f"the amp state dict holds {sorted(state_dict)}, the scalers of this "
                          f"initialize call are {expected} (num_losses={len(scalers)}); "
                          "initialize with the num_losses the checkpoint was saved with")
    for key, scaler in zip(expected, scalers):
        try:
            parse_scaler_state(state_dict[key], scaler.rule)
        except ConfigError as e:
            raise ConfigError(f"amp state dict entry {key!r}: {e}") from None
    for key, scaler in zip(expected, scalers):
        scaler.load_state_dict(state_dict[key])


def amp_state_dict(optimizer: Any) -> dict[str, dict[str, Any]]:
    """`state_dict(optimizer)`: the scalers `initialize` attached to `optimizer`."""
    return state_dict(_required(optimizer, "amp_state_dict"))


def load_amp_state_dict(optimizer: Any, state_dict: Mapping[str, Any]) -> None:
    """`load_state_dict(state_dict, optimizer)`."""
    load_state_dict(state_dict, _required(optimizer, "load_amp_state_dict"))


def _required(optimizer: Any, call: str) -> Any:
    if optimizer is None:
        raise ConfigError(f"{call}(optimizer) takes an optimizer initialize returned; "
                          "fxamp.state_dict() without one finds the scalers itself")
    return optimizer


def _scalers(optimizer: Any, call: str) -> tuple[LossScaler, ...]:
    if optimizer is not None:
        scalers = getattr(optimizer, "loss_scalers", None)
        if not scalers:
            raise ConfigError(f"{type(optimizer).__name__} has no loss scalers: pass an "
                              "optimizer returned by fxamp.initialize")
        return tuple(scalers)
    calls = _live_calls()
    if len(calls) > 1:
        gc.collect()  # optimizers that only reference cycles keep alive
        calls = _live_calls()
    if not calls:
        raise ConfigError(f"amp.{call}() found no optimizer returned by fxamp.initialize that "
                          "is still alive: call initialize(models, optimizers, ...) first, and "
                          "keep the optimizers it returns (the loss scalers live in them)")
    if len(calls) > 1:
        names = "; ".join(", ".join(type(o).__name__ for o in opts) for opts in calls.values())
        raise ConfigError(f"amp.{call}() is ambiguous: {len(calls)} initialize calls have live "
                          f"optimizers ({names}), each with its own loss scalers. Pass the "
                          f"optimizer whose scalers you mean: amp.{call}(" +
                          ("optimizer)" if call == "state_dict" else "state_dict, optimizer)"))
    (opts,) = calls.values()
    return tuple(opts[0].loss_scalers)


def _live_calls() -> dict[int, list]:
    # One entry per set of shared scalers: initialize gives all its optimizers the same ones.
    calls: dict[int, list] = {}
    for opt in list(_RETURNED):
        scalers = getattr(opt, "loss_scalers", ())
        if scalers:
            calls.setdefault(id(scalers[0]), []).append(opt)
    return calls
