"""Folding gradients that carry different loss scales: the bookkeeping FusedOptimizer and
FP16_Optimizer share.

Raw gradients carry the scale of the loss whose backward produced them. When a backward with
another scaler is about to add to them (several losses), or when several optimizers must skip
together (one loss over several optimizers), they are folded: added, unscaled, to fp32 buffers
by `fused_step.fold_grads`, which ORs their overflow into the scaler's flag for this step. The
optimizer remembers the scalers it folded; at its step it skips if any of them saw an overflow,
then lets each scaler move by its own flag (once, after the last optimizer of the round).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from fxamp.optim import fused_step
from fxamp.optim.loss_scaler import LossScaler

__all__ = ["GradientFolding"]


class GradientFolding:
    """Mixin: `_raw_scaler`, `_involved`, `_device` and `_fold_fn` are set by the subclass."""

    _raw_scaler: Optional[LossScaler]
    _involved: list[LossScaler]
    _device: torch.device
    _fold_fn: Callable

    def fold_pending(self) -> None:
        """Fold the raw gradients with the scale they carry (the subclass knows where to)."""
        raise NotImplementedError

    def before_backward(self, scaler: LossScaler) -> None:
        """Called by scale_loss: fold raw gradients that carry another scaler's scale."""
        if self._raw_scaler is not None and self._raw_scaler is not scaler:
            self.fold_pending()

    def after_backward(self, scaler: LossScaler) -> None:
        """Called by scale_loss: the raw gradients now carry `scaler`'s scale."""
        self._raw_scaler = scaler

    def _fold(self, scaler: LossScaler, raws: Sequence[torch.Tensor],
              accs: Sequence[torch.Tensor]) -> None:
        inv_scale = fused_step.inverse(scaler.state_tensors(self._device)[0])
        self._fold_fn(raws, accs, inv_scale, scaler.round_found(self._device))
        self._involve(scaler)

    def _involve(self, scaler: LossScaler) -> None:
        """The raw gradients, which carried `scaler`'s scale, were taken into fp32."""
        scaler.scaled_graphs.mark_done(self)
        if scaler not in self._involved:
            self._involved.append(scaler)
            scaler.join_round(id(self))
        self._raw_scaler = None

    def _round_found(self) -> torch.Tensor:
        """Whether any scaler folded this step saw an overflow (a 0-dim device flag)."""
        return torch.stack([s.round_found(self._device) for s in self._involved]).any()

    def _end_round(self) -> None:
        for scaler in self._involved:
            scaler.leave_round(id(self))
        self._involved = []
