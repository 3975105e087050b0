"""Apex's `scale_loss` exits: each call's gradients are unscaled by the scale its loss was
multiplied by, checked on their own, and move the scale, without a host read.

An exit is recorded on the scaler (`LossScaler.pending_exit`) and resolved before anything can
tell the difference (the next scale, backward, step, zero_grad, unscale_ or master_params); in
the usual loop (one loss, one optimizer) the fused step itself is the resolution.

Design (docs/design.md): Note [Apex's scale_loss exits], Note [.grad after a scale_loss exit].
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["close", "unscale", "resolve", "resolve_for", "settle", "take"]


def close(scaler: Any, optimizers: tuple) -> None:
    """A scale_loss exit: the optimizers' raw gradients now carry `scaler`'s scale."""
    for opt in optimizers:
        opt.after_backward(scaler)
    scaler.pending_exit = optimizers


def unscale(scaler: Any, optimizers: tuple) -> torch.Tensor:
    """A scale_loss exit resolved at once: `.grad` of the optimizers unscaled in place, their
    overflow flagged for their steps, the scale moved by it."""
    return _resolve(scaler, optimizers, lambda opt, flag: opt.unscale_exit(scaler, flag))


def resolve(scaler: Any) -> Optional[torch.Tensor]:
    """Fold the pending exit's gradients, flag their overflow and move the scale by it."""
    optimizers = scaler.pending_exit
    if not optimizers:
        return None
    scaler.pending_exit = None
    return _resolve(scaler, optimizers, lambda opt, flag: opt.fold_exit(scaler, flag))


def _resolve(scaler: Any, optimizers: tuple, take_grads: Any) -> torch.Tensor:
    flag = torch.zeros((), dtype=torch.bool, device=optimizers[0].folding.device)
    for opt in optimizers:
        take_grads(opt, flag)
    for opt in optimizers:
        opt.agree_exit_flag_(flag)
    scaler.update(flag)
    return flag


def _exit_of(opt: Any) -> Optional[tuple]:
    scaler = opt.folding.raw_scaler
    exit_ = None if scaler is None else getattr(scaler, "pending_exit", None)
    return exit_ if exit_ and any(o is opt for o in exit_) else None


def resolve_for(opt: Any) -> None:
    """Resolve the exit `opt`'s raw gradients wait in, if any."""
    if _exit_of(opt) is not None:
        resolve(opt.folding.raw_scaler)


def settle(opt: Any) -> None:
    """Before `opt` steps: resolve its exit unless its fused step can take it whole."""
    exit_ = _exit_of(opt)
    if exit_ is not None and not (len(exit_) == 1 and opt.folding.folds_nothing()):
        resolve(opt.folding.raw_scaler)


def take(opt: Any) -> None:
    """`opt`'s step checks, unscales and moves the scale of the exit it alone was in."""
    if _exit_of(opt) is not None:
        opt.folding.raw_scaler.pending_exit = None
