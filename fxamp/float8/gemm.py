"""The float8 GEMM: forward and both backward GEMMs in float8, scales in-graph.

The float8 pass replaces a GEMM node of the pre-dispatch ATen graph by `float8_linear` or
`float8_matmul`, which apply the autograd.Function `Float8MM`: AOTAutograd traces its forward and
its two backward GEMMs into the forward and backward graphs (torchao's math, operand for
operand). A batched GEMM is a flattened linear when its right operand has a single batch entry,
otherwise one `_scaled_mm` per batch entry (at most `Float8Config.max_batch`). Each GEMM is
`torch._scaled_mm` on CUDA and the emulated GEMM elsewhere (Note [The emulated float8 lowering]
in fxamp/float8/emulated.py): the same numbers.

Design (docs/design.md): Note [Float8 GEMMs are an autograd.Function in the graph], Note [Batched
float8 GEMMs].
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from fxamp._compat import scaled_mm
from fxamp.float8.block_gemm import BlockScaledMM
from fxamp.float8.config import RECIPES, Recipe
from fxamp.float8.emulated import emulated_scaled_mm, lowering_for
from fxamp.float8.scaling import amax_to_scale, cast_to_float8, delayed_scale

__all__ = ["Float8MM", "float8_bmm", "float8_linear", "float8_matmul", "float8_mm"]


class Scaled(NamedTuple):
    """A float8 operand, its scale (the cast's multiplier) and whether that is per row/column
    (else one per tensor, or per batch entry)."""

    data: torch.Tensor
    scale: torch.Tensor
    rowwise: bool


def _t(x: torch.Tensor) -> torch.Tensor:
    # The last two dims swapped (`.t()` on 2-D, so 2-D GEMMs keep their graphs).
    return x.t() if x.dim() == 2 else x.transpose(-2, -1)


def _operand(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe, left: bool,
             scale: Optional[torch.Tensor] = None, rowwise: Optional[bool] = None) -> Scaled:
    # The scale runs over the contraction dim: per row of a left operand (dim -1), per column
    # of a right one (dim -2); one per tensor for tensorwise, one per batch entry of a batched
    # operand (Note [Batched float8 GEMMs]). A given scale: delayed scaling.
    rowwise = recipe.rowwise if rowwise is None else rowwise
    if scale is None:
        if rowwise:
            amax = x.abs().amax(dim=-1 if left else x.dim() - 2, keepdim=True)
        elif x.dim() == 2:
            amax = torch.max(torch.abs(x))
        else:
            amax = x.abs().amax(dim=(-2, -1), keepdim=True)
        scale = amax_to_scale(amax, dtype, recipe.pow2_scales)
    return Scaled(cast_to_float8(x, scale, dtype), scale, rowwise)


def _row_major(x: torch.Tensor) -> bool:
    return x.stride(0) > x.stride(1) and x.stride(1) == 1


def float8_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) in `out_dtype` for float8 `a` [M, K] and `b` [K, N]."""
    hardware = lowering_for(a.device) == "scaled_mm"
    if hardware:  # _scaled_mm: a row-major, b column-major
        a = a if _row_major(a) else a.contiguous()
        b = b.t().contiguous().t() if _row_major(b) else b
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    if inv_a.dim() != inv_b.dim():
        # one row-scaled operand, one tensor-scaled (rowwise_with_gw_hp's grad_input):
        # _scaled_mm takes both or neither, so the single scale is repeated (torchao's
        # preprocess_addmm)
        inv_a = inv_a if inv_a.dim() == 2 else inv_a.repeat(a.shape[0]).reshape(-1, 1)
        inv_b = inv_b if inv_b.dim() == 2 else inv_b.repeat(b.shape[1]).reshape(1, -1)
    rowwise = inv_a.dim() == 2
    post = None
    if rowwise and not fast_accum:
        # torchao: the rowwise kernel is slow without fast accumulation; use the tensorwise
        # one with unit scales and apply the (power-of-two, so exact) scales afterwards.
        post, inv_a, inv_b = inv_a * inv_b, inv_a.new_ones(()), inv_a.new_ones(())
    mm_dtype = torch.bfloat16 if rowwise and out_dtype != torch.bfloat16 else out_dtype
    if hardware:
        out = scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                        use_fast_accum=fast_accum)
    else:
        out = emulated_scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype)
    if post is not None:
        out = (out * post).to(mm_dtype)
    return out.to(out_dtype)


def _entry(s: Scaled, i: int) -> torch.Tensor:
    return s.scale[i] if s.rowwise else s.scale[i].reshape(())


def _gemm(a: Scaled, b: Scaled, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    if a.data.dim() == 2:
        return float8_mm(a.data, a.scale, b.data, b.scale, out_dtype, fast_accum)
    # Note [Batched float8 GEMMs]: one 2-D _scaled_mm per batch entry, unrolled at trace time.
    return torch.stack([float8_mm(a.data[i], _entry(a, i), b.data[i], _entry(b, i), out_dtype,
                                  fast_accum) for i in range(a.data.shape[0])])


class Float8MM(torch.autograd.Function):
    """a [M, K] @ b [K, N] (or batched: a [B, M, K] @ b [B, K, N]) with all three GEMMs in
    float8 (Note [Float8 GEMMs are an autograd.Function in the graph]), the grad_weight one in
    the operands' dtype for recipes with `grad_weight_hp`. Saves the high-precision operands,
    as torchao does. With amax histories (delayed scaling, tensorwise) a and b are scaled
    from them, in the backward GEMMs too (Note [Delayed scaling lives in the model])."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, recipe: str,
                history_a: Optional[torch.Tensor] = None,
                history_b: Optional[torch.Tensor] = None, update: bool = True) -> torch.Tensor:
        r = RECIPES[recipe]
        scale_a = scale_b = None
        if history_a is not None:
            scale_a = delayed_scale(a, history_a, r.input, update)
            scale_b = delayed_scale(b, history_b, r.weight, update)
        a8, b8 = _operand(a, r.input, r, True, scale_a), _operand(b, r.weight, r, False, scale_b)
        ctx.save_for_backward(a, b, *((a8.scale, b8.scale) if history_a is not None else ()))
        ctx.recipe = r
        return _gemm(a8, b8, a.dtype, r.fast_accum_output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, *delayed = ctx.saved_tensors
        r = ctx.recipe
        scale_a, scale_b = delayed or (None, None)
        g8 = _operand(grad, r.grad_output, r, True)
        # Note [Cast once, then transpose]
        weight_rowwise = r.rowwise and not r.weight_tensorwise_for_grad_input
        bt8 = (_operand(_t(b), r.weight, r, False, scale_b, rowwise=True) if weight_rowwise
               else _transposed(_operand(b, r.weight, r, False, scale_b, rowwise=False)))
        grad_a = _gemm(g8, bt8, grad.dtype, False)
        if r.grad_weight_hp:
            return grad_a, _t(_hp_mm(_t(grad), a)), None, None, None, None
        gt8 = _operand(_t(grad), r.grad_output, r, True) if r.rowwise else _transposed(g8)
        a8 = _operand(a, r.input, r, False, scale_a)
        grad_b = _t(_gemm(gt8, a8, grad.dtype, False))
        return grad_a, grad_b, None, None, None, None


# Note [Cast once, then transpose]
# A tensor-scaled operand has one scale for all its elements, so the float8 cast of its
# transpose is the transpose of its cast, bit for bit. The backward takes the gradient's cast
# for the grad_weight GEMM from the one the grad_input GEMM made, and the weight's cast of the
# grad_input GEMM from the weight as the forward GEMM cast it. It cast `grad.t()` and `b.t()`
# anew: a second amax pass and cast over the gradient, and in the compiled graph a weight cast
# that Inductor could not share with the forward's (AOTAutograd merges identical nodes of the
# joint graph only; the same ops on a transposed view are other nodes). torchao casts the
# untransposed tensor twice and transposes the float8 result, which those passes merge. A
# row-scaled operand is scaled along another axis for each GEMM and is still cast per GEMM.


def _transposed(s: Scaled) -> Scaled:
    # a tensor-scaled operand (scale 0-dim, or one per batch entry [B, 1, 1]) transposed
    return Scaled(_t(s.data), s.scale, s.rowwise)


def _hp_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def _apply(a: torch.Tensor, b: torch.Tensor, recipe: str, history_a: Optional[torch.Tensor],
           history_b: Optional[torch.Tensor], update: bool, mx_scale_mode: str,
           rht_signs: Optional[tuple[int, ...]] = None,
           sr_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    # the block-scaled recipes have their own GEMM (fxamp/float8/block_gemm.py), no histories
    if RECIPES[recipe].block:
        return BlockScaledMM.apply(a, b, recipe, mx_scale_mode, rht_signs, sr_seed)
    return Float8MM.apply(a, b, recipe, history_a, history_b, update)


def float8_matmul(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
                  history_a: Optional[torch.Tensor] = None,
                  history_b: Optional[torch.Tensor] = None, *, alpha: float = 1,
                  beta: float = 1, update_history: bool = True,
                  mx_scale_mode: str = "rceil", rht_signs: Optional[tuple[int, ...]] = None,
                  sr_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`beta * bias + alpha * (a @ b)` for a [..., K] and a 2-D b [K, N], in float8 (mm,
    matmul, addmm). `update_history`: push the amaxes into the histories (delayed scaling;
    Note [Eval forwards leave the histories alone]). `mx_scale_mode`: recipe="mxfp8"'s
    scale rounding (`Float8Config.mx_scale_mode`); `rht_signs`: recipe="nvfp4"'s Hadamard
    transform of the grad_weight GEMM's operands (`Float8Config.nvfp4_rht_signs`); `sr_seed`:
    the model's stochastic-rounding counter, read and advanced (recipe="nvfp4" with
    `Float8Config.nvfp4_stochastic_rounding`)."""
    out = _apply(a.reshape(-1, a.shape[-1]), b, recipe, history_a, history_b, update_history,
                 mx_scale_mode, rht_signs, sr_seed)
    return _epilogue(out.reshape(*a.shape[:-1], out.shape[-1]), bias, alpha, beta)


def _epilogue(out: torch.Tensor, bias: Optional[torch.Tensor], alpha: float,
              beta: float) -> torch.Tensor:
    # aten.addmm / baddbmm: alpha scales the product (in the output dtype, after the GEMM),
    # beta the bias, and beta == 0 ignores the bias (its nan and inf included).
    out = out if alpha == 1 else out * alpha
    if bias is None or beta == 0:
        return out
    return out + (bias.to(out.dtype) if beta == 1 else beta * bias.to(out.dtype))


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  recipe: str, history_x: Optional[torch.Tensor] = None,
                  history_w: Optional[torch.Tensor] = None, *,
                  update_history: bool = True, mx_scale_mode: str = "rceil",
                  rht_signs: Optional[tuple[int, ...]] = None,
                  sr_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in float8: torchao's `Float8Linear.forward`."""
    return float8_matmul(x, weight.t(), bias, recipe, history_x, history_w,
                         update_history=update_history, mx_scale_mode=mx_scale_mode,
                         rht_signs=rht_signs, sr_seed=sr_seed)


def float8_bmm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], recipe: str,
               history_a: Optional[torch.Tensor] = None,
               history_b: Optional[torch.Tensor] = None, *, alpha: float = 1,
               beta: float = 1, update_history: bool = True,
               mx_scale_mode: str = "rceil", rht_signs: Optional[tuple[int, ...]] = None,
               sr_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`beta * bias + alpha * (a @ b)` for batched a [..., M, K] and b [..., K, N] in float8
    (bmm, baddbmm, batched matmul; Note [Batched float8 GEMMs]). A `b` with a single batch
    entry (the source of a broadcast: a linear written as a bmm) is one flattened 2-D GEMM,
    in b's dtype cast to a's; otherwise each batch entry is its own GEMM."""
    k, n = b.shape[-2:]
    if b.shape[:-2].numel() == 1:
        out = _apply(a.reshape(-1, k), b.reshape(k, n).to(a.dtype), recipe, history_a,
                     history_b, update_history, mx_scale_mode, rht_signs, sr_seed)
        out = out.reshape(*a.shape[:-1], n)
    else:
        out = _apply(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, k, n), recipe, history_a,
                     history_b, update_history, mx_scale_mode, rht_signs, sr_seed)
        out = out.reshape(*a.shape[:-1], n)
    return _epilogue(out, bias, alpha, beta)
