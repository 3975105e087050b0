"""Flat buffers over the local shards of DTensor parameters (FSDP2's `fully_shard`).

A ShardedBucket keeps its own flat copy of the local shards (FSDP2 owns their storage): the
gradient shards are added into it before the step and the new weights copied back after it;
states and masters are exposed as DTensors with the parameter's placements, and every parameter
takes the room of its padded shard so that 8-bit block scales line up across ranks.

Design (docs/design.md): Note [Flat buffers beside FSDP2's shards], Note [Block scales of
sharded parameters].
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from fxamp._compat import foreach_add_, foreach_copy_
from fxamp.optim.buffers.bucket import Bucket, layout, refresh_master
from fxamp.policy import LOW_DTYPES

__all__ = ["ShardedBucket", "padded_numel"]

log = logging.getLogger(__name__)


def padded_numel(p: torch.Tensor) -> int:
    """The elements of the largest local shard of DTensor `p` on its 1-D mesh: the room each
    rank gives it (Note [Block scales of sharded parameters])."""
    placement = p.placements[0]
    if not placement.is_shard() or p.numel() == 0:
        return p.to_local().numel()
    rows = p.shape[placement.dim]
    return -(-rows // p.device_mesh.size()) * (p.numel() // rows)


class ShardedBucket(Bucket):
    """The DTensor parameters of one param group that share a dtype, their local shards flat.

    Attributes as Bucket's, except that `param` is a copy of the local shards (written back
    by `write_back` after each step) and `offsets` index the local shards; `sharded` says
    whether a parameter is split over the ranks (a Replicate DTensor, as tensor-parallel code
    leaves some, is whole on every rank: its gradient counts once in the clipping norm and
    whole-parameter norms such as LAMB's are local).
    """

    def __init__(self, group_index: int, params: Sequence[torch.nn.Parameter], *,
                 master_weights: bool) -> None:
        self.group_index = group_index
        self.params = list(params)
        self.sharded = any(p.placements[0].is_shard() for p in self.params)
        local = self._locals()
        self.offsets, numel = layout([padded_numel(p) for p in self.params])
        self.param = torch.zeros(numel, dtype=local[0].dtype, device=local[0].device)
        self.grad = torch.zeros_like(self.param)
        self.grad_views = [self.local_view(self.grad, i) for i in range(len(local))]
        with torch.no_grad():
            for i, t in enumerate(local):
                self.local_view(self.param, i).copy_(t)
        low = master_weights and self.param.dtype in LOW_DTYPES
        self.master = self.param.float() if low else None
        self.acc = None
        self.versions = self._local_versions()
        self.received = [False] * len(self.params)
        self._take_grads()

    def _locals(self) -> list[torch.Tensor]:
        # Read afresh every time: FSDP2 may replace a parameter's local tensor (lazy init).
        return [p.to_local() for p in self.params]

    def _local_versions(self) -> list[int]:
        return [t._version for t in self._locals()]

    def local_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        shape = self.params[i].to_local().shape
        start = self.offsets[i]
        return flat[start:start + shape.numel()].view(shape)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The i-th local shard of `flat` as a DTensor laid out like the parameter."""
        from torch.distributed.tensor import DTensor

        p = self.params[i]
        return DTensor.from_local(self.local_view(flat, i), p.device_mesh, p.placements,
                                  run_check=False, shape=p.shape, stride=p.stride())

    def block_view(self, per_block: torch.Tensor, block: int, i: int) -> torch.Tensor:
        """Note [Block scales of sharded parameters]."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        p = self.params[i]
        count = -(-padded_numel(p) // block)
        start = self.offsets[i] // block
        mesh = p.device_mesh
        sharded = p.placements[0].is_shard()
        return DTensor.from_local(
            per_block[start:start + count], mesh, [Shard(0) if sharded else Replicate()],
            run_check=False, shape=(count * (mesh.size() if sharded else 1),), stride=(1,))

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradients live in the flat buffer either way; with set_to_none=False each
        # parameter counts as having a (zero) gradient, as torch.optim sees zeroed ones.
        self.grad.zero_()
        if self.acc is not None:
            self.acc.zero_()
        for p in self.params:
            p.grad = None
        self.received = [not set_to_none] * len(self.params)

    def sync_from_params(self) -> None:
        """Adopt shards written outside the optimizer (a loaded checkpoint), then take the
        gradients (Note [Flat buffers beside FSDP2's shards])."""
        for i, (t, seen) in enumerate(zip(self._locals(), self.versions)):
            if t._version != seen:
                self._refresh_master(i)
        self._take_grads()

    def _take_grads(self) -> None:
        pairs = [(view, p.grad.to_local()) for view, p in zip(self.grad_views, self.params)
                 if p.grad is not None]
        self.received = [got or p.grad is not None for got, p in zip(self.received, self.params)]
        if pairs:
            with torch.no_grad():
                foreach_add_([v for v, _ in pairs], [g.to(v.dtype) for v, g in pairs])
        for p in self.params:
            p.grad = None

    def _refresh_master(self, i: int) -> None:
        local = self.params[i].to_local()
        with torch.no_grad():
            self.local_view(self.param, i).copy_(local)
        if self.master is not None:
            refresh_master(self.local_view(self.master, i), local)
        self.versions[i] = local._version
        log.debug("shard of parameter %d of group %d was written outside the optimizer",
                  i, self.group_index)

    def write_back(self) -> None:
        """The masters rounded into the flat weights, then `publish`."""
        if self.master is not None:
            with torch.no_grad():
                self.param.copy_(self.master)
        self.publish()

    def publish(self) -> None:
        """Copy the updated flat weights into the parameters' local shards."""
        local = self._locals()
        with torch.no_grad():
            foreach_copy_(local, [self.local_view(self.param, i)
                                  for i in range(len(local))])
        self.versions = [t._version for t in local]

    def mark_params_synced(self) -> None:
        # The state dict carried the masters; the weights may have been loaded into the shards.
        with torch.no_grad():
            for i, t in enumerate(self._locals()):
                self.local_view(self.param, i).copy_(t)
        self.versions = self._local_versions()
