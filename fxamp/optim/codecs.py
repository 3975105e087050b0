"""Encodings of masters and moments (StateFormat) as pure tensor functions for the fused step.

Every function here runs inside the compiled `update` graph, elementwise or per block, with no
host read. `decode_*` turns the stored buffers into fp32; `encode_*` turns new fp32 values into
new buffer contents, which the caller selects against the old ones when the step is skipped.

# Note [8-bit moments]
Each moment is split into blocks of BLOCK elements with one bf16 scale per block, the block's
absolute maximum (block-wise quantisation: Dettmers et al. 2021, "8-bit Optimizers via
Block-wise Quantization", arXiv:2110.02861). BLOCK equals the flat layout's ALIGN, so a block
never straddles two parameters (per-parameter state dict entries hold their own codes and
scales) nor two FSDP2 shards (each rank quantises its shard). Inside a block the values are
companded before rounding to 8 bits, with FlashOptim's companders (Gonzalez Ortiz et al. 2026,
"FlashOptim: Optimizers for Memory Efficient Training", arXiv:2602.23349): a signed moment
(Adam's m, SGD's momentum) x/scale in [-1, 1] is stored as round(127 * 2y / (1 + |y|)) in int8,
which spends more codes near 0; a non-negative one (Adam's v) is stored as its square root,
round(255 * sqrt(v) / max sqrt(v)) in uint8. A non-zero v never rounds to code 0 (it takes code
1): v sits under a square root in a denominator, and a v read back as 0 would turn the update
into m / eps.

# Note [Rounding compact moments stochastically]
Adam's v decays by beta2 = 0.999 per step, a change of 1e-3 of itself (5e-4 of its square root).
No 8- or 16-bit encoding resolves that: a code step of sqrt(v) is 1/255 of the block's largest,
bf16's spacing 2**-8 of the value, so rounding to nearest writes back the v it read, and v
stops decaying at its largest value (measured: after 500 steps without gradients, int8 and
bf16 v alike still hold e**0.5 = 1 / 0.999**500 times Adam's). The steps then shrink as if by
AMSGrad's max, and training slows (+5 % final loss on digits). m decays by beta1 = 0.9, which
bf16 resolves but an int8 code of 5 or less does not (0.9 * 5 rounds back to 5): small
momenta never die out (after 40 steps the sum of |m| is 11 % high). So every int8 state, and a
bf16 v, is rounded stochastically, to the code below or above with the probabilities that make
the decoded value unbiased: m between the two companded values, and an int8 v in its square
root, the quantity the update divides by (unbiased in v itself, the noise made the steps larger
on average, E[1/sqrt(v)] > 1/sqrt(E[v]): digits ended 0.62 % below fp32's final loss over three
seeds, against 0.22 % rounded in the root). Each decays as Adam's does, in expectation. The random bits are those of
Note [16-bit masters] (a counter-based hash), on a stream per state and bucket
(`state_stream`), so a resumed or another rank's run draws the same. The non-zero rule above
still holds (a rounding to code 0 of a non-zero v takes code 1).

# Note [16-bit masters]
With a bf16 model, the model itself is the master (no fp32 copy); the bits that bf16 drops are
kept, or not, by the master kind:
- "kahan": a bf16 compensation buffer holds new - round(new), so weight + compensation carries
  about 16 significant bits and every update's rounding error is carried into the next one
  (Kahan summation; torch-optimi's Kahan-compensated updates).
- "int8_error": FlashOptim's split: the error new - round(new) is at most half an ulp of the
  rounded bf16 value, so it is stored as an int8 fraction of that half ulp (a 24-bit master in
  3 bytes).
- "stochastic": no extra buffer; the update rounds up or down with probability given by the
  distance (unbiased in expectation). The random bits are a hash of (seed, step, bucket,
  element index) computed in the graph (a counter-based generator: no generator state to
  save, and a resumed run draws the same bits).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["BLOCK", "new_state", "decode_state", "encode_state", "new_correction",
           "decode_master", "encode_master", "random_bits", "state_stream"]

Tensor = torch.Tensor
BLOCK = 64  # elements per scale of an 8-bit moment; equals flat.ALIGN (see the Note)
_M32 = 0xFFFFFFFF


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
        root = codes.float().view(-1, BLOCK) * (s / 255)
        return root.square().view(-1)
    return (_uncompand(codes.float().view(-1, BLOCK)) * s).view(-1)


def encode_state(x: Tensor, bufs: tuple[Tensor, ...], unsigned: bool,
                 bits: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """With `bits` (random_bits) the state is rounded stochastically, unbiased (Note [Rounding
    compact moments stochastically]); without them every value rounds to nearest."""
    if len(bufs) == 1:
        if bits is not None and bufs[0].dtype == torch.bfloat16:
            return (_round_stochastic(x, bits),)
        return (x.to(bufs[0].dtype),)
    codes, _ = bufs
    blocks = x.clamp_min(0).sqrt().view(-1, BLOCK) if unsigned else x.view(-1, BLOCK)
    s = _bf16_above(blocks.abs().amax(1))[:, None]
    y = torch.where(s > 0, blocks / s, 0.0).clamp(-1, 1)
    if unsigned:
        q = _round(y * 255, y, _root, bits, (0, 255))
        q = torch.where((q == 0) & (y > 0), 1.0, q)  # Note [8-bit moments]
    else:
        q = _round(254 * y / (1 + y.abs()), y, _uncompand, bits, (-127, 127))
    return q.view(-1).to(codes.dtype), s.view(-1).to(torch.bfloat16)


def _root(code: Tensor) -> Tensor:
    return code / 255  # sqrt(v) / scale of a uint8 code


def _uncompand(code: Tensor) -> Tensor:
    z = code / 127
    return z / (2 - z.abs())  # m / scale of an int8 code: the inverse of 2y / (1 + |y|)


def _round(code: Tensor, value: Tensor, decode, bits: Optional[Tensor],
           limits: tuple[int, int]) -> Tensor:
    """The real-valued `code` rounded to nearest, or with `bits` to its floor or ceiling with
    the probability that makes the decoded value unbiased (Note [Rounding compact moments
    stochastically])."""
    if bits is None:
        return code.round()
    lo = code.floor()
    below, above = decode(lo), decode(lo + 1)
    up = (value - below) / (above - below)
    u = bits.view(code.shape).float() * 2.0**-16
    return torch.where(u < up, lo + 1, lo).clamp(*limits)


# ------------------------------------------------------------------------------------ masters
def new_correction(param: Tensor, master: str) -> Optional[Tensor]:
    """The buffer that carries what a bf16 weight drops, or None (Note [16-bit masters])."""
    if master == "kahan":
        return torch.zeros_like(param, dtype=torch.bfloat16)
    if master == "int8_error":
        return torch.zeros_like(param, dtype=torch.int8)
    return None


def _half_ulp(w: Tensor) -> Tensor:
    """Half the spacing of bf16 numbers at w (an fp32 holding a bf16 value): 2**(e - 8)."""
    exponent = (w.view(torch.int32) >> 23) & 0xFF
    return ((exponent - 8).clamp_min(1) << 23).view(torch.float32)


def decode_master(bufs: tuple[Tensor, ...], master: str) -> Tensor:
    w = bufs[0].float()
    if master == "kahan":
        return w + bufs[1].float()
    if master == "int8_error":
        return w + bufs[1].float() * (_half_ulp(w) / 127)
    return w


def encode_master(x: Tensor, bufs: tuple[Tensor, ...], master: str,
                  bits: Optional[Tensor]) -> tuple[Tensor, ...]:
    if master == "stochastic":
        return (_round_stochastic(x, bits),)
    if master == "fp32":
        return (x.to(bufs[0].dtype),)
    w = bf16_value(x)
    if master == "kahan":
        return w.to(torch.bfloat16), (x - w).to(torch.bfloat16)
    frac = ((x - w) / _half_ulp(w)).clamp(-1, 1)  # int8_error
    return w.to(torch.bfloat16), (frac * 127).round().to(torch.int8)


def bf16_value(x: Tensor) -> Tensor:
    """x rounded to the nearest bf16 (ties to even), still as fp32.

    # Note [Rounding that the compiler keeps]
    Inductor may drop a round trip `x.to(bfloat16).float()` inside one kernel (it computes
    bf16 in fp32 unless emulate_precision_casts is set), and the rounding error that a
    correction term or a block scale must match would then read as 0. Integer rounding on
    the bits is kept: add 0x7FFF plus the lowest kept bit, clear the 16 dropped bits.
    """
    raw = x.view(torch.int32).to(torch.int64)
    raw = (raw + 0x7FFF + ((raw >> 16) & 1)) & -65536
    return raw.to(torch.int32).view(torch.float32)


def _bf16_above(x: Tensor) -> Tensor:
    # The smallest bf16 >= x (x >= 0, finite), as fp32: a block scale that no value of the block
    # exceeds, so none is clipped (a clip of the largest v, repeated, would bias it down).
    raw = x.view(torch.int32).to(torch.int64)
    return ((raw + 0xFFFF) & -65536).to(torch.int32).view(torch.float32)


def _round_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    # Adding 16 random bits below bf16's last place and truncating rounds up with probability
    # (dropped bits) / 2**16, on the magnitude, so either sign is unbiased.
    raw = x.view(torch.int32).to(torch.int64)
    return ((raw + bits) & -65536).to(torch.int32).view(torch.float32).to(torch.bfloat16)


def _hash(x: Tensor) -> Tensor:
    # A 32-bit integer finaliser (xorshift-multiply); multipliers below 2**31 keep every
    # product under 2**63, so int64 arithmetic never overflows.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def state_stream(bucket: int, state: int) -> int:
    """The random stream of state `state` of bucket `bucket` (masters use stream `bucket`)."""
    return (state + 1) << 20 | bucket


def random_bits(numel: int, seed: int, step: Tensor, stream: int) -> Tensor:
    """16 random bits per element, int64, a pure function of (seed, step, stream, index)."""
    base = (seed * 0x85EBCA6B + stream * 0xC2B2AE35) & _M32
    key = _hash((step.to(torch.int64) * 0x9E3779B1 + base) & _M32)
    index = torch.arange(numel, dtype=torch.int64, device=step.device)
    return _hash(index ^ key) & 0xFFFF
