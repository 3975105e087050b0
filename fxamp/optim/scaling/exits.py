"""Apex's `scale_loss` exits: each call's gradients are unscaled by the scale its loss was
multiplied by, checked on their own, and move the scale, without a host read.

# Note [Apex's scale_loss exits]
Apex unscaled at every `scale_loss` exit: the gradients of that backward, divided by the scale
of that loss, were checked for inf/nan, `update_scale` moved the scale, and on overflow the next
`step()` of every optimizer passed to that call was a skip. So with one scaler shared by several
optimizers and several losses (Apex's default `num_losses=1`) each optimizer unscales by the
scale its gradients were made with, the next loss is scaled by the scale the last exit left, and
an overflow in a loss over `[opt0]` skips opt0 only, while an overflow anywhere in a loss over
`[opt0, opt1]` skips both.

fxamp keeps that rule but not its cost in the common loop. An exit is recorded on the scaler
(`record_exit`: its ScaleRound keeps the optimizers of the call, ExitState PENDING) and
*resolved* before anything can tell the difference: before the scaler scales another loss (the
scale must be the one the exit left), before another backward reaches the optimizers' gradients
(the next `scale_loss` entry), and at their `step`, `zero_grad`, `unscale_` or `master_params`.
Resolving folds each optimizer's raw gradients, divided by the scale they carry, into its fp32
buffer (`fused_step.fold_grads`, one pass, no host read) and ORs their overflow into one device
flag per exit; the scaler moves by that flag (`LossScaler.update`, on the device) and every
optimizer of the call keeps the flag: its step ORs all its exits' flags into the skip (a select
inside the compiled step). When the only thing left is one optimizer stepping the one exit it
alone was in, with nothing folded (one loss, one optimizer: the usual loop), its fused step *is*
the resolution: the prologue checks, unscales by the live scale (unchanged since the exit) and
moves the scale, in one graph. `delay_unscale=True` records no exit: the gradients keep their
scale, as in Apex, for the next exit (or step) to take.

That deferred resolution is what `scale_loss(..., unscale_on_exit=False)` does. By default an
exit is resolved at once and leaves `.grad` unscaled (`unscale_at_exit`, Note [.grad after a
scale_loss exit] in folding.py): the same fold and flag, in place, in one pass.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from fxamp.optim.scaling.folding import GradientFolding
from fxamp.optim.scaling.loss_scaler import LossScaler

__all__ = ["ExitOptimizer", "record_exit", "unscale_at_exit", "resolve_pending_exit",
           "resolve_exit_of", "resolve_unless_step_takes_exit", "hand_exit_to_step"]


class ExitOptimizer(Protocol):
    """What the exits call on an optimizer (FusedOptimizer, FP16_Optimizer)."""

    folding: GradientFolding

    def after_backward(self, scaler: LossScaler) -> None: ...

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None: ...

    def unscale_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None: ...

    def agree_exit_flag_(self, flag: torch.Tensor) -> None: ...


def record_exit(scaler: LossScaler, optimizers: Sequence[ExitOptimizer]) -> None:
    """A scale_loss exit: the optimizers' raw gradients now carry `scaler`'s scale, and the
    exit awaits resolution (ExitState NONE -> PENDING)."""
    for opt in optimizers:
        opt.after_backward(scaler)
    scaler.scale_round.record_exit(optimizers)


def unscale_at_exit(scaler: LossScaler, optimizers: Sequence[ExitOptimizer]) -> torch.Tensor:
    """A scale_loss exit resolved at once: `.grad` of the optimizers unscaled in place, their
    overflow flagged for their steps, the scale moved by it."""
    return _resolve(scaler, optimizers, lambda opt, flag: opt.unscale_exit(scaler, flag))


def resolve_pending_exit(scaler: LossScaler) -> Optional[torch.Tensor]:
    """Fold the pending exit's gradients, flag their overflow and move the scale by it
    (ExitState PENDING -> NONE); None if no exit was pending."""
    optimizers = scaler.scale_round.end_exit()
    if not optimizers:
        return None
    return _resolve(scaler, optimizers, lambda opt, flag: opt.fold_exit(scaler, flag))


def _resolve(scaler: LossScaler, optimizers: Sequence[ExitOptimizer],
             take_grads: Callable[[ExitOptimizer, torch.Tensor], None]) -> torch.Tensor:
    flag = torch.zeros((), dtype=torch.bool, device=optimizers[0].folding.device)
    for opt in optimizers:
        take_grads(opt, flag)
    for opt in optimizers:
        opt.agree_exit_flag_(flag)
    scaler.update(flag)
    return flag


def _pending_exit_of(opt: ExitOptimizer) -> Optional[LossScaler]:
    """The scaler whose pending exit `opt`'s raw gradients wait in, if any."""
    scaler = opt.folding.raw_scaler
    pending = scaler is not None and scaler.scale_round.exit_includes(opt)
    return scaler if pending else None


def resolve_exit_of(opt: ExitOptimizer) -> None:
    """Resolve the exit `opt`'s raw gradients wait in, if any."""
    scaler = _pending_exit_of(opt)
    if scaler is not None:
        resolve_pending_exit(scaler)


def resolve_unless_step_takes_exit(opt: ExitOptimizer) -> None:
    """Before `opt` steps: resolve its pending exit, unless its fused step can take the exit
    whole (`opt` alone in it, nothing folded)."""
    scaler = _pending_exit_of(opt)
    if scaler is None:
        return
    alone = len(scaler.scale_round.exit_optimizers) == 1 and opt.folding.folds_nothing()
    if not alone:
        resolve_pending_exit(scaler)


def hand_exit_to_step(opt: ExitOptimizer) -> None:
    """`opt`'s fused step checks, unscales and moves the scale of the exit it alone was in:
    the exit is no longer pending (ExitState PENDING -> NONE)."""
    scaler = _pending_exit_of(opt)
    if scaler is not None:
        scaler.scale_round.end_exit()
