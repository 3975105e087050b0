"""Folding gradients that carry different loss scales: the bookkeeping FusedOptimizer and
FP16_Optimizer share.

Raw gradients carry the scale of the loss whose backward produced them. When a backward with
another scaler is about to add to them (several losses), or when several optimizers must skip
together (one loss over several optimizers), they are folded: added, unscaled, to fp32 buffers
by `fused_step.fold_grads`, which ORs their overflow into the scaler's flag for this step. The
optimizer remembers the scalers it folded; at its step it skips if any of them saw an overflow,
then lets each scaler move by its own flag (once, after the last optimizer of the round).
`scale_loss` exits fold with a flag of their own instead, and move the scaler when they are
resolved (Note [Apex's scale_loss exits] in exits.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from fxamp.optim import exits, fused_step
from fxamp.optim.loss_scaler import LossScaler

__all__ = ["GradientFolding"]


class GradientFolding:
    """Mixin: the subclass calls `_init_folding` and sets `_device`."""

    _device: torch.device

    def _init_folding(self, fold_fn: Callable) -> None:
        self._fold_fn = fold_fn
        self._raw_scaler: Optional[LossScaler] = None  # the scale the raw gradients carry
        self._involved: list[LossScaler] = []  # scalers folded into the fp32 grads this step
        self._exit_flags: list[torch.Tensor] = []  # overflow flags of this step's resolved exits

    def fold_pending(self) -> None:
        """Fold the raw gradients with the scale they carry (the subclass knows where to)."""
        raise NotImplementedError

    def _fold_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(raw gradients, the fp32 buffers they fold into), ready to fold."""
        raise NotImplementedError

    def before_backward(self, scaler: LossScaler) -> None:
        """Called by scale_loss: resolve the exit the raw gradients wait in, and fold raw
        gradients that carry another scaler's scale."""
        exits.resolve_for(self)
        if self._raw_scaler is not None and self._raw_scaler is not scaler:
            self.fold_pending()

    def after_backward(self, scaler: LossScaler) -> None:
        """Called by scale_loss: the raw gradients now carry `scaler`'s scale."""
        self._raw_scaler = scaler

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """Resolve a scale_loss exit: fold the raw gradients, divided by `scaler`'s scale, OR
        their overflow into the exit's `flag` and keep it for the step (exits.py)."""
        raws, accs = self._fold_buffers()
        self._fold_fn(raws, accs, fused_step.inverse(scaler.state_tensors(self._device)[0]),
                      flag)
        scaler.scaled_graphs.mark_done(self)
        self._raw_scaler = None
        self._exit_flags.append(flag)

    def agree_exit_flag_(self, flag: torch.Tensor) -> None:
        """OR an exit's flag over this optimizer's process group, if it has one."""

    def folds_nothing(self) -> bool:
        """No gradients were folded into fp32 this step."""
        return not self._involved and not self._exit_flags

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
        """Whether any scaler folded this step, or any resolved exit, saw an overflow (a 0-dim
        device flag)."""
        flags = [s.round_found(self._device) for s in self._involved] + self._exit_flags
        return torch.stack(flags).any()

    def _end_round(self) -> None:
        for scaler in self._involved:
            scaler.leave_round(id(self))
        self._involved = []
        self._exit_flags = []
