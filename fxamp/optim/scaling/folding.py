"""Folding gradients that carry different loss scales: the state FusedOptimizer and
FP16_Optimizer each compose (`opt.folding`), and the rule for which scaler a step divides by.

Gradients of several scalers, losses or optimizers that must skip together are folded (added,
unscaled, into fp32 buffers, their overflow ORed into the scaler's `ScaleRound`); the step skips
if any folded scaler overflowed, and each scaler moves once the last optimizer of its round left.

Design (docs/design.md): Note [Folding gradients of several scales], Note [Which scaler a step
divides by], Note [.grad after a scale_loss exit].
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from fxamp.errors import ConfigError
from fxamp.optim.functional import fused_step
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.scaling.scale_round import ScaleRound

__all__ = ["GradientFolding", "UnscaledBucket", "UnscaledGrads"]


def _round_on(scaler: LossScaler, device: torch.device) -> ScaleRound:
    """`scaler`'s ScaleRound, its state and fold flag on `device`."""
    scaler.state_tensors(device)
    scaler.scale_round.found_on(device)
    return scaler.scale_round


@dataclasses.dataclass
class UnscaledBucket:
    """One bucket's gradients after a scale_loss exit unscaled them."""

    keep: bool  # `acc` holds the fp32 sum the step takes
    version: int  # the raw gradient buffer's version just after the unscale


@dataclasses.dataclass
class UnscaledGrads:
    """An optimizer's gradients after a scale_loss exit unscaled them, one record per bucket
    (Note [.grad after a scale_loss exit])."""

    buckets: list[UnscaledBucket]

    @property
    def keep(self) -> tuple[bool, ...]:
        """Per bucket: `acc` holds the fp32 sum the step takes."""
        return tuple(b.keep for b in self.buckets)

    def absorb_edits(self, raws: Sequence[torch.Tensor],
                     accs: Sequence[Optional[torch.Tensor]]) -> bool:
        """Copy `.grad` written since the unscale into the kept `acc` (then it, not the
        unscaled sum, is taken); whether any bucket was written."""
        edited = False
        for bucket, raw, acc in zip(self.buckets, raws, accs):
            if raw._version == bucket.version:
                continue
            edited = True
            if bucket.keep:
                acc.copy_(raw)
                bucket.version = raw._version
        return edited


class GradientFolding:
    """The folding state of one optimizer: which scale its raw gradients carry, which scalers
    it folded this step, and the flags of the `scale_loss` exits it took part in.

    Args:
        fold_fn, unscale_fn: `fused_step`'s compiled (or eager) `fold_grads`, `unscale_grads`.
        device: where the optimizer's buffers are.
    """

    def __init__(self, fold_fn: Callable, device: torch.device,
                 unscale_fn: Callable = fused_step.unscale_grads) -> None:
        self.device = device
        self.unscaled: Optional[UnscaledGrads] = None  # Note [.grad after a scale_loss exit]
        self._unscale_fn = unscale_fn
        self.loss_scalers: tuple[LossScaler, ...] = ()  # initialize's, one per loss_id
        self.raw_scaler: Optional[LossScaler] = None  # the scale the raw gradients carry
        self._fold_fn = fold_fn
        self._folded: list[LossScaler] = []  # scalers folded into the fp32 grads this step
        self._exit_flags: list[torch.Tensor] = []  # overflow flags of this step's resolved exits

    def set_loss_scalers(self, scalers: Sequence[LossScaler], owner: str) -> None:
        scalers = tuple(scalers)
        if not scalers or not all(isinstance(s, LossScaler) for s in scalers):
            raise ConfigError(f"{owner}.set_loss_scalers takes a non-empty list of "
                              f"fxamp.optim.LossScaler, not {scalers!r}")
        self.loss_scalers = scalers

    def scaler_to_divide_by(self, given: Optional[LossScaler] = None) -> Optional[LossScaler]:
        """The scaler the raw gradients carry: rules 1 to 3 of Note [Which scaler a step
        divides by]."""
        if self.raw_scaler is None and not self._exit_flags and given is None:
            return self.loss_scalers[0] if self.loss_scalers else None
        return self.scaler_carried(given)

    def scaler_carried(self, given: Optional[LossScaler] = None) -> Optional[LossScaler]:
        """Rules 1 and 2 of Note [Which scaler a step divides by] (initialize's first scaler
        left out): what a step must fold before it takes folded gradients."""
        if self.raw_scaler is not None:
            return self.raw_scaler
        return None if self._exit_flags else given

    def carries_other(self, scaler: LossScaler) -> bool:
        """The raw gradients carry a scale other than `scaler`'s: fold them before a backward
        with `scaler` adds to them."""
        return self.raw_scaler is not None and self.raw_scaler is not scaler

    def folds_nothing(self) -> bool:
        """No gradients were folded into fp32 this step."""
        return not self._folded and not self._exit_flags

    def fold(self, scaler: LossScaler, raws: Sequence[torch.Tensor],
             accs: Sequence[torch.Tensor], owner: object) -> None:
        """Add `raws`, divided by `scaler`'s scale, to `accs`; OR their overflow into the
        scaler's round, which this optimizer joins."""
        inv_scale = fused_step.inverse(scaler.state_tensors(self.device)[0])
        self._fold_fn(raws, accs, inv_scale, _round_on(scaler, self.device).found)
        self.record_fold(scaler, owner)

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor, raws: Sequence[torch.Tensor],
                  accs: Sequence[torch.Tensor], owner: object) -> None:
        """Resolve a scale_loss exit: fold `raws`, divided by `scaler`'s scale, OR their
        overflow into the exit's `flag` and keep it for the step (exits.py)."""
        self._fold_fn(raws, accs, fused_step.inverse(scaler.state_tensors(self.device)[0]),
                      flag)
        scaler.scaled_graphs.mark_done(owner)
        self.raw_scaler = None
        self._exit_flags.append(flag)

    def unscale_exit(self, scaler: LossScaler, flag: torch.Tensor,
                     raws: Sequence[torch.Tensor], accs: Sequence[Optional[torch.Tensor]],
                     keep: tuple[bool, ...], owner: object) -> None:
        """A scale_loss exit that leaves `.grad` unscaled: `raws` divided by `scaler`'s scale
        plus `accs`, in place, overflow OR-ed into the exit's `flag`, which the step keeps."""
        self._unscale_fn(raws, accs, keep, fused_step.inverse(
            scaler.state_tensors(self.device)[0]), flag)
        scaler.scaled_graphs.mark_done(owner)
        self.raw_scaler = None
        self._exit_flags.append(flag)
        self.unscaled = UnscaledGrads([UnscaledBucket(k, raw._version)
                                       for k, raw in zip(keep, raws)])

    @torch.no_grad()
    def fold_unscaled(self, raws: Sequence[torch.Tensor],
                      accs: Sequence[torch.Tensor]) -> None:
        """Unscaled gradients become folded ones (all in `acc`, `.grad` zero) before another
        backward adds to them or a fold takes them."""
        unscaled, self.unscaled = self.unscaled, None
        if unscaled is None:
            return
        unscaled.absorb_edits(raws, accs)
        for bucket, raw, acc in zip(unscaled.buckets, raws, accs):
            if not bucket.keep:
                acc.add_(raw)
            raw.zero_()
        self.raw_scaler = None

    def record_fold(self, scaler: LossScaler, owner: object,
                    found: Optional[torch.Tensor] = None) -> None:
        """The raw gradients, which carried `scaler`'s scale, were taken into fp32 (`found`:
        their overflow flag, when they were not folded by `fold`)."""
        scaler.scaled_graphs.mark_done(owner)
        scale_round = _round_on(scaler, self.device)
        if found is not None:
            scale_round.found.logical_or_(found)
        if scaler not in self._folded:
            self._folded.append(scaler)
            scale_round.join(self)
        self.raw_scaler = None

    @property
    def folded_scalers(self) -> tuple[LossScaler, ...]:
        """The scalers folded this step, in the order they were first folded."""
        return tuple(self._folded)

    def folded_flags(self) -> list[torch.Tensor]:
        """The overflow flags of the scalers folded this step (to agree on over ranks)."""
        return [_round_on(s, self.device).found for s in self._folded]

    def found(self) -> torch.Tensor:
        """Whether any scaler folded this step, or any resolved exit, saw an overflow (a 0-dim
        device flag)."""
        return torch.stack(self.folded_flags() + self._exit_flags).any()

    def finish_step(self) -> None:
        """The step took the folded gradients (or they were dropped): leave the round of every
        scaler folded, moving each whose last member this was by its folds' flag."""
        for scaler in self._folded:
            scale_round = _round_on(scaler, self.device)
            if scale_round.leave(self):
                scaler.update(scale_round.found)
                scale_round.clear_found()
        self._folded = []
        self._exit_flags = []
        self.unscaled = None
