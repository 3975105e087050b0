"""Apex's `scale_loss` exits: each call's gradients are unscaled by the scale its loss was
multiplied by, checked on their own, and move the scale, without a host read.

An exit is recorded on the scaler's `ScaleRound` (`record_exit`: ExitState PENDING) and
resolved before anything can tell the difference (the next scale, backward, step, zero_grad,
unscale_ or master_params); in the usual loop (one loss, one optimizer) the fused step itself
is the resolution.

Design (docs/design.md): Note [Apex's scale_loss exits], Note [.grad after a scale_loss exit].
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
