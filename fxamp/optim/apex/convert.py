"""torch's Adam, AdamW and SGD as fxamp's fused counterparts, with the same param groups and
hyperparameters: what `initialize` (and `LARC` of a torch optimizer) builds in their place."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from fxamp.optim import optimizers
from fxamp.optim.optimizer import FusedOptimizer

__all__ = ["fused_class", "to_fused"]

_NATIVE = {torch.optim.AdamW: optimizers.AdamW, torch.optim.Adam: optimizers.Adam,
           torch.optim.SGD: optimizers.SGD}
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "differentiable")
_DROPPED_KEYS = ("foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad",
                 "decoupled_weight_decay", "initial_lr", "param_names")


def fused_class(opt: torch.optim.Optimizer) -> Optional[type]:
    """The fused class `opt` becomes, or None when fxamp has none for its rule or flags."""
    if isinstance(opt, FusedOptimizer):
        return type(opt)
    cls = _NATIVE.get(type(opt))
    if cls is None or any(g.get(flag) for g in opt.param_groups for flag in _UNSUPPORTED_FLAGS):
        return None
    if cls is optimizers.Adam and opt.param_groups[0].get("decoupled_weight_decay"):
        return optimizers.AdamW
    return cls


def to_fused(opt: torch.optim.Optimizer, cls: type, *, master_weights: bool,
             compile: bool) -> FusedOptimizer:
    """A new `cls` over `opt`'s param groups and defaults (its state is not carried over); an
    fxamp optimizer keeps its `max_grad_norm` and `state_format` (initialize carries its LARC
    settings over).

    The defaults matter to a group added later: `add_param_group({"params": ..., "lr": ...})`
    takes every other hyperparameter (SGD's momentum, Adam's betas) from them, as torch.optim's
    does, so they are `opt`'s, not `cls`'s own.
    """
    groups = [{k: v for k, v in g.items() if k not in _DROPPED_KEYS} for g in opt.param_groups]
    accepted = inspect.signature(cls.__init__).parameters
    extra: dict[str, Any] = {k: v for k, v in opt.defaults.items()
                             if k in accepted and k not in _DROPPED_KEYS and k != "params"}
    if isinstance(opt, FusedOptimizer):  # its own settings, besides the param groups
        extra.update(max_grad_norm=opt.max_grad_norm, state_format=opt.state_format)
    return cls(groups, master_weights=master_weights, compile=compile, **extra)
