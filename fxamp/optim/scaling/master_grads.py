"""Apex's master gradients for the fused optimizers: what `amp.master_params(opt)` yields.

# Note [Gathered master gradients]
Apex's `amp.master_params(opt)` yielded the tensors the optimizer steps (fp32 masters at O2,
the model's own parameters at O0/O1/O3, 16-bit ones included) in the param groups' order, with
unscaled gradients; code clips them (`clip_grad_norm_`) and pairs them with
`model.parameters()` by position. fxamp yields per-parameter views of the weights the step
updates (the flat fp32 masters, or the parameters themselves when they have none) whose
`.grad` are views of one `gathered` buffer per bucket, in the weights' dtype:
`gathered = folded + raw * (1 / scale)`, computed on the device (`fused_step.gather_grads`).

The model's raw gradients are left as they are, and the version of each raw gradient buffer
is recorded. The step takes the gathered gradients, with whatever was done to them (clipping),
only while the raw ones are unchanged. Any write to the raw gradients since (another backward,
`model.zero_grad()` with or without `set_to_none`, a `.grad` set to None and created again)
means the master gradients are stale: the step then computes them again from the model's
gradients, so gradients the user dropped are never applied. (Folding them into fp32 and
zeroing the raw ones, as `unscale_` does, would make an in-place `model.zero_grad()` a no-op
that nothing could see.) Edits to stale master gradients are dropped with them: call
`master_params` after the last backward of the step, as Apex's examples do.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from fxamp.optim.functional import fused_step
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.scaling.loss_scaler import LossScaler

__all__ = ["MasterGrads"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Gathered:
    scaler: Optional[LossScaler]  # whose scale the raw gradients carried; None: unscaled
    found: torch.Tensor  # 0-dim bool on the device: a raw gradient or the scale was not finite
    versions: list[int]  # each bucket's raw gradient buffer version after gathering


class MasterGrads:
    """One optimizer's gathered master gradients (Note [Gathered master gradients])."""

    def __init__(self, gather_fn: Callable) -> None:
        self._gather_fn = gather_fn
        self.buffers: list[torch.Tensor] = []  # one per bucket, kept for the next gathering
        self._gathered: Optional[_Gathered] = None

    def gather(self, buckets: Sequence[Bucket], scaler: Optional[LossScaler],
               unit: LossScaler, device: torch.device,
               unscaled: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Compute the master gradients from the raw ones, unless they are still current;
        `unscaled`: per bucket, the unscaled gradients to take instead (Note [.grad after a
        scale_loss exit] in docs/design.md)."""
        if self.current(buckets, scaler) is not None:
            return  # a second call yields the same (maybe clipped) gradients, as Apex's did
        if len(self.buffers) != len(buckets):
            self.buffers = [torch.zeros_like(b.weights) for b in buckets]
        found = torch.zeros((), dtype=torch.bool, device=device)
        if unscaled is None:
            scale, raws, accs = scaler or unit, [b.grad for b in buckets], [b.acc for b in buckets]
        else:
            scale, raws, accs = unit, list(unscaled), [None] * len(buckets)
        inv_scale = fused_step.inverse(scale.state_tensors(device)[0])
        self._gather_fn(raws, accs, self.buffers, inv_scale, found)
        self._gathered = _Gathered(scaler, found, _versions(buckets))

    def current(self, buckets: Sequence[Bucket],
                scaler: Optional[LossScaler]) -> Optional[_Gathered]:
        """The gathering if the raw gradients and the scaler are still those it saw, else None
        (and a stale one is dropped)."""
        gathered = self._gathered
        if gathered is None:
            return None
        if gathered.scaler is scaler and gathered.versions == _versions(buckets):
            return gathered
        log.info("the model's gradients changed after master_params() (a backward, "
                 "model.zero_grad(), a .grad replaced): the master gradients are computed again "
                 "from them, and edits made to the earlier ones are dropped")
        self._gathered = None
        return None

    def drop(self) -> None:
        self._gathered = None

    def views(self, bucket_index: int, bucket: Bucket) -> list[torch.Tensor]:
        return bucket.views(self.buffers[bucket_index])


def _versions(buckets: Sequence[Bucket]) -> list[int]:
    return [b.grad._version for b in buckets]


def master_params_of(opt: Any) -> Iterator[torch.Tensor]:
    """The tensors `opt` (a FusedOptimizer) steps, in its param groups' order, with the
    gathered master gradients as `.grad`; a parameter the optimizer does not step (frozen
    when it was built) is yielded itself, as Apex yielded it."""
    opt.gather_master_grads()
    slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for bi, bucket in enumerate(opt.buckets):
        grads = opt.master_grads.views(bi, bucket)
        for p, weight, grad in zip(bucket.params, bucket.views(bucket.weights), grads):
            slots[id(p)] = (weight, grad)
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in slots:
                yield p
                continue
            weight, grad = slots[id(p)]
            alias = weight.detach()
            alias.grad = grad
            yield alias
