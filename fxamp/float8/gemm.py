"""The float8 GEMM: forward and both backward GEMMs through `torch._scaled_mm`, scales in-graph.

Note [Float8 GEMMs are an autograd.Function in the graph]: the float8 pass replaces a GEMM
node of the pre-dispatch ATen graph (which has no backward yet) by a call to `float8_linear` or
`float8_matmul`, which apply `Float8MM`. AOTAutograd traces that Function like any other op
sequence: its forward (amax, scale, saturating cast, `_scaled_mm`) goes into the forward
graph and its backward (grad_input = grad_out @ b.T and grad_weight = a.T @ grad_out, each in
float8 with its own scales) into the backward graph, all as ATen ops Inductor can fuse (the
amax reductions and casts become Triton/C++ kernels around the float8 GEMM). Rewriting the
joint graph instead would have to recognise the two backward mms that autograd derived from a
forward one; here they are written, not recognised. The math is torchao's
(`torchao.float8.float8_linear.matmul_with_hp_or_float8_args`), operand for operand, so both
give the same bits (tests/test_float8.py compares them).
"""

from __future__ import annotations

from typing import Optional

import torch

from fxamp._compat import scaled_mm
from fxamp.float8.config import RECIPES, Recipe
from fxamp.float8.scaling import amax_to_scale, cast_to_float8, delayed_scale

__all__ = ["Float8MM", "float8_linear", "float8_matmul", "float8_mm"]


def _operand(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe, contract_dim: int,
             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # The scale runs over the contraction dim: per row of a left operand (dim -1), per column
    # of a right one (dim 0); one per tensor for tensorwise. A given scale: delayed scaling.
    if scale is None:
        amax = (x.abs().amax(dim=contract_dim, keepdim=True) if recipe.rowwise
                else torch.max(torch.abs(x)))
        scale = amax_to_scale(amax, dtype, recipe.pow2_scales)
    return cast_to_float8(x, scale, dtype), scale


def _row_major(x: torch.Tensor) -> bool:
    return x.stride(0) > x.stride(1) and x.stride(1) == 1


def float8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) in `out_dtype` for float8 `a` [M, K] and `b` [K, N]."""
    a = a if _row_major(a) else a.contiguous()  # _scaled_mm: a row-major, b column-major
    b = b.t().contiguous().t() if _row_major(b) else b
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    rowwise = inv_a.dim() == 2
    post = None
    if rowwise and not fast_accum:
        # torchao: the rowwise kernel is slow without fast accumulation; use the tensorwise
        # one with unit scales and apply the (power-of-two, so exact) scales afterwards.
        post, inv_a, inv_b = inv_a * inv_b, inv_a.new_ones(()), inv_a.new_ones(())
    mm_dtype = torch.bfloat16 if rowwise and out_dtype != torch.bfloat16 else out_dtype
    out = scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                    use_fast_accum=fast_accum)
    if post is not None:
        out = (out * post).to(mm_dtype)
    return out.to(out_dtype)


class Float8MM(torch.autograd.Function):
    """a [M, K] @ b [K, N] with all three GEMMs in float8 (Note [Float8 GEMMs are an
    autograd.Function in the graph]). Saves the high-precision operands, as torchao does.
    With amax histories (delayed scaling, tensorwise) a and b are scaled from them, in the
    backward GEMMs too (Note [Delayed scaling lives in the model])."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, recipe: str,
                history_a: Optional[torch.Tensor] = None,
                history_b: Optional[torch.Tensor] = None) -> torch.Tensor:
        r = RECIPES[recipe]
        scale_a = scale_b = None
        if history_a is not None:
            scale_a = delayed_scale(a, history_a, r.input)
            scale_b = delayed_scale(b, history_b, r.weight)
        a8, sa = _operand(a, r.input, r, -1, scale_a)
        b8, sb = _operand(b, r.weight, r, 0, scale_b)
        ctx.save_for_backward(a, b, *((sa, sb) if history_a is not None else ()))
        ctx.recipe = r
        return float8_mm(a8, sa, b8, sb, a.dtype, r.fast_accum_output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, *delayed = ctx.saved_tensors
        r = ctx.recipe
        scale_a, scale_b = delayed or (None, None)
        g8, sg = _operand(grad, r.grad_output, r, -1)
        bt8, sbt = _operand(b.t(), r.weight, r, 0, scale_b)
        grad_a = float8_mm(g8, sg, bt8, sbt, grad.dtype, False)
        gt8, sgt = _operand(grad.t(), r.grad_output, r, -1)
        a8, sa = _operand(a, r.input, r, 0, scale_a)
        grad_b = float8_mm(gt8, sgt, a8, sa, grad.dtype, False).t()
        return grad_a, grad_b, None, None, None


def float8_matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
                  history_a: Optional[torch.Tensor] = None,
                  history_b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`a @ b (+ bias)` for a [..., K] and a 2-D b [K, N], in float8 (mm, matmul, addmm)."""
    out = Float8MM.apply(a.reshape(-1, a.shape[-1]), b, recipe, history_a, history_b)
    out = out.reshape(*a.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias.to(out.dtype)


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  recipe: str, history_x: Optional[torch.Tensor] = None,
                  history_w: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in float8: torchao's `Float8Linear.forward`."""
    return float8_matmul(x, weight.t(), bias, recipe, history_x, history_w)
