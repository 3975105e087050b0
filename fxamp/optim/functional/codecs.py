"""Encodings of masters and moments (StateFormat) as pure tensor functions for the fused step.

Every function here runs inside the compiled `update` graph, elementwise or per block, with no
host read. `decode_*` turns the stored buffers into fp32; `encode_*` turns new fp32 values into
new buffer contents, which the caller selects against the old ones when the step is skipped and
stores. 8-bit contents come back as exact integers in a wider type (fp32 codes, an int32
correction) that converts to the buffer's dtype without rounding: the select is done on those
(fused_step's Note [Selecting 8-bit codes]).

Design (docs/design.md): Note [8-bit moments], Note [Rounding compact moments stochastically],
Note [16-bit masters], Note [A codec the CPU runs fast].
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from fxamp.optim.buffers.bucket import ALIGN

__all__ = ["BLOCK", "new_state", "decode_state", "encode_state", "new_correction",
           "decode_master", "encode_master", "random_bits", "stream_bits", "stream_key",
           "bucket_stream_keys", "high_half", "state_half", "master_stream", "state_stream"]

Tensor = torch.Tensor
# Elements per scale of an 8-bit moment: the flat layout's alignment, so that a block never
# straddles two parameters nor two FSDP2 shards (Note [8-bit moments]).
BLOCK = ALIGN


# ------------------------------------------------------------------------------------ moments
def new_state(numel: int, moments: str, unsigned: bool, device,
              full: torch.dtype = torch.float32) -> tuple[Tensor, ...]:
    """Zeroed buffers of one moment of `numel` elements (a multiple of BLOCK); `full` is the
    dtype of "fp32" moments (the weights' dtype for 16-bit parameters without masters)."""
    if moments == "int8":
        codes = torch.zeros(numel, dtype=torch.uint8 if unsigned else torch.int8, device=device)
        return codes, torch.zeros(numel // BLOCK, dtype=torch.bfloat16, device=device)
    return (torch.zeros(numel, dtype=full if moments == "fp32" else torch.bfloat16,
                        device=device),)


def decode_state(bufs: tuple[Tensor, ...], unsigned: bool) -> Tensor:
    if len(bufs) == 1:
        return bufs[0].float()
    codes, scale = bufs
    s = scale.float()[:, None]
    if unsigned:
        root = codes.float().view(-1, BLOCK) * (s * (1 / 255))
        return root.square().view(codes.shape)
    return (_uncompand(codes.float().view(-1, BLOCK)) * s).view(codes.shape)


def encode_state(x: Tensor, bufs: tuple[Tensor, ...], unsigned: bool,
                 bits: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """With `bits` (random_bits) the state is rounded stochastically (Note [Rounding compact
    moments stochastically]); without them every value rounds to nearest."""
    if len(bufs) == 1:
        if bits is not None and bufs[0].dtype == torch.bfloat16:
            return (_round_stochastic(x, bits),)
        return (x.to(bufs[0].dtype),)
    codes, _ = bufs
    if unsigned:  # v >= 0 (a sum of non-negative terms); the root the update takes anyway
        blocks = x.sqrt().view(-1, BLOCK)
        top = x.view(-1, BLOCK).amax(1).sqrt()  # = max of the roots, one root per block
    else:
        blocks = x.view(-1, BLOCK)
        top = blocks.abs().amax(1)
    s = _bf16_above(top)[:, None]
    # One division per block, not per element (Note [A codec the CPU runs fast]).
    y = (blocks * torch.where(s > 0, 1 / s, 0.0)).clamp(-1, 1)
    if unsigned:
        code = y * 255
        q = _round(code, bits).clamp(0, 255)
        q = torch.where((q == 0) & (y > 0), 1.0, q)  # Note [8-bit moments]
    else:
        q = _round(254 * y / (1 + y.abs()), bits).clamp(-127, 127)
    return q.view(x.shape), s.view(-1).to(torch.bfloat16)  # q: fp32 codes, exact integers


def _uncompand(code: Tensor) -> Tensor:
    z = code * (1 / 127)
    return z / (2 - z.abs())  # m / scale of an int8 code: the inverse of 2y / (1 + |y|)


def _round(code: Tensor, bits: Optional[Tensor]) -> Tensor:
    """The real-valued `code` rounded to nearest, or with `bits` to its floor or ceiling with
    the probability that makes the code unbiased (Note [Rounding compact moments
    stochastically])."""
    if bits is None:
        return code.round()
    return (code + bits.view(code.shape).float() * 2.0**-16).floor()


# ------------------------------------------------------------------------------------ masters
def new_correction(param: Tensor, master: str) -> Optional[Tensor]:
    """The buffer that carries what a bf16 weight drops, or None (Note [16-bit masters])."""
    if master == "kahan":
        return torch.zeros_like(param, dtype=torch.bfloat16)
    if master == "int8_error":
        return torch.zeros_like(param, dtype=torch.int8)
    return None


def decode_master(bufs: tuple[Tensor, ...], master: str) -> Tensor:
    w = bufs[0].float()
    if master == "kahan":
        return w + bufs[1].float()
    if master == "int8_error":  # the 24-bit master: bf16's bits and 8 more below them
        return (w.view(torch.int32) + (bufs[1].to(torch.int32) << 8)).view(torch.float32)
    return w


def encode_master(x: Tensor, bufs: tuple[Tensor, ...], master: str,
                  bits: Optional[Tensor]) -> tuple[Tensor, ...]:
    if master == "stochastic":
        return (_round_stochastic(x, bits),)
    if master == "fp32":
        return (x.to(bufs[0].dtype),)
    if master == "kahan":
        w = bf16_value(x)
        return w.to(torch.bfloat16), (x - w).to(torch.bfloat16)
    # int8_error: x rounded to 24 bits (8 below bf16's), then to the nearest bf16 (ties away
    # from zero, in magnitude on the bits); what is left is a multiple of 2**8 in [-2**15,
    # 2**15), stored as an int8 count of 2**8 (Note [16-bit masters]). All in int32: finite
    # values never wrap (the largest finite float's bits are 0x7F7FFFFF).
    t = (x.view(torch.int32) + 0x80) & -256
    w = (t + 0x8000) & -65536
    return w.view(torch.float32).to(torch.bfloat16), (t - w) >> 8  # int32, in [-128, 127]


def bf16_value(x: Tensor) -> Tensor:
    """x rounded to the nearest bf16 (ties to even), still as fp32.

    # Note [Rounding that the compiler keeps]
    Inductor may drop a round trip `x.to(bfloat16).float()` inside one kernel (it computes
    bf16 in fp32 unless emulate_precision_casts is set), and the rounding error that a
    correction term or a block scale must match would then read as 0. Integer rounding on
    the bits is kept: add 0x7FFF plus the lowest kept bit, clear the 16 dropped bits. In
    int32: for every finite x the sum stays below 2**31 in magnitude (the largest finite
    float's bits are 0x7F7FFFFF), so it never wraps.
    """
    raw = x.view(torch.int32)
    return ((raw + (0x7FFF + ((raw >> 16) & 1))) & -65536).view(torch.float32)


def _bf16_above(x: Tensor) -> Tensor:
    # The smallest bf16 >= x (x >= 0, finite), as fp32: a block scale that no value of the block
    # exceeds, so none is clipped (a clip of the largest v, repeated, would bias it down).
    return ((x.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32)


def _round_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    # Adding 16 random bits below bf16's last place and truncating rounds up with probability
    # (dropped bits) / 2**16, on the magnitude, so either sign is unbiased.
    return ((x.view(torch.int32) + bits) & -65536).view(torch.float32).to(torch.bfloat16)


def _hash64(x: Tensor) -> Tensor:
    # A 32-bit integer finaliser (xorshift-multiply) in int64: multipliers below 2**31 keep
    # every product under 2**63. Used on the one scalar key of a step.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _mix(x: Tensor) -> Tensor:
    # The same finaliser per element in int32, whose products wrap as uint32's would (the
    # vectorised kernels and eager torch multiply int32 lanes modulo 2**32); the shifts mask
    # the sign bits an arithmetic shift drags in.
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x5BD1E995
    return x ^ ((x >> 16) & 0xFFFF)


def master_stream(bucket: int) -> int:
    """The random stream of the stochastically rounded master of bucket `bucket`."""
    return bucket << 3


def state_stream(bucket: int, state: int) -> int:
    """The random stream of state `state` of bucket `bucket` (after its master's).

    A stream's 16 bits are one half of a 32-bit hash word; Adam's m and v (states 0 and 1)
    take the two halves of one word, so the step hashes each element once for both
    (Note [A codec the CPU runs fast])."""
    return master_stream(bucket) + 2 + state


def stream_key(seed: int, stream: int) -> int:
    """The constant `stream_bits` mixes the step into: the stream's hash word under `seed`."""
    return (seed * 0x85EBCA6B + (stream >> 1) * 0xC2B2AE35) & 0x7FFFFFFF


def bucket_stream_keys(seed: int, bucket: int, n_states: int) -> list[int]:
    """`stream_key` of bucket `bucket`'s master stream, then of each of its states' streams:
    the bucket's row of keys, which the step reads from the device (the compiled update then
    does not depend on the seed or the bucket's position)."""
    streams = [master_stream(bucket)] + [state_stream(bucket, k) for k in range(n_states)]
    return [stream_key(seed, s) for s in streams]


def high_half(stream: int) -> bool:
    """Whether `stream` takes the high 16 bits of its hash word."""
    return bool(stream & 1)


def state_half(state: int) -> bool:
    """`high_half` of state `state`'s stream, the same in every bucket."""
    return high_half(state_stream(0, state))


def random_bits(numel: int, seed: int, step: Tensor, stream: int) -> Tensor:
    """16 random bits per element (int32 in [0, 2**16)), a pure function of (seed, step,
    stream, index); streams 2k and 2k + 1 are the low and high halves of one hash."""
    return stream_bits((numel,), stream_key(seed, stream), step, high_half(stream))


def stream_bits(shape: Sequence[Any], key: Any, step: Tensor, high: bool) -> Tensor:
    """`random_bits` of the stream whose `stream_key` is `key` (an int or an int64 0-dim
    tensor, the same bits either way), shaped `shape` (the flat index runs row by row)."""
    word = _hash64((step.to(torch.int64) * 0x9E3779B1 + key) & 0xFFFFFFFF) & 0x7FFFFFFF
    index = torch.arange(math.prod(shape), dtype=torch.int32, device=step.device).view(shape)
    bits = _mix(index ^ word.to(torch.int32))
    return (bits >> 16) & 0xFFFF if high else bits & 0xFFFF
