"""The guard for 16-bit weights stepped by an optimizer that keeps no fp32 master weights.

# Note [16-bit weights need fp32 masters]
`fxamp.compile(model, opt_level="O2")` (or O3) stores the weights in float16 or bfloat16. A
torch.optim optimizer steps them in place, in that dtype: an update below half a unit in the
last place of a weight (2**-8 of it in bfloat16, 2**-11 in float16) rounds away, so small
learning rates leave many weights unchanged (35 % of a tiny model's weights never moved in 6
AdamW steps), and nothing says so. fxamp's optimizers keep fp32 masters for exactly this. Where
fxamp is handed the optimizer (the GradScaler protocol of a LossScaler, the Lightning plugin) it
refuses float16 weights, as GradScaler refuses to unscale float16 gradients, and warns for
bfloat16 ones (bfloat16 training without masters is a choice some make knowingly). Everywhere
else (a loop that steps the model with `opt.step()`), each model whose weights fxamp stored in
16 bits warns once per optimizer that steps them: Note [Where fxamp sees an optimizer step].
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fxamp.errors import ConfigError, MasterWeightsWarning

__all__ = ["MasterWeightsWarning", "check_master_weights", "guard_master_weights"]

_LOW = (torch.float16, torch.bfloat16)
_WARNED = "_fxamp_warned_no_masters"  # on an optimizer once it was warned about
_FIX = (". Build fxamp.optim.AdamW / Adam / SGD / LAMB over the same parameters, or convert this "
        "optimizer with fxamp.initialize(model, optimizer, opt_level=...) (fp32 masters, fused "
        "unscale and skip), or use opt_level='O1' (fp32 weights)")


def check_master_weights(optimizer: torch.optim.Optimizer, caller: str) -> None:
    """Refuse float16 parameters in a torch.optim `optimizer` (it keeps no fp32 masters); warn
    once per optimizer for bfloat16 ones. fxamp's own optimizers (`fuses_loss_scaling`) are
    never refused: they keep masters unless told not to.

    Raises:
        ConfigError: float16 parameters; the message names them and the fix.
    """
    low = _low_params(optimizer, None)
    if not low:
        return
    what = _what(f"{caller}: this", optimizer, low, "e.g. weights fxamp.compile(model, "
                 "opt_level='O2') stored in 16 bits")
    if low[0][2] == torch.float16:
        raise ConfigError(what + " and float16 gradients cannot be unscaled in place safely "
                          "(torch.amp.GradScaler refuses them too)" + _FIX)
    _warn_once(optimizer, what + _FIX, stacklevel=4)


def guard_master_weights(model: torch.nn.Module, opt_level: str) -> weakref.finalize:
    """Warn once for each optimizer that steps `model`'s 16-bit weights without fp32 masters
    (Note [Where fxamp sees an optimizer step]). Returns the finalizer that removes the guard:
    called when the model is collected, or by whoever calls it first."""
    guard = _Guard(model, opt_level)
    handle = register_optimizer_step_pre_hook(guard)
    return weakref.finalize(model, handle.remove)


class _Guard:
    """torch.optim's step pre-hook for one model (weak references only)."""

    def __init__(self, model: torch.nn.Module, opt_level: str) -> None:
        self._model, self._name = weakref.ref(model), type(model).__name__
        self._opt_level = opt_level
        self._seen: "weakref.WeakSet[Any]" = weakref.WeakSet()  # looked at, once each

    def __call__(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if optimizer in self._seen:
            return
        self._seen.add(optimizer)
        model = self._model()
        low = [] if model is None else _low_params(optimizer, {id(p) for p in model.parameters()})
        if low:
            what = _what(f"fxamp {self._opt_level}:", optimizer, low,
                         f"weights of {self._name} that fxamp.compile stored in 16 bits")
            _warn_once(optimizer, what + _FIX, stacklevel=4)


def _low_params(optimizer: Any, among: Optional[set[int]]) -> list[tuple[int, int, Any]]:
    """(group, position, dtype) of the 16-bit parameters `optimizer` steps without fp32 masters
    (of those in `among`, if given), float16 ones first; none for fxamp's optimizers."""
    if getattr(optimizer, "fuses_loss_scaling", False):
        return []
    low = [(gi, i, p.dtype) for gi, g in enumerate(optimizer.param_groups)
           for i, p in enumerate(g["params"])
           if p.dtype in _LOW and (among is None or id(p) in among)]
    return sorted(low, key=lambda x: x[2] != torch.float16)


def _what(prefix: str, optimizer: Any, low: list, which: str) -> str:
    gi, i, dtype = low[0]
    return (f"{prefix} torch.optim {type(optimizer).__name__} steps {len(low)} "
            f"{str(dtype)[6:]} parameters (param_groups[{gi}]['params'][{i}] first), {which}, "
            "and keeps no fp32 master weights: updates smaller than a weight's precision are "
            "lost")


def _warn_once(optimizer: Any, message: str, stacklevel: int) -> None:
    if optimizer.__dict__.get(_WARNED):
        return
    optimizer.__dict__[_WARNED] = True
    warnings.warn(message, MasterWeightsWarning, stacklevel=stacklevel)
