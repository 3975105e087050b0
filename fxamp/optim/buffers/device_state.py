"""A fused optimizer's buffers and device state: one `BucketSlot` per bucket, and the per-group
hyperparameter rows and step counts.

`DeviceState.add_groups` lays out every param group, at construction and for each group
`add_param_group` adds later: its buckets (flat.py) get zeroed states (state_buffers.py) and the
rule's per-bucket constants, its hyperparameters a row of `hyper`, its step count an entry of
`step_count` starting at 0, as torch.optim's per-parameter steps (and Apex FusedAdam's
per-group one) do.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from fxamp.optim.buffers import state_buffers
from fxamp.optim.buffers.bucket import ALIGN, Bucket
from fxamp.optim.buffers.grouping import flatten_group
from fxamp.optim.buffers.state_format import StateFormat
from fxamp.optim.functional import codecs
from fxamp.optim.functional.algorithms import Algorithm
from fxamp.optim.functional.fused_step import BucketArgs

__all__ = ["BucketSlot", "DeviceState"]


@dataclasses.dataclass
class BucketSlot:
    """One bucket and what the step keeps for it.

    Attributes:
        bucket: the flat buffers of one (param group, dtype).
        state: its optimizer states (and master kind, correction).
        aux: the rule's constants for it (`Algorithm.aux`: LAMB's chunk owners).
        stream_keys: the keys of its random streams (`codecs.bucket_stream_keys`), int64 on
            the device.
    """

    bucket: Bucket
    state: state_buffers.BucketState
    aux: tuple
    stream_keys: torch.Tensor
    received: tuple = ()  # the pattern `has_grad` was built for
    has_grad: Optional[torch.Tensor] = None

    def update_args(self, grad: torch.Tensor) -> BucketArgs:
        """What `fused_step.update` reads and writes of this bucket, stepping by `grad`: the
        full-size buffers as [blocks, ALIGN] views (Note [Blocks of ALIGN in the compiled
        update] in docs/design.md)."""
        b = self.bucket
        states = tuple((_blocks(bufs[0]), *bufs[1:]) for bufs in self.state.states)
        model = None if b.master is None else _blocks(b.param)
        return BucketArgs(tuple(_blocks(w) for w in self.state.weights(b)), _blocks(grad),
                          states, model, self.aux, self.state.master, self.stream_keys,
                          self.grad_mask())

    def grad_mask(self) -> torch.Tensor:
        """Per ALIGN-block, 1.0 where its parameter has a gradient, else 0.0 (Note [A parameter
        without a gradient] in flat.py): an fp32 device tensor, sent again only when the
        pattern changes (a host-to-device copy, never a read back)."""
        received = tuple(self.bucket.received)
        if self.has_grad is None or received != self.received:
            b = self.bucket
            blocks = torch.zeros(b.grad.numel() // ALIGN, dtype=torch.float32)
            bounds = b.offsets[1:] + [b.grad.numel()]
            for start, end, got in zip(b.offsets, bounds, received):
                blocks[start // ALIGN:end // ALIGN] = float(got)
            self.has_grad = blocks.to(b.grad.device, non_blocking=True)
            self.received = received
        return self.has_grad


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(-1, ALIGN)  # every bucket's size is a multiple of ALIGN (bucket.layout)


def _hyper_tensor(rows: list[tuple], device: torch.device) -> torch.Tensor:
    """The [groups, columns] float64 hyperparameter tensor of the given rows."""
    return torch.tensor([[float(v) for v in row] for row in rows],
                        dtype=torch.float64).to(device)


class DeviceState:
    """The buckets of an optimizer, in param-group order, and its per-group device tensors.

    Attributes:
        device: where every buffer lives.
        fmt: how masters and moments are stored.
        slots: one BucketSlot per bucket.
        hyper: [groups, columns] float64 hyperparameters (`Algorithm.hyper_row`).
        step_count: [groups] fp32 step counts.
    """

    def __init__(self, device: torch.device, fmt: StateFormat, *, fp32_masters: bool) -> None:
        self.device, self.fmt, self.fp32_masters = device, fmt, fp32_masters
        self.slots: list[BucketSlot] = []
        self.hyper: Optional[torch.Tensor] = None
        self.step_count: Optional[torch.Tensor] = None
        self._hyper_seen: list[tuple] = []  # the rows as last sent to the device
        self._max_norm: Optional[torch.Tensor] = None
        self._max_norm_seen: Optional[float] = None

    @property
    def buckets(self) -> list[Bucket]:
        return [s.bucket for s in self.slots]

    @property
    def sharded(self) -> tuple[bool, ...]:
        """Per bucket, whether it holds DTensor shards."""
        return tuple(s.bucket.sharded for s in self.slots)

    def add_groups(self, param_groups: Sequence[dict], first: int, algorithm: Algorithm,
                   buckets: Optional[Sequence[Bucket]] = None) -> list[Bucket]:
        """Lay out param groups `first`... (checked already): `buckets`, or their flattening,
        join with zeroed states; gradients being folded, their fp32 sums start at zero too."""
        groups = param_groups[first:]
        if buckets is None:
            buckets = [b for gi, g in enumerate(groups, first)
                       for b in flatten_group(gi, g, master_weights=self.fp32_masters)]
        rows = [algorithm.hyper_row(g) for g in groups]
        self._hyper_seen.extend(rows)
        new_hyper = _hyper_tensor(rows, self.device)
        new_steps = torch.zeros(len(rows), dtype=torch.float32, device=self.device)
        self.hyper = new_hyper if self.hyper is None else torch.cat([self.hyper, new_hyper])
        self.step_count = (new_steps if self.step_count is None
                           else torch.cat([self.step_count, new_steps]))
        folding = any(s.bucket.acc is not None for s in self.slots)
        states = state_buffers.allocate(buckets, self.fmt, algorithm, param_groups)
        for bucket, state in zip(buckets, states):
            if folding:
                bucket.acc = torch.zeros(bucket.grad.shape, dtype=torch.float32,
                                         device=self.device)
            keys = codecs.bucket_stream_keys(self.fmt.seed, len(self.slots),
                                             len(algorithm.state_keys))
            self.slots.append(BucketSlot(bucket, state, algorithm.aux(bucket),
                                         torch.tensor(keys, dtype=torch.int64).to(self.device)))
        return list(buckets)

    def set_algorithm(self, algorithm: Algorithm) -> None:
        for slot in self.slots:
            slot.aux = algorithm.aux(slot.bucket)

    def sync_hyper(self, param_groups: Sequence[dict], algorithm: Algorithm) -> None:
        """Send the changed hyperparameters to the device, each as a fill (never a blocking
        copy); tensor values (torch's tensor lr) are copied every step, device to device."""
        for gi, group in enumerate(param_groups):
            row, seen = algorithm.hyper_row(group), self._hyper_seen[gi]
            if all(type(a) is type(b) is float and a == b for a, b in zip(row, seen)):
                continue
            for k, (value, old) in enumerate(zip(row, seen)):
                if isinstance(value, torch.Tensor):
                    self.hyper[gi, k].copy_(value, non_blocking=True)
                elif type(old) is not float or value != old:
                    self.hyper[gi, k].fill_(value)
            self._hyper_seen[gi] = row

    def max_norm(self, value: Optional[float]) -> Optional[torch.Tensor]:
        """`max_grad_norm` as a 0-dim fp32 device tensor (a fill when it changed, so a new value
        compiles nothing), or None when not clipping."""
        if value is None:
            return None
        if self._max_norm is None:
            self._max_norm = torch.full((), value, dtype=torch.float32, device=self.device)
        elif value != self._max_norm_seen:
            self._max_norm.fill_(value)
        self._max_norm_seen = value
        return self._max_norm

    def remove_hooks(self) -> None:
        """Stop tracking the parameters' gradients (another optimizer steps them)."""
        for slot in self.slots:
            slot.bucket.remove_hooks()

    def flat_params(self) -> list[torch.Tensor]:
        return [p for s in self.slots for p in s.bucket.params]

    def sync_from_params(self) -> None:
        for slot in self.slots:
            slot.bucket.sync_from_params()

    def grads(self) -> list[torch.Tensor]:
        return [s.bucket.grad for s in self.slots]

    def accs(self) -> list[Optional[torch.Tensor]]:
        return [s.bucket.acc for s in self.slots]

    def fold_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The raw gradients and their fp32 sums (allocated on first use), synced."""
        for slot in self.slots:
            b = slot.bucket
            if b.acc is None:
                b.acc = torch.zeros(b.grad.shape, dtype=torch.float32, device=self.device)
            b.sync_from_params()
        return self.grads(), self.accs()
