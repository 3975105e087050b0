"""The Bucket protocol: what the fused step and its helpers use of one flat buffer, and the
layout both implementations share.

A bucket holds the parameters of one param group that share a dtype, flat: `FlatBucket`
(flat.py) makes the parameters views of its buffer; `ShardedBucket` (sharded.py) keeps a flat
copy of FSDP2's local shards (Note [Flat buffers beside FSDP2's shards]). `make_bucket` in
flat.py picks one. Everything else (the step, LAMB's norms, master gradients, checkpoints)
reads only what is declared here.
"""

from __future__ import annotations

import abc
from typing import Optional, Sequence

import torch

__all__ = ["Bucket", "ALIGN", "layout", "refresh_master"]

# Each parameter starts on a multiple of ALIGN elements: aligned vector loads for the model's own
# kernels, and whole chunks of ALIGN for LAMB's per-parameter norms.
ALIGN = 64


def layout(numels: Sequence[int]) -> tuple[list[int], int]:
    """(start offset of each tensor of these sizes, total size): each start aligned to ALIGN
    elements."""
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += -(-n // ALIGN) * ALIGN
    return offsets, max(pos, ALIGN)


@torch.no_grad()
def refresh_master(master: torch.Tensor, param: torch.Tensor) -> None:
    """Take a parameter written outside the optimizer into its fp32 master, keeping the precise
    master wherever the parameter still equals its rounding."""
    master.copy_(torch.where(master.to(param.dtype) == param, master, param.float()))


class Bucket(abc.ABC):
    """One (param group, dtype) of an optimizer's parameters, flat.

    Attributes:
        sharded: whether the parameters are DTensor shards (FSDP2).
        group_index: index of the param group in the optimizer.
        params: the model's parameters.
        offsets: start element of each parameter (of its local shard) in the flat buffers.
        param: the flat weights in the model's dtype (for a FlatBucket the parameters' own
            memory: Note [Parameters own their storage] in flat.py).
        grad: flat model-dtype gradient buffer.
        master: flat fp32 copy of `param` for 16-bit parameters with master weights, else None.
        acc: fp32 unscaled gradients while gradients are being folded (folding.py), else None.
        received: per parameter, whether it has a gradient for the next step (its `.grad` is
            not None, as torch.optim asks); the step leaves the others alone (Note [A
            parameter without a gradient] in flat.py).
    """

    sharded: bool
    group_index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    param: torch.Tensor
    grad: torch.Tensor
    master: Optional[torch.Tensor]
    acc: Optional[torch.Tensor]
    received: list[bool]

    @property
    def weights(self) -> torch.Tensor:
        """The tensor the update reads and writes: the fp32 master, or the parameters."""
        return self.param if self.master is None else self.master

    def views(self, flat: torch.Tensor) -> list:
        """Per-parameter views of a flat tensor with this bucket's layout."""
        return [self.view(flat, i) for i in range(len(self.params))]

    def state_like(self) -> torch.Tensor:
        """A zeroed flat state buffer (optimizer moments) laid out like the weights."""
        return torch.zeros_like(self.weights)

    @abc.abstractmethod
    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The i-th parameter's part of `flat`, shaped (and placed) like the parameter."""

    @abc.abstractmethod
    def block_view(self, per_block: torch.Tensor, block: int, i: int) -> torch.Tensor:
        """The i-th parameter's part of `per_block`, which holds one value per `block` elements
        of the flat layout (the scales of 8-bit moments), 1-D (and placed: Note [Block scales
        of sharded parameters] in sharded.py)."""

    @abc.abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient (and `acc`); the parameters' `.grad` None, or (not
        `set_to_none`) zeroed, as torch.optim's zero_grad leaves them."""

    def remove_hooks(self) -> None:
        """Stop tracking the parameters' gradients (another optimizer steps them)."""

    @abc.abstractmethod
    def sync_from_params(self) -> None:
        """Before a step: take gradients and parameters written outside the optimizer."""

    @abc.abstractmethod
    def write_back(self) -> None:
        """After a step that wrote only the masters (a torch optimizer over them): the masters
        rounded into the flat weights, then `publish`."""

    @abc.abstractmethod
    def publish(self) -> None:
        """After the fused update wrote the flat weights: make the parameters hold them."""

    @abc.abstractmethod
    def mark_params_synced(self) -> None:
        """Record that the masters now match the parameters (after loading both)."""
