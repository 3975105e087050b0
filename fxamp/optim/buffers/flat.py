"""Flat parameter, gradient and master buffers, one per (param group, dtype).

# Note [Parameters own their storage]
The optimizer keeps flat weights of its own (an fp32 `master` for 16-bit parameters with
master weights; else `param`, a flat copy in the model's dtype) and a flat gradient: the step
is a handful of kernels over a few long tensors, whatever the number of parameters. The
model's parameters keep storages of their own, as in eager torch, so that whatever reads them
(`state_dict()`, safetensors' shared-tensor check, accelerate's `save_model`,
`vector_to_parameters`, `data_ptr()`) sees the model it would see without fxamp. (Until
2026-12 they were views of `param`, as Apex's FP16_Optimizer makes them: savers saw one tied
tensor and dropped all but one name.) The price: after each step `write_back` copies the new
weights into the parameters (one multi-tensor copy, no host read; from the master it rounds
to nearest, as the update did), and `param` is memory eager torch does not hold.

Gradients stay views of the flat gradient (`p.grad = flat_grad[o:o+n].view_as(p)`), as DDP's
`gradient_as_bucket_view=True` makes them: autograd accumulates into an existing `.grad` in
place, so backward writes straight into the flat gradient.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, Optional, Sequence

import torch

from fxamp._compat import foreach_copy_
from fxamp.errors import ConfigError
from fxamp.optim.buffers.bucket import Bucket, layout, refresh_master
from fxamp.optim.distributed import is_dtensor
from fxamp.optim.buffers.sharded import ShardedBucket
from fxamp.policy import LOW_DTYPES

__all__ = ["FlatBucket", "flatten_param_groups", "flatten_group", "check_group_params",
           "make_bucket"]

log = logging.getLogger(__name__)

# Note [Keeping the flat views honest]
# Between steps, `FlatBucket.sync_from_params` takes in what changed outside the optimizer,
# without a host read: a `.grad` replaced by another tensor (`p.grad = g`) is copied into the flat
# gradient and replaced by the view again; a parameter written in place (`model.load_state_dict`,
# `p.copy_(...)` under no_grad: its `_version` moved) or given another tensor of the same shape,
# dtype and device (`p.data = t`, `load_state_dict(assign=True)`, `vector_to_parameters`) is
# copied into the flat weights, and its master refreshed wherever the parameter no longer equals
# the rounded master. A write through `p.data` in place (`p.data.mul_(2)`) moves no version
# counter (torch's docs: `.data` is not tracked) and is not seen; write through `p` under
# `torch.no_grad()` instead.

# Note [A parameter without a gradient]
# torch.optim skips a parameter whose `.grad` is None, and so does the fused step: its weights,
# master and states keep every bit (a per-block mask, `Bucket.received`, built on the host from
# `p.grad is None`, which the host knows). To keep that test meaningful, `.grad` is None exactly
# when torch's would be: `opt.zero_grad()` (set_to_none, the default) zeroes the flat gradient
# and sets every `.grad` to None, and a hook on each parameter (`register_hook`: it runs before
# autograd accumulates) puts the zeroed view back as `.grad` when a backward reaches it, so that
# autograd accumulates into the flat buffer in place, as before. A parameter no backward reached
# keeps `.grad` None. A view that held a gradient since (`model.zero_grad()` dropped it) is
# zeroed before it is reused, so that the step's overflow check and norm see 0 there.

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _backward_hook(bucket_ref: "weakref.ref[FlatBucket]", i: int):
    # The parameter holds its hook for as long as the model lives; a weak reference lets an
    # optimizer the user dropped (its masters, its flat buffers) be freed, as torch's is.
    def hook(grad: torch.Tensor) -> None:
        bucket = bucket_ref()
        if bucket is not None:
            bucket._on_backward(i, grad)
    return hook
class FlatBucket(Bucket):
    """The parameters of one param group that share a dtype, flattened.

    Attributes:
        group_index: index of the param group in the optimizer.
        params: the model's parameters, whose `.data` and `.grad` are views into this bucket.
        offsets: start element of each parameter in the flat buffers.
        param: the flat weights in the model's dtype where there is no master (the parameters
            are written from `master` otherwise: None).
        grad: flat model-dtype gradient buffer.
        master: flat fp32 copy of `param` for 16-bit parameters with master weights, else None.
    """

    sharded = False

    def __init__(self, group_index: int, params: Sequence[torch.nn.Parameter], *,
                 master_weights: bool) -> None:
        self.group_index = group_index
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.offsets, numel = layout([p.numel() for p in self.params])
        ref = self.params[0]
        # Note [Parameters own their storage]: with an fp32 master the parameters are written
        # from it, and no flat copy in the model's dtype is kept
        low = master_weights and ref.dtype in LOW_DTYPES
        weights = torch.zeros(numel, dtype=torch.float32 if low else ref.dtype, device=ref.device)
        self.master: Optional[torch.Tensor] = weights if low else None
        self.param: Optional[torch.Tensor] = None if low else weights
        self.grad = torch.zeros(numel, dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.view(weights, i).copy_(p)
                if p.grad is not None:
                    self.view(self.grad, i).copy_(p.grad)
        self.grad_views = self.views(self.grad)
        self.received = [p.grad is not None for p in self.params]
        self._dirty = list(self.received)  # a view holding values no zero_grad cleared
        for p, g, got in zip(self.params, self.grad_views, self.received):
            p.grad = g if got else None
        self._ptrs = [p.data_ptr() for p in self.params]  # Note [Keeping the flat views honest]
        self._hooks = [p.register_hook(_backward_hook(weakref.ref(self), i))
                       for i, p in enumerate(self.params)]
        self.versions = [p._version for p in self.params]
        self.acc: Optional[torch.Tensor] = None  # fp32 unscaled gradients, see Optimizer.unscale_
        self._warned_foreign = False
        self._weight_views: Optional[tuple[tuple[int, int], list[torch.Tensor]]] = None

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        shape = self.shapes[i]
        return flat[self.offsets[i]:self.offsets[i] + shape.numel()].view(shape)

    def block_view(self, per_block: torch.Tensor, block: int, i: int) -> torch.Tensor:
        start = self.offsets[i] // block
        return per_block[start:start - (-self.params[i].numel() // block)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grad.zero_()
        if self.acc is not None:
            self.acc.zero_()
        for p, g in zip(self.params, self.grad_views):
            p.grad = None if set_to_none else g
        self.received = [not set_to_none] * len(self.params)
        self._dirty = [False] * len(self.params)

    def _on_backward(self, i: int, grad: torch.Tensor) -> None:
        # Note [A parameter without a gradient]: runs before autograd accumulates into p.grad.
        p, view = self.params[i], self.grad_views[i]
        if p.grad is not None:  # accumulates into what it holds (another optimizer's view)
            return
        if self._dirty[i]:
            with torch.no_grad():
                view.zero_()
        p.grad, self._dirty[i] = view, True

    def remove_hooks(self) -> None:
        """Stop putting the gradient views back (another optimizer steps these parameters)."""
        for handle in self._hooks:
            handle.remove()

    def sync_from_params(self) -> None:
        """Repair gradient views and stale masters; see Note [Keeping the flat views honest]."""
        for i, p in enumerate(self.params):
            if (p.dtype, p.device, p.shape) != (self.grad.dtype, self.grad.device,
                                                 self.shapes[i]):
                raise ConfigError(
                    f"parameter {i} of param group {self.group_index} is now {p.dtype} "
                    f"{tuple(p.shape)} on {p.device}, and the optimizer was built over "
                    f"{self.grad.dtype} on {self.grad.device}: its .data was replaced "
                    "(model.to(), .half(), a cast) after the optimizer was built; move and "
                    "cast the model first")
        for i, (p, g) in enumerate(zip(self.params, self.grad_views)):
            if p.grad is None:
                self._drop_grad(i)
            elif p.grad is not g:
                self._adopt_grad(i)
            else:
                self.received[i] = True
        for i, p in enumerate(self.params):
            if p._version != self.versions[i] or p.data_ptr() != self._ptrs[i]:
                self._take_param(i)

    def _adopt_grad(self, i: int) -> None:
        p, view = self.params[i], self.grad_views[i]
        if not self._warned_foreign:
            self._warned_foreign = True
            log.info("a .grad was replaced outside the optimizer (model.zero_grad() sets it to "
                     "None); copying it into the flat buffer. opt.zero_grad() avoids the copy.")
        with torch.no_grad():
            view.copy_(p.grad)
        p.grad, self.received[i], self._dirty[i] = view, True, True

    def _drop_grad(self, i: int) -> None:
        # No gradient: the step leaves the parameter alone (Note [A parameter without a
        # gradient]); its part of the flat gradient is zeroed for the overflow check and norm.
        if self._dirty[i]:
            with torch.no_grad():
                self.grad_views[i].zero_()
            self._dirty[i] = False
        self.received[i] = False

    def _take_param(self, i: int) -> None:
        p = self.params[i]
        if self.master is not None:
            refresh_master(self.view(self.master, i), p)
        else:
            with torch.no_grad():
                self.view(self.param, i).copy_(p)
        self.versions[i], self._ptrs[i] = p._version, p.data_ptr()
        log.debug("parameter %d of group %d was written outside the optimizer; taken in",
                  i, self.group_index)

    def write_back(self) -> None:
        """Copy the updated flat weights into the parameters (Note [Parameters own their
        storage])."""
        weights = self.weights
        key = (id(weights), weights.data_ptr())
        if self._weight_views is None or self._weight_views[0] != key:
            self._weight_views = (key, self.views(weights))  # 128 views cost 0.5 ms a step
        with torch.no_grad():  # the master rounded to nearest, as the update rounds it
            foreach_copy_(self.params, self._weight_views[1])
        self.versions = [p._version for p in self.params]

    def mark_params_synced(self) -> None:
        """Take the parameters as they are into the flat weights and record that the masters
        match them (after loading both)."""
        if self.param is not None:
            with torch.no_grad():
                foreach_copy_(self.views(self.param), self.params)
        self.versions = [p._version for p in self.params]
        self._ptrs = [p.data_ptr() for p in self.params]


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
