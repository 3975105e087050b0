"""What a LossScaler owes before its scale moves again, as named states: the `scale_loss` exit
that awaits resolution (exits.py) and the folds that await their optimizers' steps (folding.py).

Each LossScaler holds one `ScaleRound`; exits.py and folding.py drive its transitions. This
module imports neither of them nor loss_scaler.py, so the three import it one way only.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch

__all__ = ["ExitState", "FoldState", "ScaleRound"]


class ExitState(enum.Enum):
    """Whether a `scale_loss(..., unscale_on_exit=False)` exit of the scaler awaits resolution
    (Note [Apex's scale_loss exits] in exits.py)."""

    NONE = "none"  # no exit awaits: resolved, taken by a fused step, or none recorded
    PENDING = "pending"  # an exit recorded its optimizers; their gradients carry the scale


class FoldState(enum.Enum):
    """Whether gradients folded with the scaler await their optimizers' steps (folding.py)."""

    IDLE = "idle"  # nothing folded since the scale last moved by the folds' flag
    AWAITING_STEPS = "awaiting steps"  # optimizers folded and have not stepped yet


class ScaleRound:
    """One scaler's bookkeeping between two moves of its scale.

    Transitions: `record_exit` (NONE -> PENDING), `end_exit` (PENDING -> NONE); `join`
    (IDLE -> AWAITING_STEPS), `leave` (AWAITING_STEPS -> IDLE when the last member leaves: the
    caller then moves the scale by `found` and calls `clear_found`).
    """

    def __init__(self) -> None:
        self.exit_state = ExitState.NONE
        self.exit_optimizers: Sequence[object] = ()  # the optimizers of the pending exit
        self.fold_state = FoldState.IDLE
        self.members: list[object] = []  # the foldings that folded and have not stepped
        self.found: Optional[torch.Tensor] = None  # OR of the folds' overflow (0-dim bool)

    # ------------------------------------------------------------------ scale_loss exits
    def record_exit(self, optimizers: Sequence[object]) -> None:
        """A scale_loss exit left `optimizers`' raw gradients carrying the scale."""
        self.exit_optimizers = optimizers
        self.exit_state = ExitState.PENDING if optimizers else ExitState.NONE

    def end_exit(self) -> Sequence[object]:
        """The pending exit is resolved (or a fused step takes it): its optimizers, () if none
        was pending."""
        optimizers, self.exit_optimizers = self.exit_optimizers, ()
        self.exit_state = ExitState.NONE
        return optimizers

    def exit_includes(self, optimizer: object) -> bool:
        """A pending exit's gradients include `optimizer`'s."""
        return self.exit_state is ExitState.PENDING and any(
            o is optimizer for o in self.exit_optimizers)

    # ------------------------------------------------------------------------- folds
    def found_on(self, device: torch.device) -> torch.Tensor:
        """The folds' overflow flag, on `device` (created clear on first use)."""
        if self.found is None:
            self.found = torch.zeros((), dtype=torch.bool, device=device)
        elif self.found.device != torch.device(device):
            self.found = self.found.to(device)
        return self.found

    def join(self, member: object) -> None:
        """`member` (a GradientFolding) folded gradients with this scale."""
        if not any(m is member for m in self.members):
            self.members.append(member)
        self.fold_state = FoldState.AWAITING_STEPS

    def leave(self, member: object) -> bool:
        """`member` stepped (or dropped its gradients); whether it was the last to leave, so
        that the scale moves by `found` now."""
        self.members = [m for m in self.members if m is not member]
        if self.members:
            return False
        self.fold_state = FoldState.IDLE
        return True

    def clear_found(self) -> None:
        """The scale moved by `found`: the next round starts with a clear flag."""
        if self.found is not None:
            self.found.zero_()
