"""The buffers a fused optimizer keeps per bucket for its StateFormat (codecs.py encodes them)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fxamp.optim.functional import codecs
from fxamp.optim.functional.algorithms import Algorithm
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.buffers.state_format import StateFormat

__all__ = ["UNSIGNED_STATES", "BucketState", "allocate", "rounding"]

# States that are never negative: stored as uint8 square roots when 8-bit (Note [8-bit moments]).
UNSIGNED_STATES = frozenset({"exp_avg_sq"})


def rounding(keys: Sequence[str], fmt: StateFormat) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Per state: whether it is non-negative, and whether it is rounded stochastically (every
    int8 state, and a bf16 v: Note [Rounding compact moments stochastically] in docs/design.md)."""
    unsigned = tuple(k in UNSIGNED_STATES for k in keys)
    return unsigned, tuple(fmt.moments == "int8" or (u and fmt.moments == "bf16")
                           for u in unsigned)


class BucketState:
    """One bucket's optimizer-side buffers.

    Attributes:
        master: the kind of master its update reads ("fp32" for fp32 masters, fp32 parameters
            and 16-bit parameters without masters; else StateFormat.master).
        correction: what a bf16 model-as-master drops (Note [16-bit masters]), or None.
        states: per state key, a tuple of buffers (one; or int8 codes and bf16 scales).
    """

    def __init__(self, bucket: Bucket, fmt: StateFormat, keys: Sequence[str]) -> None:
        own = bucket.master is None and bucket.param.dtype == torch.bfloat16
        self.master = fmt.master if own else "fp32"
        self.correction: Optional[torch.Tensor] = codecs.new_correction(bucket.weights,
                                                                        self.master)
        numel, device = bucket.weights.numel(), bucket.weights.device
        # Without masters (master_weights=False) full-width moments are in the model's dtype,
        # as everything else is (Apex O3).
        full = bucket.weights.dtype if self.master == "fp32" else torch.float32
        self.states = tuple(codecs.new_state(numel, fmt.moments, k in UNSIGNED_STATES, device,
                                             full) for k in keys)

    def weights(self, bucket: Bucket) -> tuple[torch.Tensor, ...]:
        """The buffers `update` decodes into fp32 weights."""
        return (bucket.weights,) + (() if self.correction is None else (self.correction,))


def allocate(buckets: Sequence[Bucket], fmt: StateFormat, algorithm: Algorithm,
             param_groups: Sequence[dict]) -> list[BucketState]:
    return [BucketState(b, fmt, algorithm.state_keys
                        if algorithm.has_state(param_groups[b.group_index]) else ())
            for b in buckets]
