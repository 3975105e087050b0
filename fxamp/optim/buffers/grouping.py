"""The optimizer's buckets from its param groups: one per (param group, dtype), checked first
(a FlatBucket, fxamp/optim/buffers/flat.py, or for DTensor parameters a ShardedBucket,
sharded.py)."""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch

from fxamp.errors import ConfigError
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.buffers.flat import FlatBucket
from fxamp.optim.buffers.sharded import ShardedBucket
from fxamp.optim.distributed import is_dtensor

__all__ = ["flatten_param_groups", "flatten_group", "check_group_params", "make_bucket"]

log = logging.getLogger(__name__)

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def flatten_param_groups(param_groups: Sequence[dict], *, master_weights: bool,
                         owner: str) -> list[Bucket]:
    """One FlatBucket per (group, dtype), after checking every parameter can be flattened.

    Raises:
        ConfigError: for a non-floating or sparse parameter, or parameters on more than one
            device; the message names the parameter. Nothing is flattened then.
    """
    _check_devices(param_groups, owner)
    for gi, group in enumerate(param_groups):
        check_group_params(group, gi, owner)
    buckets = [b for gi, group in enumerate(param_groups)
               for b in flatten_group(gi, group, master_weights=master_weights)]
    log.debug("%s: %d buckets, %d parameters", owner, len(buckets),
              sum(len(b.params) for b in buckets))
    return buckets


def check_group_params(group: dict, gi: int, owner: str,
                       device: Optional[torch.device] = None) -> None:
    """Every parameter of group `gi` can be flattened (and lies on `device`, when given)."""
    for pi, p in enumerate(group["params"]):
        _check_param(p, gi, pi, owner)
        if device is not None and p.device != device:
            raise ConfigError(f"{owner}: parameter {pi} of param group {gi} is on {p.device}, "
                              f"the optimizer's parameters on {device}. The step, loss scale "
                              "and overflow flag live on one device; build one optimizer per "
                              "device")


def flatten_group(gi: int, group: dict, *, master_weights: bool) -> list[Bucket]:
    """The buckets of param group `gi` (checked already): one per dtype of its parameters
    with `requires_grad`, in the order the dtypes first appear."""
    by_kind: dict[tuple[torch.dtype, bool], list[torch.nn.Parameter]] = {}
    for p in group["params"]:
        if p.requires_grad:
            by_kind.setdefault((p.dtype, is_dtensor(p)), []).append(p)
    return [make_bucket(gi, params, master_weights=master_weights, sharded=dtensor)
            for (_, dtensor), params in by_kind.items()]


def make_bucket(group_index: int, params: Sequence[torch.nn.Parameter], *,
                master_weights: bool, sharded: bool) -> Bucket:
    """The Bucket for one (param group, dtype): a FlatBucket, or a ShardedBucket for DTensor
    parameters (Note [Flat buffers beside FSDP2's shards])."""
    kind = ShardedBucket if sharded else FlatBucket
    return kind(group_index, params, master_weights=master_weights)


def _check_param(p: torch.Tensor, gi: int, pi: int, owner: str) -> None:
    where = f"{owner}: parameter {pi} of param group {gi} (shape {tuple(p.shape)})"
    if p.dtype not in FLOATING:
        raise ConfigError(f"{where} has dtype {p.dtype}; only floating-point parameters "
                          "(float16, bfloat16, float32, float64) can be optimized")
    if p.is_sparse or p.layout != torch.strided:
        raise ConfigError(f"{where} has layout {p.layout}; only dense (strided) parameters "
                          "can be flattened")


def _check_devices(param_groups: Iterable[dict], owner: str) -> None:
    counts: dict[str, int] = {}
    for group in param_groups:
        for p in group["params"]:
            counts[str(p.device)] = counts.get(str(p.device), 0) + 1
    if len(counts) > 1:
        found = ", ".join(f"{d} ({n} tensors)" for d, n in counts.items())
        raise ConfigError(f"{owner}: parameters are on more than one device: {found}. The step, "
                          "loss scale and overflow flag live on one device; build one optimizer "
                          "per device")
