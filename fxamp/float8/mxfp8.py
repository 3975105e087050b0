"""MXFP8: float8_e4m3fn values with one power-of-two (e8m0) scale per block of 32 (OCP MX v1.0).

Numerics are torchao 0.18's `to_mx` / `MXTensor.dequantize` on its emulated path (the eager
PyTorch code that also runs on CPU), bit for bit: Note [MX scale rounding] below.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fxamp.float8.blocks import MX_BLOCK, to_blocks

__all__ = ["MX_SCALE_MODES", "MXQuantized", "mx_dequantize", "mx_quantize"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
E4M3_MAX_POW2 = 8  # the largest power of two below 448: 2**8
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0 ** -126

# Note [MX scale rounding]
# A block's scale is 2**e with e from the block's amax. torchao's modes:
#   rceil: e = ceil(log2(amax / 448)), NVIDIA's rule (cuBLAS block quantization, Blackwell's
#          cvt.rp.satfinite.ue8m0x2.f32); torchtitan's default. Values are x * 2**-e. An amax
#          of inf gives e8m0 254 (values x * 2**-127, saturated), nan gives 255.
#   floor: e = floor(log2(amax)) - 8, the OCP spec's rule; values x / 2**e saturated to 448.
#          inf amax gives 2**120 (its float32 exponent field), nan gives 255.
#   ceil:  floor's e, plus one when amax is not a power of two.
#   even:  floor's e after rounding amax's mantissa to e4m3's 3 bits (half up).
# Two quirks are torchao's and kept for bitwise equality:
#   - rceil takes log2 in float32 (torch.log2), as torchao's eager fallback does; for amax/448
#     a hair above a power of two that log2 rounds to the integer below, and e stays one lower
#     than the hardware instruction would give.
#   - a block whose e8m0 is 0 (amax below about 2**-118) is scaled by 1 (rceil) or by
#     2**-126 (floor and friends) on the way in but by 2**-127 on the way out.
MX_SCALE_MODES = ("rceil", "floor", "ceil", "even")


class MXQuantized(NamedTuple):
    """An MXFP8 tensor: `data` (float8_e4m3fn, the input's shape), `scale` (float8_e8m0fnu, the
    input's shape with `dim` divided by 32) and the blocked `dim`."""

    data: torch.Tensor
    scale: torch.Tensor
    dim: int


def mx_quantize(x: torch.Tensor, *, dim: int = -1, mode: str = "rceil") -> MXQuantized:
    """Quantize `x` to MXFP8 along `dim` (its GEMM's reduction dim), in blocks of 32.

    Args:
        x: float32, bfloat16 or float16; `x.shape[dim]` a multiple of 32 (`block_refusal`).
        dim: the dim cut into blocks.
        mode: scale rounding, one of `MX_SCALE_MODES` (Note [MX scale rounding]).

    Returns:
        `MXQuantized`; for dim=-1 its data and scale equal torchao's
        `to_mx(x, torch.float8_e4m3fn, 32, scaling_mode)` (scale, data) bit for bit.
    """
    if mode not in MX_SCALE_MODES:
        raise ValueError(f"MX scale mode {mode!r} is not one of "
                         f"{', '.join(map(repr, MX_SCALE_MODES))}")
    blocks = to_blocks(x, dim, MX_BLOCK)
    amax = blocks.data.abs().amax(dim=-1, keepdim=True)
    if mode == "rceil":
        biased, values = _rceil(blocks.data, amax)
    else:
        biased, values = _from_exponent_bits(blocks.data, amax, mode)
    return MXQuantized(blocks.restore(values.to(E4M3)),
                       blocks.restore(biased.view(torch.float8_e8m0fnu)), blocks.dim)


def _rceil(data: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    descale = amax / E4M3_MAX
    finite = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    biased = torch.where(torch.isnan(descale), E8M0_NAN,
                         torch.where(torch.isinf(descale), 254, finite.to(torch.uint8)))
    biased = biased.to(torch.uint8)
    inverse = torch.where(biased == 0, 1.0, torch.exp2(E8M0_BIAS - biased.to(torch.float32)))
    inverse = torch.where(biased == 254, 2.0 ** -127, inverse)
    inverse = torch.where(biased == E8M0_NAN, descale, inverse)  # nan stays nan
    return biased, torch.clamp(data * inverse, -E4M3_MAX, E4M3_MAX)


def _from_exponent_bits(data: torch.Tensor, amax: torch.Tensor,
                        mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    # floor/ceil/even read amax's float32 exponent field (Note [MX scale rounding]).
    nan = torch.isnan(amax)
    bits = amax.view(torch.int32)
    if mode == "even":  # round the mantissa to 3 bits, half up, then drop it
        bits = (bits + (1 << 19)) & (0x1FF << 23)
    exponent = (torch.bitwise_right_shift(bits, 23) & 0xFF) - 127
    if mode == "ceil":
        exponent = exponent + ((bits & 0x7FFFFF) > 0).to(exponent.dtype)
    unbiased = torch.clamp(exponent - E4M3_MAX_POW2, -E8M0_BIAS, E8M0_BIAS + 1)
    biased = torch.where(nan, E8M0_NAN, (unbiased + E8M0_BIAS).to(torch.uint8)).to(torch.uint8)
    scale = torch.bitwise_left_shift(biased.to(torch.int32), 23).view(torch.float32)
    scale = torch.clamp(scale, min=F32_MIN_NORMAL)  # torchao's floor for e8m0 0 (quirk above)
    return biased, torch.clamp(data / scale, -E4M3_MAX, E4M3_MAX)


def mx_scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """2**(e - 127) for e8m0 scales, nan for 255 (torchao's `get_fp_scale`)."""
    biased = scale.view(torch.uint8)
    power = torch.pow(torch.full_like(biased, 2.0, dtype=torch.float32),
                      biased.to(torch.int16) - E8M0_BIAS)
    return torch.where(biased != E8M0_NAN, power, float("nan"))


def mx_dequantize(q: MXQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q` back in `dtype`: each value times its block's scale, both first converted to `dtype`
    (torchao's `MXTensor.dequantize(dtype)`, bit for bit)."""
    dim = q.dim
    data = q.data.movedim(dim, -1)
    blocked = data.reshape(*data.shape[:-1], -1, MX_BLOCK).to(dtype)
    scale = mx_scale_to_float32(q.scale.movedim(dim, -1)).to(dtype).unsqueeze(-1)
    return (blocked * scale).reshape(data.shape).movedim(-1, dim)
