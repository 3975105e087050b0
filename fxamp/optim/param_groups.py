"""Param groups of a built FusedOptimizer: the ones `add_param_group` adds later, and the
parameters no flat buffer holds.

A group added after construction (unfreezing layers while fine-tuning) gets buckets, zeroed
states, a hyperparameter row and a step count of its own, starting at 0 as torch.optim's
per-parameter steps do; `FusedOptimizer.add_param_group` has checked it first. A parameter
that was frozen when its group was flattened is in no buffer: if it later gets a gradient,
torch.optim would step it, so the step refuses rather than leave it untrained.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from fxamp.errors import ConfigError
from fxamp.optim import checkpoint
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.buffers.flat import flatten_group

if TYPE_CHECKING:
    from fxamp.optim.optimizer import FusedOptimizer

__all__ = ["add_buckets", "left_out", "check_left_out", "hyper_tensor"]

log = logging.getLogger(__name__)


def add_buckets(opt: "FusedOptimizer", gi: int) -> None:
    """Flatten the (checked, appended) param group `gi` and extend the device state."""
    group = opt.param_groups[gi]
    new = flatten_group(gi, group, master_weights=opt._fp32_masters)
    row = opt.algorithm.hyper_row(group)
    opt._hyper_seen.append(row)
    opt._hyper = torch.cat([opt._hyper, hyper_tensor([row], opt._device)])
    opt._step_count = torch.cat([opt._step_count, opt._step_count.new_zeros(1)])
    folding = any(b.acc is not None for b in opt.buckets)
    for bucket in new:
        if folding:  # gradients are being folded: the new ones take part
            bucket.acc = torch.zeros(bucket.grad.shape, dtype=torch.float32,
                                     device=opt._device)
        opt._bucket_states.append(opt._new_states(bucket))
        opt._aux.append(opt.algorithm.aux(bucket))
    opt.buckets.extend(new)
    opt._left_out = left_out(opt.param_groups, opt.buckets)
    opt._sharded = tuple(b.sharded for b in opt.buckets)
    opt.master_grads.drop()
    checkpoint.expose_state(opt)  # every entry: the step counts are a new tensor
    log.debug("%s: param group %d added with %d buckets", type(opt).__name__, gi, len(new))


def left_out(groups: list[dict], buckets: list[Bucket]) -> list[tuple]:
    """(group index, position, parameter) of each parameter no bucket holds."""
    held = {id(p) for b in buckets for p in b.params}
    return [(gi, pi, p) for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])
            if id(p) not in held]


def check_left_out(opt: "FusedOptimizer") -> None:
    """Refuse a step while a parameter no bucket holds has a gradient (see the module doc)."""
    for gi, pi, p in opt._left_out:
        if p.requires_grad and p.grad is not None:
            raise ConfigError(
                f"{type(opt).__name__}: parameter {pi} of param group {gi} (shape "
                f"{tuple(p.shape)}) had requires_grad=False when the optimizer was built, so "
                "its flat buffers do not hold it, and it now has a gradient. Leave frozen "
                "parameters out of the optimizer and add them with "
                "add_param_group({'params': [...]}) when unfreezing, or build the optimizer "
                "after unfreezing")


def hyper_tensor(rows: list[tuple], device: torch.device) -> torch.Tensor:
    """The [groups, columns] float64 hyperparameter tensor of the given rows."""
    return torch.tensor([[float(v) for v in row] for row in rows],
                        dtype=torch.float64).to(device)
