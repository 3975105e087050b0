"""What a FusedOptimizer does when gradients of several losses meet, and what Apex's
`scale_loss`, `unscale_` and `master_params` call on it: folding gradients into fp32 sums
(scaling/folding.py), resolving scale_loss exits (scaling/exits.py), gathering master gradients
(scaling/master_grads.py), and the steps that take each of those instead of the raw gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from fxamp.errors import ConfigError
from fxamp.optim import distributed, param_groups
from fxamp.optim.scaling import exits, scaled_graphs
from fxamp.optim.scaling.folding import GradientFolding
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.scaling.master_grads import MasterGrads

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from fxamp.optim.buffers.device_state import DeviceState

__all__ = ["FoldedSteps", "check_scaler_arg"]


class FoldedSteps:
    """The part of FusedOptimizer (optimizer.py) that folds, unscales and gathers gradients."""

    folding: GradientFolding
    master_grads: MasterGrads
    max_grad_norm: Optional[float]
    param_groups: list[dict[str, Any]]
    _device_state: DeviceState
    _unit: LossScaler
    _group: Optional[ProcessGroup]
    _left_out: list[tuple]
    _fused_step: Callable[..., None]

    def unscale_(self, scaler: Optional[LossScaler] = None) -> None:
        """Fold the gradients so far, divided by `scaler`'s scale, into fp32 buffers.

        Needed only when gradients from losses with different scalers meet in one step, or to
        read unscaled gradients (`fxamp.optim.master_params`); `step` folds the rest and skips
        if any folded scaler saw an overflow. Each scaler then moves by its own overflow.
        """
        check_scaler_arg(scaler, "unscale_")
        exits.resolve_exit_of(self)
        self._fold_unscaled()
        folding = self.folding
        if scaler is None and folding.raw_scaler is None and not folding.folds_nothing():
            return  # everything since the last backward is folded already
        scaler = scaler or folding.scaler_to_divide_by()  # Note [Which scaler a step divides by]
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, self._device_state.flat_params(),
                                                 "unscale_")
            scaler = self._unit
        folding.fold(scaler, *self._device_state.fold_buffers(), owner=self)

    def before_backward(self, scaler: LossScaler) -> None:
        """A backward with `scaler` is about to add to the gradients: resolve the exit they
        wait in, and fold them if they carry another scaler's scale."""
        exits.resolve_exit_of(self)
        scaled_graphs.release_dropped(self, self._device_state.flat_params)
        self._fold_unscaled()
        if self.folding.raw_scaler is self._unit and self._all_grads_dropped():
            self.folding.raw_scaler = None  # `model.zero_grad()` dropped the unscaled ones
        if self.folding.carries_other(scaler):
            self.unscale_(self.folding.raw_scaler)

    def after_backward(self, scaler: LossScaler) -> None:
        """The raw gradients now carry `scaler`'s scale."""
        self.folding.raw_scaler = scaler

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """Resolve a scale_loss exit into `flag` (Note [Apex's scale_loss exits])."""
        self.folding.fold_exit(scaler, flag, *self._device_state.fold_buffers(), owner=self)

    def unscale_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """A scale_loss exit: unscale `.grad` in place, overflow into `flag` (Note [.grad after
        a scale_loss exit] in folding.py)."""
        raws, accs, keep = [], [], []
        for b in self._device_state.buckets:
            b.sync_from_params()
            if b.master is not None and b.acc is None:
                b.acc = torch.zeros(b.grad.shape, dtype=torch.float32,
                                    device=self._device_state.device)
            raws.append(b.grad)
            accs.append(b.acc)
            keep.append(b.master is not None)
        self.folding.unscale_exit(scaler, flag, raws, accs, tuple(keep), owner=self)
        self.folding.raw_scaler = self._unit

    def _fold_unscaled(self) -> None:
        if self.folding.unscaled is not None:
            self.folding.fold_unscaled(*self._device_state.fold_buffers())

    def _all_grads_dropped(self) -> bool:
        return all(p.grad is None for p in self._device_state.flat_params())

    def _step_from_unscaled(self) -> None:
        # Note [.grad after a scale_loss exit]: the kept fp32 sums, or .grad as written since.
        buckets = self._device_state.buckets
        unscaled = self.folding.unscaled
        edited = unscaled.absorb_edits([b.grad for b in buckets], [b.acc for b in buckets])
        grads = [b.acc if keep else b.grad for b, keep in zip(buckets, unscaled.keep)]
        self._fused_step(grads, None, check=edited or self.max_grad_norm is not None,
                         found_in=self.folding.found())
        for b, keep in zip(buckets, unscaled.keep):
            if keep:
                b.acc.zero_()
        self.folding.finish_step()

    def agree_exit_flag_(self, flag: torch.Tensor) -> None:
        """OR an exit's flag over this optimizer's process group, if it has one."""
        if self._group is not None:
            distributed.agree_flags_([flag], self._group)

    def unscale_in_place_(self, scaler: Optional[LossScaler] = None) -> None:
        """`fxamp.optim.unscale_`: settle a pending scale_loss exit, fold what still carries a
        scale, and move the unscaled sum back into `.grad`; a no-op once done."""
        check_scaler_arg(scaler, "unscale_")
        exits.resolve_exit_of(self)
        if self.folding.raw_scaler is self._unit:
            return  # done already, and no backward through scale_loss since
        carried = self.folding.scaler_to_divide_by(scaler)
        if carried is not None or self.folding.folds_nothing():
            self.unscale_(carried)
        self._unfold()

    def _unfold(self) -> None:
        # The folded fp32 sum goes back into the raw gradients, which then carry no scale.
        for b in self._device_state.buckets:
            b.grad.copy_(b.acc)
            b.acc.zero_()
        self.folding.raw_scaler = self._unit

    def gather_master_grads(self) -> None:
        """Compute the unscaled master gradients that `fxamp.optim.master_params` yields, from
        the raw ones and the scale they carry (Note [Gathered master gradients])."""
        param_groups.check_left_out(self._left_out, type(self).__name__)
        exits.resolve_unless_step_takes_exit(self)
        scaler = self.folding.scaler_to_divide_by()
        state = self._device_state
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, state.flat_params(), "master_params")
        state.sync_from_params()
        sources = None
        unscaled = self.folding.unscaled
        if unscaled is not None:  # Note [.grad after a scale_loss exit]: unscaled already
            b = state.buckets
            unscaled.absorb_edits([x.grad for x in b], [x.acc for x in b])
            sources = [x.acc if keep else x.grad for x, keep in zip(b, unscaled.keep)]
        self.master_grads.gather(state.buckets, scaler, self._unit, state.device, sources)

    def _step_from_gathered(self, scaler: LossScaler, found: torch.Tensor) -> None:
        # The gathered gradients hold the folded ones and the raw ones, unscaled.
        self.folding.record_fold(scaler, self, found=found)
        self._fused_step(self.master_grads.buffers, None, check=True,
                         found_in=self.folding.found())
        for b in self._device_state.buckets:
            b.grad.zero_()  # taken, as a fold takes them
            if b.acc is not None:
                b.acc.zero_()
        self.master_grads.drop()
        self.folding.finish_step()

    def _step_from_folded(self, pending: Optional[LossScaler]) -> None:
        if pending is not None:
            self.unscale_(pending)
        if self._group is not None:  # each scaler then moves by the flag all ranks agree on
            distributed.agree_flags_(self.folding.folded_flags(), self._group)
        self._fused_step(self._device_state.accs(), None, check=True,
                         found_in=self.folding.found())
        for b in self._device_state.buckets:
            b.acc.zero_()
        self.folding.finish_step()


def check_scaler_arg(scaler: object, call: str) -> None:
    """Refuse anything but a LossScaler or None as the `scaler` of `call`."""
    if scaler is None or isinstance(scaler, LossScaler):
        return
    hint = ""
    if isinstance(scaler, torch.amp.GradScaler):
        hint = ("; build fxamp.optim.LossScaler(semantics='torch') instead (its "
                "load_state_dict takes the GradScaler's state_dict())")
    raise ConfigError(f"{call}(scaler) takes an fxamp.optim.LossScaler (or nothing), not "
                      f"{type(scaler).__name__}{hint}")
