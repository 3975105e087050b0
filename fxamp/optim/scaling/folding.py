"""Folding gradients that carry different loss scales: the state FusedOptimizer and
FP16_Optimizer each compose (`opt.folding`), and the rule for which scaler a step divides by.

Gradients of several scalers, losses or optimizers that must skip together are folded (added,
unscaled, into fp32 buffers, their overflow ORed into the scaler's `FoldRound`); the step skips
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

__all__ = ["GradientFolding", "FoldRound", "UnscaledGrads"]


class FoldRound:
    """One scaler's folds between two moves of its scale: the overflow flag every fold ORs
    into, and the optimizers' foldings that took part and have not stepped yet."""

    def __init__(self, device: torch.device) -> None:
        self.found = torch.zeros((), dtype=torch.bool, device=device)
        self.members: list[GradientFolding] = []

    def join(self, folding: "GradientFolding") -> None:
        if not any(m is folding for m in self.members):
            self.members.append(folding)

    def leave(self, folding: "GradientFolding", scaler: LossScaler) -> None:
        """`folding` stepped (or dropped its gradients); the last one to leave moves the scale
        by the round's flag and starts the next round."""
        self.members = [m for m in self.members if m is not folding]
        if not self.members:
            scaler.update(self.found)
            self.found.zero_()


def round_of(scaler: LossScaler, device: torch.device) -> FoldRound:
    """`scaler`'s current FoldRound, on `device`."""
    scaler.state_tensors(device)
    current = scaler.fold_round
    if current is None:
        current = scaler.fold_round = FoldRound(device)
    elif current.found.device != torch.device(device):
        current.found = current.found.to(device)
    return current


@dataclasses.dataclass
class UnscaledGrads:
    """An optimizer's gradients after a scale_loss exit unscaled them (Note [.grad after a
    scale_loss exit])."""

    keep: tuple[bool, ...]  # per bucket: `acc` holds the fp32 sum the step takes
    versions: list[int]  # each raw gradient buffer's version just after the unscale

    def edited(self, raws: Sequence[torch.Tensor]) -> list[bool]:
        """Per bucket: `.grad` was written since the unscale (then it, not `acc`, is taken)."""
        return [raw._version != v for raw, v in zip(raws, self.versions)]

    def absorb_edits(self, raws: Sequence[torch.Tensor],
                     accs: Sequence[Optional[torch.Tensor]]) -> bool:
        """Copy edited `.grad` into the kept `acc`; whether any bucket was edited."""
        edited = self.edited(raws)
        for i, (raw, acc, keep) in enumerate(zip(raws, accs, self.keep)):
            if keep and edited[i]:
                acc.copy_(raw)
                self.versions[i] = raw._version
        return any(edited)


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
        self._involved: list[LossScaler] = []  # scalers folded into the fp32 grads this step
        self._exit_flags: list[torch.Tensor] = []  # overflow flags of this step's resolved exits

    def set_loss_scalers(self, scalers: Sequence[LossScaler], owner: str) -> None:
        scalers = tuple(scalers)
        if not scalers or not all(isinstance(s, LossScaler) for s in scalers):
            raise ConfigError(f"{owner}.set_loss_scalers takes a non-empty list of "
                              f"fxamp.optim.LossScaler, not {scalers!r}")
        self.loss_scalers = scalers

    def scaler_for(self, given: Optional[LossScaler] = None, *,
                   default: bool = True) -> Optional[LossScaler]:
        """The scaler the raw gradients carry (Note [Which scaler a step divides by]);
        `default=False` leaves out initialize's first scaler (rule 3)."""
        if self.raw_scaler is not None:
            return self.raw_scaler
        if self._exit_flags:
            return None
        if given is not None or not default:
            return given
        return self.loss_scalers[0] if self.loss_scalers else None

    def carries_other(self, scaler: LossScaler) -> bool:
        """The raw gradients carry a scale other than `scaler`'s: fold them before a backward
        with `scaler` adds to them."""
        return self.raw_scaler is not None and self.raw_scaler is not scaler

    def folds_nothing(self) -> bool:
        """No gradients were folded into fp32 this step."""
        return not self._involved and not self._exit_flags

    def fold(self, scaler: LossScaler, raws: Sequence[torch.Tensor],
             accs: Sequence[torch.Tensor], owner: object) -> None:
        """Add `raws`, divided by `scaler`'s scale, to `accs`; OR their overflow into the
        scaler's round, which this optimizer joins."""
        inv_scale = fused_step.inverse(scaler.state_tensors(self.device)[0])
        self._fold_fn(raws, accs, inv_scale, round_of(scaler, self.device).found)
        self.involve(scaler, owner)

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
        self.unscaled = UnscaledGrads(keep, [raw._version for raw in raws])

    @torch.no_grad()
    def settle_unscaled(self, raws: Sequence[torch.Tensor],
                        accs: Sequence[torch.Tensor]) -> None:
        """Unscaled gradients become folded ones (all in `acc`, `.grad` zero) before another
        backward adds to them or a fold takes them."""
        unscaled, self.unscaled = self.unscaled, None
        if unscaled is None:
            return
        unscaled.absorb_edits(raws, accs)
        for raw, acc, keep in zip(raws, accs, unscaled.keep):
            if not keep:
                acc.add_(raw)
            raw.zero_()
        self.raw_scaler = None

    def involve(self, scaler: LossScaler, owner: object,
                found: Optional[torch.Tensor] = None) -> None:
        """The raw gradients, which carried `scaler`'s scale, were taken into fp32 (`found`:
        their overflow flag, when they were not folded by `fold`)."""
        scaler.scaled_graphs.mark_done(owner)
        fold_round = round_of(scaler, self.device)
        if found is not None:
            fold_round.found.logical_or_(found)
        if scaler not in self._involved:
            self._involved.append(scaler)
            fold_round.join(self)
        self.raw_scaler = None

    @property
    def involved(self) -> tuple[LossScaler, ...]:
        """The scalers folded this step, in the order they were first folded."""
        return tuple(self._involved)

    def involved_flags(self) -> list[torch.Tensor]:
        """The overflow flags of the scalers folded this step (to agree on over ranks)."""
        return [round_of(s, self.device).found for s in self._involved]

    def found(self) -> torch.Tensor:
        """Whether any scaler folded this step, or any resolved exit, saw an overflow (a 0-dim
        device flag)."""
        return torch.stack(self.involved_flags() + self._exit_flags).any()

    def end_round(self) -> None:
        """The step took the folded gradients (or they were dropped): leave every round."""
        for scaler in self._involved:
            round_of(scaler, self.device).leave(self, scaler)
        self._involved = []
        self._exit_flags = []
        self.unscaled = None
