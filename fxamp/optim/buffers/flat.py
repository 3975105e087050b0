"""Flat parameter, gradient and master buffers, one per (param group, dtype).

# Note [Parameters own their storage]
The step is a handful of kernels over a few long tensors (weights, gradient, moments, an fp32
`master` for 16-bit parameters), whatever the number of parameters. Each parameter lives in the
flat weights in a *storage of its own*: `window` hands out `flat[o:o+n]` through DLPack, a
tensor over the same memory whose storage is exactly its size and keeps the memory alive. So
what reads storages (safetensors' and accelerate's shared-tensor checks, `torch.save` of one
tensor, `data_ptr()`, `vector_to_parameters`) sees separate tensors, as in eager torch, and the
update writes the parameters in the loop that computes them: no copy after the step, no second
copy of the weights. Unlike eager torch, the parameters move once, when the optimizer is built;
the update's writes do not reach their version counters, so `publish` moves them for the
parameters a step moved, as an in-place update would. A parameter given other memory since
(`p.data = t`, `vector_to_parameters`, a second optimizer) is not at home: taken into the flat
weights before the next step, written by a copy after it. The why and the numbers: Note
[Parameters own their storage] in docs/design.md.

Gradients are views of the flat gradient, as DDP's `gradient_as_bucket_view=True` makes them:
autograd accumulates into an existing `.grad` in place, so backward writes straight into the
flat gradient, and a write to any `.grad` moves the flat gradient's version counter, which the
scale_loss exits read (Note [.grad after a scale_loss exit] in docs/design.md).
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional, Sequence

import torch
from torch.autograd.graph import increment_version

from fxamp._compat import foreach_copy_
from fxamp.errors import ConfigError
from fxamp.optim.buffers.bucket import Bucket, layout, refresh_master
from fxamp.policy import LOW_DTYPES

__all__ = ["FlatBucket", "window"]

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

def window(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """`flat[offset:offset + numel]` shaped `shape`, as a tensor with a storage of its own over
    the same memory (Note [Parameters own their storage]); an empty shape is a fresh empty
    tensor."""
    if shape.numel() == 0:
        return flat.new_empty(shape)
    # sliced from an alias: what DLPack keeps alive is the memory, not `flat` (torch keeps a
    # tensor's Python object alive while a view of it lives in C++)
    return torch.from_dlpack(flat.detach()[offset:offset + shape.numel()]).view(shape)


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
        params: the model's parameters, whose `.data` are windows into `param` (Note
            [Parameters own their storage]) and `.grad` views of `grad`.
        offsets: start element of each parameter in the flat buffers.
        param: the flat weights in the model's dtype (the parameters' memory).
        grad: flat model-dtype gradient buffer (the gradients' memory).
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
        self.param = torch.zeros(numel, dtype=ref.dtype, device=ref.device)
        self.grad = torch.zeros(numel, dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.view(self.param, i).copy_(p)
                if p.grad is not None:
                    self.view(self.grad, i).copy_(p.grad)
        low = master_weights and ref.dtype in LOW_DTYPES
        self.master: Optional[torch.Tensor] = self.param.float() if low else None
        # Note [Parameters own their storage]: each parameter a window of its own into the
        # flat weights
        homes = [window(self.param, o, shape) for o, shape in zip(self.offsets, self.shapes)]
        for p, home in zip(self.params, homes):
            p.data = home
        self._homes = [home.data_ptr() if home.numel() else None for home in homes]
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
        dtype, device = self.grad.dtype, self.grad.device  # checked for all before any change
        for i, (p, shape) in enumerate(zip(self.params, self.shapes)):
            if p.dtype != dtype or p.shape != shape or p.device != device:
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

    def at_home(self, i: int) -> bool:
        """Whether parameter i still lives in its window of the flat weights."""
        return self._homes[i] is None or self.params[i].data_ptr() == self._homes[i]

    def _take_param(self, i: int) -> None:
        p = self.params[i]
        if self.master is not None:
            refresh_master(self.view(self.master, i), p)
        if not self.at_home(i):
            with torch.no_grad():
                self.view(self.param, i).copy_(p)
        self.versions[i], self._ptrs[i] = p._version, p.data_ptr()
        log.debug("parameter %d of group %d was written outside the optimizer; taken in",
                  i, self.group_index)

    def write_back(self) -> None:
        """Make the parameters hold the flat weights after a step that wrote only the masters
        (Apex's FP16_Optimizer wraps a torch optimizer over them): the master rounded to
        nearest into the flat weights, one copy, then `publish`."""
        if self.master is not None:
            with torch.no_grad():
                self.param.copy_(self.master)
        self.publish()

    def publish(self) -> None:
        """After the update wrote the flat weights: copy them into the parameters no longer at
        home, and move the version counters of the parameters this step stepped, as an
        in-place update would (Note [Parameters own their storage])."""
        stepped = [p for p, got in zip(self.params, self.received) if got]
        away = [i for i in range(len(self.params)) if not self.at_home(i)]
        if away:
            with torch.no_grad():
                foreach_copy_([self.params[i] for i in away],
                              [self.view(self.param, i) for i in away])
        if stepped:
            increment_version(stepped)
        self.versions = [p._version for p in self.params]

    def mark_params_synced(self) -> None:
        """Take the parameters as they are into the flat weights and record that the masters
        match them (after loading both)."""
        away = [i for i in range(len(self.params)) if not self.at_home(i)]
        if away:
            with torch.no_grad():
                foreach_copy_([self.view(self.param, i) for i in away],
                              [self.params[i] for i in away])
        self.versions = [p._version for p in self.params]
        self._ptrs = [p.data_ptr() for p in self.params]
