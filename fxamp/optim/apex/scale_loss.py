"""Apex's `amp.scale_loss`, and `unscale_` (torch's `GradScaler.unscale_`) for code that reads
or clips `.grad` between the backward and the step (Note [Apex's scale_loss exits])."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from fxamp.errors import ConfigError
from fxamp.optim.scaling import exits
from fxamp.optim.apex.fp16_optimizer import FP16_Optimizer
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.optimizer import FusedOptimizer

__all__ = ["scale_loss", "unscale_"]


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0,
               model: Optional[torch.nn.Module] = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False, *,
               unscale_on_exit: Optional[bool] = None) -> Iterator[torch.Tensor]:
    """Apex's `amp.scale_loss`: yields `loss.float() * scale` for `backward()`.

    As in Apex, each call's gradients are unscaled by the scale this loss was multiplied by and
    checked on their own; the scale moves by that call's overflow, and on overflow the next
    step of every optimizer passed here is skipped (Note [Apex's scale_loss exits]). After the
    block `.grad` holds the unscaled gradients, as in Apex, so code that clips
    `model.parameters()` or logs gradient norms there sees real values (one fused pass, no
    host read; Note [.grad after a scale_loss exit] in docs/design.md). `delay_unscale=True` leaves
    the gradients scaled for a later call (gradient accumulation); `delay_overflow_check`
    changes nothing. An optimizer that did not come from `initialize` (e.g. with
    enabled=False) gets the loss unchanged.

    Args:
        unscale_on_exit: False leaves `.grad` scaled after the block and lets the fused step
            unscale (one pass fewer, for loops that read no gradient before the step); default
            (None): unscale unless `delay_unscale`.

    Raises:
        ConfigError: `loss_id` not an int (a LossScaler passed third is named, with or
            without `initialize`), outside the `num_losses` given to `initialize`,
            `unscale_on_exit=True` with `delay_unscale`, an optimizer not from `initialize` in a
            list.
    """
    opts = tuple(optimizers) if isinstance(optimizers, (list, tuple)) else (optimizers,)
    scalers = getattr(opts[0], "loss_scalers", None) if opts else None
    if not scalers:
        _check_loss_id_type(loss_id)  # a scaler passed third would otherwise be ignored
        yield loss
        return
    _check_scale_loss(opts, len(scalers), loss_id, delay_unscale, unscale_on_exit)
    scaler = scalers[loss_id]
    exits.resolve_pending_exit(scaler)  # this loss gets the scale the last exit left
    for opt in opts:
        opt.before_backward(scaler)
    yield scaler.scale(loss)
    if delay_unscale:
        for opt in opts:
            opt.after_backward(scaler)
        return
    if unscale_on_exit is False:
        exits.record_exit(scaler, opts)
    else:
        exits.unscale_at_exit(scaler, opts)


def _check_loss_id_type(loss_id: Any) -> None:
    if isinstance(loss_id, LossScaler):
        raise ConfigError(
            f"scale_loss(loss, optimizers, {loss_id!r}): the third argument is loss_id (an int), "
            "not a LossScaler. scale_loss uses the scalers fxamp.optim.initialize gave the "
            "optimizers; with a LossScaler of your own, backpropagate scaler.scale(loss) and "
            "call opt.step(scaler)")
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise ConfigError(f"loss_id={loss_id!r} must be an int (the index of the loss, "
                          "0..num_losses-1 of fxamp.optim.initialize)")


def _check_scale_loss(opts: tuple, num_losses: int, loss_id: Any, delay_unscale: Any,
                      unscale_on_exit: Any) -> None:
    _check_loss_id_type(loss_id)
    if not 0 <= loss_id < num_losses:
        raise ConfigError(f"loss_id={loss_id!r} is out of range: initialize(num_losses="
                          f"{num_losses}) made loss ids 0..{num_losses - 1}")
    for i, opt in enumerate(opts):
        if not isinstance(opt, (FusedOptimizer, FP16_Optimizer)):
            raise ConfigError(f"optimizers[{i}] is a {type(opt).__name__}; pass the optimizers "
                              "fxamp.optim.initialize returned")
    if unscale_on_exit is not None and not isinstance(unscale_on_exit, bool):
        raise ConfigError(f"unscale_on_exit={unscale_on_exit!r} must be True, False or None")
    if unscale_on_exit is True and delay_unscale:
        raise ConfigError("unscale_on_exit=True with delay_unscale=True: delay_unscale leaves "
                          "the gradients scaled for a later scale_loss; pass one of them")


def unscale_(optimizer: Any, scaler: Optional[LossScaler] = None) -> None:
    """torch's `GradScaler.unscale_` for fxamp's optimizers: from here to the step, `.grad` of
    the parameters in `optimizer.param_groups` holds the unscaled gradients (in the
    parameters' dtype), to read or clip (`clip_grad_norm_(model.parameters(), ...)`).

    Fused and without a host read; idempotent until the next backward, and the step does not
    unscale again. Call it after the last backward of the step. It settles a pending
    `scale_loss` exit as Apex's exit did (Note [Apex's scale_loss exits]); without
    `scale_loss`, pass the LossScaler the gradients carry (default: initialize's first). For
    16-bit parameters with fp32 masters (O2), `master_params` gives the unscaled gradients in
    fp32 instead: here they are rounded to the model's dtype, as Apex's O3 did.

    Raises:
        ConfigError: not an fxamp optimizer, or `scaler` not a LossScaler.
    """
    if isinstance(optimizer, FP16_Optimizer):
        optimizer.update_master_grads()  # its param_groups hold the fp32 masters
        return
    if not isinstance(optimizer, FusedOptimizer):
        raise ConfigError(f"unscale_ takes an fxamp optimizer (fxamp.optim.AdamW, ... or one "
                          f"initialize returned), not {type(optimizer).__name__}; torch's "
                          "optimizers take torch.amp.GradScaler.unscale_")
    optimizer.unscale_in_place_(scaler)
