"""Block-scaled GEMMs, emulated: each operand quantized along its own reduction dim (MXFP8 or
NVFP4), dequantized, multiplied in float32 (the `mxfp8` and `nvfp4` recipes' GEMMs:
fxamp/float8/block_gemm.py; docs/float8.md, "Block-scaled formats"). `block_scales`: the
scale each block of an operand gets, as the debug tools report it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from fxamp.float8.blocks import FORMATS, block_refusal, to_blocks
from fxamp.float8.mxfp8 import MX_SCALE_MODES, mx_dequantize, mx_quantize, mx_scale_to_float32
from fxamp.float8.nvfp4 import (E4M3_TINY, NVFP4_RULES, hadamard_transform, nvfp4_dequantize,
                                nvfp4_quantize)

__all__ = ["BlockFormat", "block_scales", "blockscaled_mm", "fake_quantize", "linear_refusal"]

Noise = Union[None, torch.Generator, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """How one GEMM operand is quantized.

    Attributes:
        fmt: "mxfp8" (e4m3 values, e8m0 scale per 32) or "nvfp4" (e2m1 values, e4m3 scale per
            16, float32 scale per tensor).
        mode: MXFP8 scale rounding (`MX_SCALE_MODES`; "rceil" is torchtitan's default).
        rule: NVFP4 scale rule (`NVFP4_RULES`).
        tiles: NVFP4 16x16 blocks over the reduction dim and the other one (weights).
        rht_signs: NVFP4 random Hadamard transform with these 16 signs before quantizing (the
            grad_weight GEMM's operands in torchao's recipe); both operands must agree.
        stochastic: NVFP4 stochastic rounding; the GEMM then needs a noise source.
    """

    fmt: str = "mxfp8"
    mode: str = "rceil"
    rule: str = "kernel"
    tiles: bool = False
    rht_signs: Optional[tuple[int, ...]] = None
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"block format {self.fmt!r} is not one of "
                             f"{', '.join(map(repr, FORMATS))}")
        if self.mode not in MX_SCALE_MODES:
            raise ValueError(f"mode {self.mode!r} is not one of "
                             f"{', '.join(map(repr, MX_SCALE_MODES))}")
        if self.rule not in NVFP4_RULES:
            raise ValueError(f"rule {self.rule!r} is not one of "
                             f"{', '.join(map(repr, NVFP4_RULES))}")
        nvfp4_only = [n for n in ("tiles", "rht_signs", "stochastic") if getattr(self, n)]
        if self.fmt == "mxfp8" and nvfp4_only:
            raise ValueError(f"{', '.join(nvfp4_only)} apply to fmt='nvfp4', not 'mxfp8'")
        if self.rht_signs is not None:
            object.__setattr__(self, "rht_signs", tuple(int(s) for s in self.rht_signs))


def fake_quantize(x: torch.Tensor, fmt: BlockFormat, *, dim: int,
                  other_dim: Optional[int] = None, noise: Noise = None,
                  batch_dims: int = 0) -> torch.Tensor:
    """`x` quantized along `dim` and dequantized, in float32 (after the Hadamard transform when
    `fmt.rht_signs` is set). `other_dim` is the tile's second dim for `fmt.tiles`;
    `batch_dims` leading dims are separate tensors (NVFP4: a per-tensor scale each)."""
    if fmt.tiles and other_dim is None:
        raise ValueError("16x16 blocks (tiles=True) need other_dim, the tile's second dim")
    if fmt.fmt == "mxfp8":
        return mx_dequantize(mx_quantize(x, dim=dim, mode=fmt.mode))
    if fmt.stochastic and noise is None:
        raise ValueError("a stochastic-rounding operand needs noise: a torch.Generator or an int64 "
                         "seed tensor")
    if fmt.rht_signs is not None:
        x = hadamard_transform(x, fmt.rht_signs, dim=dim)
    q = nvfp4_quantize(x, dim=dim, tile_dim=other_dim if fmt.tiles else None, rule=fmt.rule,
                       stochastic=noise if fmt.stochastic else None, batch_dims=batch_dims)
    return nvfp4_dequantize(q)


def block_scales(x: torch.Tensor, fmt: BlockFormat, *, dim: int, other_dim: Optional[int] = None,
                 batch_dims: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale of every block of `x` quantized as `fake_quantize` quantizes it (before any
    Hadamard transform), as three float32/bool tensors shaped like the blocks: the factor the
    block's values are multiplied by (2**e for MXFP8; per-tensor scale times e4m3 block scale
    for NVFP4), whether that scale is at the format's floor (e8m0's 2**-127, e4m3's 2**-6: the
    block's small values lose bits or flush), and whether the block is all zero."""
    zero = to_blocks(x, dim, FORMATS[fmt.fmt]).data.abs().amax(dim=-1) == 0
    if fmt.fmt == "mxfp8":
        q = mx_quantize(x, dim=dim, mode=fmt.mode)
        scale = q.scale.movedim(q.dim, -1)
        return mx_scale_to_float32(scale), scale.view(torch.uint8) == 0, zero
    q = nvfp4_quantize(x, dim=dim, tile_dim=other_dim if fmt.tiles else None, rule=fmt.rule,
                       batch_dims=batch_dims)
    block = q.scale.to(torch.float32)
    scale = (q.tensor_scale * block).movedim(q.dim, -1)
    return scale, block.movedim(q.dim, -1) <= E4M3_TINY, zero


def blockscaled_mm(a: torch.Tensor, b: torch.Tensor, *, a_format: BlockFormat,
                   b_format: BlockFormat, out_dtype: Optional[torch.dtype] = None,
                   a_noise: Noise = None, b_noise: Noise = None) -> torch.Tensor:
    """`a @ b` with both operands block-scaled from their high-precision values, emulated.

    Args:
        a: [..., M, K], quantized along K (dim -1).
        b: [K, N], quantized along K (dim 0). `tiles` makes an operand's blocks 16x16 (over
            M and K for a, K and N for b; torchao's weight blocks).
        a_format, b_format: each operand's `BlockFormat`.
        out_dtype: the result's dtype (a's by default).
        a_noise, b_noise: the noise source of a stochastic-rounding operand (a
            torch.Generator or an int64 seed tensor; nothing global is used).

    Returns:
        dequant(a) @ dequant(b) in float32, converted to `out_dtype`. Shapes `linear_refusal`
        or `block_refusal` refuses raise ValueError (nothing is padded).
    """
    if b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"blockscaled_mm takes a [..., M, K] and b [K, N], not "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a_format.rht_signs != b_format.rht_signs:
        raise ValueError("a Hadamard transform must rotate both operands of a GEMM alike: "
                         f"rht_signs {a_format.rht_signs} and {b_format.rht_signs}")
    for name, x, f, dim, other in (("a", a, a_format, -1, -2), ("b", b, b_format, 0, 1)):
        why = block_refusal(f.fmt, x.shape, dim, tile_dim=other if f.tiles else None)
        if why is not None:
            raise ValueError(f"operand {name} of shape {tuple(x.shape)}: {why}")
    a_dq = fake_quantize(a, a_format, dim=-1, other_dim=-2, noise=a_noise)
    b_dq = fake_quantize(b, b_format, dim=0, other_dim=1, noise=b_noise)
    return torch.matmul(a_dq, b_dq).to(out_dtype or a.dtype)


def linear_refusal(fmt: str, m: int, k: int, n: int, *, hardware: bool = False) -> Optional[str]:
    """Why a linear (input [M, K], weight [N, K]) cannot train with `fmt` in all three GEMMs, or
    None: each GEMM blocks its own reduction dim (the output K, grad_input N, grad_weight M).

    Args:
        fmt: "mxfp8" or "nvfp4".
        m, k, n: the linear's sizes (M the flattened batch).
        hardware: also apply torchao's kernel rule for NVFP4 training (M, K and N multiples of
            128, `nvfp4_mm_triton`).

    Returns:
        A sentence naming the GEMM and the dim, or None. NVFP4's 16x16 weight tiles need K and N
        multiples of 16, which the grad_input and output GEMMs already need.
    """
    if fmt not in FORMATS:
        raise ValueError(f"block format {fmt!r} is not one of {', '.join(map(repr, FORMATS))}")
    block = FORMATS[fmt]
    for gemm, name, size in (("output", "K", k), ("grad_input", "N", n),
                             ("grad_weight", "M", m)):
        if size % block:
            return (f"the {gemm} GEMM reduces over {name}={size}, not a multiple of {fmt}'s "
                    f"block of {block}")
    if hardware and fmt == "nvfp4" and any(size % 128 for size in (m, k, n)):
        return (f"torchao's NVFP4 training kernels need M, K and N multiples of 128, not "
                f"M={m}, K={k}, N={n}")
    return None
