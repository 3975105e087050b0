"""The block-scaled recipes' GEMM (`mxfp8`, `nvfp4`): forward and both backward GEMMs, each
operand quantized along its own reduction dim from the high-precision tensor, emulated.

Note [Block-scaled recipes are emulated only]
Every GEMM of `BlockScaledMM` is `blockscaled_mm`'s: each operand fake-quantized (quantized in
blocks along the GEMM's reduction dim, dequantized to float32), a float32 matmul, one rounding
to the output dtype. That is the emulated lowering of float8 (Note [The emulated float8
lowering] in fxamp/float8/emulated.py) with block scales instead of row or tensor ones, and it
is the only lowering written, on every device: on CUDA too, where the float8 recipes lower to
`torch._scaled_mm`, the block-scaled GEMMs run emulated (the same numbers, slower), and
`explain()` says so; the hardware GEMM (block scales swizzled into cuBLAS's 128x4 layout,
`swizzle_block_scales`, compute capability 10.0+) is not wired in.

Operand by operand, for out = a [M, K] @ b [K, N] (b the weight, `w.t()` of a linear):
  output       a along K,   b along K
  grad_input   grad along N, b.t() along N
  grad_weight  a.t() along M, grad along M
A rowwise and a columnwise quantization of one tensor are two quantizations (two sets of
blocks), never the transpose of one. NVFP4 quantizes b in 16x16 tiles (torchao's 2-D weight
blocks, so b and b.t() get the same values) and everything else in blocks of 16, rounding to
nearest. With `Float8Config(nvfp4_rht_signs=...)` the grad_weight GEMM's operands are
Hadamard-rotated first, and with `nvfp4_stochastic_rounding=True` both quantizations of the
output gradient round stochastically (docs/design.md: Note [The Hadamard transform of NVFP4's
grad_weight GEMM], Note [The seed of NVFP4's stochastic rounding]).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fxamp._compat import size_hint, size_rule_holds
from fxamp.float8.blocks import FORMATS
from fxamp.float8.blockscaled import BlockFormat, fake_quantize, linear_refusal
from fxamp.float8.config import Float8Config

__all__ = ["BlockScaledMM", "block_formats", "block_kwargs", "block_mm", "block_reason",
           "block_shape_refusal", "gradient_seeds", "seed_snapshot"]


def block_formats(recipe: str, mx_scale_mode: str = "rceil") -> tuple[BlockFormat, BlockFormat]:
    """The formats of a recipe's operands: (activations and gradients, the weight `b`)."""
    if recipe == "mxfp8":
        fmt = BlockFormat("mxfp8", mode=mx_scale_mode)
        return fmt, fmt
    if recipe == "nvfp4":
        return BlockFormat("nvfp4"), BlockFormat("nvfp4", tiles=True)
    raise ValueError(f"block-scaled recipe {recipe!r} is not one of 'mxfp8', 'nvfp4'")


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def block_mm(a: torch.Tensor, b: torch.Tensor, a_format: BlockFormat, b_format: BlockFormat,
             out_dtype: torch.dtype, *, a_noise: Optional[torch.Tensor] = None,
             b_noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`blockscaled_mm(a, b, ...)` for a [..., M, K] and b [..., K, N] (batched b too): a along
    dim -1, b along dim -2, tiles over the other of the last two dims. A batched GEMM's entries
    are separate GEMMs: each has its own NVFP4 per-tensor scales. `a_noise`, `b_noise`: the
    int64 seeds of a stochastically rounded operand."""
    batch = b.dim() - 2 if a.dim() == b.dim() else 0
    a_dq = fake_quantize(a, a_format, dim=-1, other_dim=-2, batch_dims=batch, noise=a_noise)
    b_dq = fake_quantize(b, b_format, dim=-2, other_dim=-1, batch_dims=batch, noise=b_noise)
    return torch.matmul(a_dq, b_dq).to(out_dtype)


@torch.library.custom_op("fxamp::seed_snapshot", mutates_args=())
def seed_snapshot(counter: torch.Tensor) -> torch.Tensor:
    """A copy of the stochastic-rounding counter, taken before the GEMM advances it. An op of
    its own so that AOTAutograd saves it for the backward instead of recomputing it there from
    the advanced buffer (Note [The seed of NVFP4's stochastic rounding])."""
    return counter.clone()


@seed_snapshot.register_fake
def _(counter: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(counter)


def gradient_seeds(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeds of the output gradient's two quantizations (grad_input's, grad_weight's) of
    the GEMM that drew `key` (Note [The seed of NVFP4's stochastic rounding])."""
    return key * 2, key * 2 + 1


class BlockScaledMM(torch.autograd.Function):
    """a [M, K] @ b [K, N] (or batched, [B, M, K] @ [B, K, N]) with all three GEMMs
    block-scaled (Note [Block-scaled recipes are emulated only]). Saves the high-precision
    operands, as Float8MM does: every backward operand is quantized anew along its own dim."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, recipe: str,
                mx_scale_mode: str = "rceil", rht_signs: Optional[tuple[int, ...]] = None,
                sr_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
        act, weight = block_formats(recipe, mx_scale_mode)
        # Note [The Hadamard transform of NVFP4's grad_weight GEMM]
        rotated = act if rht_signs is None else dataclasses.replace(act, rht_signs=rht_signs)
        grad_formats = act, rotated
        if sr_seed is None:
            ctx.save_for_backward(a, b)
        else:  # Note [The seed of NVFP4's stochastic rounding]: this GEMM's draw, then advance
            key = seed_snapshot(sr_seed)
            sr_seed.add_(1)
            ctx.save_for_backward(a, b, key)
            grad_formats = tuple(dataclasses.replace(f, stochastic=True) for f in grad_formats)
        ctx.formats = act, weight, rotated, grad_formats
        return block_mm(a, b, act, weight, a.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, *key = ctx.saved_tensors
        act, weight, rotated, (grad_for_input, grad_for_weight) = ctx.formats
        seed_input, seed_weight = gradient_seeds(key[0]) if key else (None, None)
        grad_a = block_mm(grad, _t(b), grad_for_input, weight, grad.dtype, a_noise=seed_input)
        grad_b = block_mm(_t(a), grad, rotated, grad_for_weight, grad.dtype, b_noise=seed_weight)
        return grad_a, grad_b, None, None, None, None


def block_shape_refusal(shape: tuple, fmt: str) -> Optional[str]:
    """Why a GEMM of M x K x N (ints or SymInts) cannot train in `fmt`, or None: each of the
    three GEMMs blocks its own reduction dim (`linear_refusal`). A symbolic size is decided,
    and guarded on, first (Note [Float8 GEMMs at symbolic shapes]); the sentence is
    `linear_refusal`'s at the traced sizes."""
    if all(size_rule_holds(d % FORMATS[fmt] == 0) for d in shape):
        return None
    why = linear_refusal(fmt, *(size_hint(d) or 0 for d in shape))
    return why if all(isinstance(d, int) for d in shape) else f"{why} (or data-dependent)"


def block_kwargs(f8: Float8Config) -> dict:
    """The block-scaled settings a rewritten GEMM's call carries, where not the defaults."""
    kwargs = {}
    if f8.spec.block and f8.mx_scale_mode != "rceil":
        kwargs["mx_scale_mode"] = f8.mx_scale_mode
    if f8.nvfp4_rht_signs is not None:
        kwargs["rht_signs"] = f8.nvfp4_rht_signs
    return kwargs  # the stochastic-rounding seed is a buffer: rewrite_gemms adds it


def block_reason(f8: Float8Config, device_type: str = "cpu") -> str:
    """What a block-scaled recipe does to a GEMM on `device_type`, as explain() prints it."""
    if f8.recipe == "mxfp8":
        what = f"e4m3 in blocks of 32, e8m0 scales ({f8.mx_scale_mode})"
    else:
        rounding = ("gradients rounded stochastically" if f8.nvfp4_stochastic_rounding
                    else "round to nearest")
        what = f"e2m1 in blocks of 16 (weight 16x16), e4m3 scales, {rounding}"
        if f8.nvfp4_rht_signs is not None:
            what += ", grad_weight operands Hadamard-rotated"
    where = "" if device_type == "cpu" else (
        f" on {device_type} (fxamp has no block-scaled tensor-core lowering: Note [Block-scaled "
        "recipes are emulated only])")
    return f"{f8.recipe}: {what}, all three GEMMs, emulated{where}"
