"""torch's Adam, AdamW and SGD as fxamp's fused counterparts, with the same param groups and
hyperparameters: what `initialize` (and `LARC` of a torch optimizer) builds in their place.

# Note [Schedulers of a replaced optimizer]
Apex's `amp.initialize` returned the optimizer it was given, so an lr scheduler built on it
before (transformers' `get_linear_schedule_with_warmup(optimizer, ...)`, a `LambdaLR` passed
to `accelerator.prepare` with the optimizer) kept driving it. fxamp returns a new, fused
optimizer. A scheduler holds its optimizer and reads and writes `optimizer.param_groups` at every
step (the lr, OneCycleLR's momentum, its own `initial_lr`, `max_lr`, ... keys), so the torch
optimizer's `param_groups` become the fused optimizer's own list: every scheduler built on the
torch optimizer, found by fxamp or not, drives the optimizer that trains, whose step reads its
hyperparameters from its groups at every step. The keys a scheduler added are kept; only
torch's flags (foreach, fused, ...) are dropped. The torch optimizer itself must not be stepped
any more (its parameters are the fused optimizer's now): its `step` refuses, naming the fix,
before it changes anything (a step pre-hook, torch's public one), where it would otherwise
update the parameters a second time with fresh moments, silently.

Two more things follow the schedulers. torch's scheduler warns at its first `step()` when the
optimizer it was built on never stepped ("Detected call of `lr_scheduler.step()` before
`optimizer.step()`"); that one never steps now, so each step of the fused optimizer tells the
replaced one's schedulers that a step ran. And an fxamp optimizer rebuilt this way (built on the
model before fxamp cast or moved it) hands over: its flat buffers and states are freed, so the
schedulers, callbacks and user variables that still hold it do not hold a second copy of the
weights.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Optional

import torch

from fxamp import _compat
from fxamp.optim import optimizers, param_groups
from fxamp.optim.optimizer import FusedOptimizer

__all__ = ["fused_class", "to_fused"]

_NATIVE = {torch.optim.AdamW: optimizers.AdamW, torch.optim.Adam: optimizers.Adam,
           torch.optim.SGD: optimizers.SGD}
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "differentiable")
_DROPPED_KEYS = ("foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad",
                 "decoupled_weight_decay", "param_names")


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
    settings over). `opt.param_groups` becomes the new optimizer's, so that the lr schedulers
    built on `opt` drive it, and an fxamp `opt` frees its buffers (Note [Schedulers of a
    replaced optimizer]).

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
    new = cls(groups, master_weights=master_weights, compile=compile, **extra)
    opt.param_groups = new.param_groups  # everything is built: from here on `opt` changes
    new.register_step_post_hook(_tell_schedulers_of(opt))
    if isinstance(opt, FusedOptimizer):
        opt.hand_over()
    else:  # its own step refuses before it changes anything (a pre-hook raises first)
        opt.register_step_pre_hook(_refuse_step)
    return new


def _refuse_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A replaced torch optimizer's step: its groups are the fused optimizer's now, and a step
    would update the same parameters a second time, with fresh moments and no masters."""
    param_groups.check_not_handed_over(True, type(optimizer).__name__)


def _tell_schedulers_of(replaced: torch.optim.Optimizer) -> Callable[..., None]:
    """A step hook telling the lr schedulers built on `replaced` that a step ran."""
    ref = weakref.ref(replaced)  # the new optimizer does not keep the old one alive

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        old = ref()
        if old is not None:
            _compat.mark_stepped_for_schedulers(old)

    return hook
