"""What each candidate precision does to one GEMM op: the op recomputed from its fp32 operands
in bf16, fp16 and float8, and its relative errors against fp32 (docs/planner.md, "Measuring";
measure.py finds the ops and captures their operands).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch

from fxamp.float8.blocks import FORMATS
from fxamp.float8.gemm import float8_bmm, float8_matmul

__all__ = ["GemmCall", "candidate_errors", "relative_error", "TENSORS"]

TENSORS = ("output", "grad_input", "grad_weight")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||; inf when x has an inf or NaN (an overflow)."""
    x, ref = x.detach().float(), ref.detach().float()
    diff, base = float((x - ref).norm()), float(ref.norm())
    if math.isnan(diff) or math.isinf(diff):
        return math.inf
    return diff / base if base > 0 else (0.0 if diff == 0 else math.inf)


# Note [The whole op is measured]: a GEMM node computes `beta * c + alpha * (a @ b)`: a
# Linear adds its bias, addmm / baddbmm their input, scaled by alpha and beta (beta = 0 ignores
# c, its inf and NaN included), matmul broadcasts batch dims and takes 1-D operands. Each
# candidate computes all of it, and the error is relative to the op's fp32 result: a bias
# that cancels the product (a folded normalisation, bias = -W @ mean) leaves a small output
# that the rounding of the large product swamps, which the product alone would never show.
# The gradients are those of a and b (a bias's gradient is a sum, not a GEMM).
@dataclasses.dataclass(frozen=True)
class GemmCall:
    """What one GEMM node computed: `beta * c + alpha * (a @ b)`, a [.., M, K] and b
    [.., K, N] (batch dims broadcast as torch.matmul does), c None or broadcast to the
    result, with `shape` the result's shape in that form."""

    a: torch.Tensor
    b: torch.Tensor
    c: Optional[torch.Tensor] = None
    alpha: float = 1
    beta: float = 1

    @property
    def shape(self) -> tuple[int, ...]:
        batch = torch.broadcast_shapes(self.a.shape[:-2], self.b.shape[:-2])
        return (*batch, self.a.shape[-2], self.b.shape[-1])

    def detach(self) -> "GemmCall":
        c = None if self.c is None else self.c.detach()
        return dataclasses.replace(self, a=self.a.detach(), b=self.b.detach(), c=c)


def _whole(call: GemmCall, g: Optional[torch.Tensor], grads: tuple[bool, bool],
           round_: Callable) -> dict:
    """The op, and with `g` the gradients of a and b, in fp32 on operands rounded by
    `round_`, each result rounded."""
    a, b = (round_(t).detach().requires_grad_(g is not None) for t in (call.a, call.b))
    with torch.enable_grad():
        out = torch.matmul(a, b)
        out = out if call.alpha == 1 else call.alpha * out
        if call.c is not None:
            out = out + (round_(call.c) if call.beta == 1 else call.beta * round_(call.c))
    result = {"output": round_(out.detach())}
    if g is not None and any(grads):
        wanted = [t for t, on in zip((a, b), grads) if on]
        got = iter(torch.autograd.grad(out, wanted, round_(g)))
        result.update({name: round_(next(got)) for name, on in
                       zip(("grad_input", "grad_weight"), grads) if on})
    return result


def _float8(call: GemmCall, g: Optional[torch.Tensor], grads: tuple[bool, bool], recipe: str,
            dtype: torch.dtype) -> dict:
    a16, b16 = (t.to(dtype).requires_grad_(g is not None) for t in (call.a, call.b))
    c16 = None if call.c is None else call.c.to(dtype)
    gemm = float8_bmm if a16.dim() == 3 else float8_matmul
    with torch.enable_grad():
        out = gemm(a16, b16, c16, recipe, alpha=call.alpha, beta=call.beta)
    result = {"output": out.detach()}
    if g is not None and any(grads):
        grad_a, grad_b = torch.autograd.grad(out, (a16, b16), g.to(dtype))
        result.update({"grad_input": grad_a} if grads[0] else {})
        result.update({"grad_weight": grad_b} if grads[1] else {})
    return result


# Note [Measuring a sample of a large GEMM]: a GEMM with more than MAX_ROWS rows or MAX_COLS
# output columns is measured on that many of them (evenly spaced), always with the rows and
# columns that hold the largest |input|, |weight| and |gradient|: the output and grad_weight
# entries measured are exact entries of the full GEMM, grad_input sums over the kept columns
# only, and the tensorwise float8 scales are those of the full tensors (their amax is kept).
# Planning a large model then costs a bounded amount per GEMM. With a block-scaled recipe
# asked, the kept rows and columns are whole blocks (a multiple of 32): the grad_input and
# grad_weight GEMMs block them; those blocks are of the sample, not of the full GEMM's
# neighbours (NVFP4's per-tensor scale is the full tensor's: its amax is kept).
MAX_ROWS = MAX_COLS = 1024


def _keep(size: int, limit: int, *extremes: torch.Tensor,
          multiple: int = 1) -> Optional[torch.Tensor]:
    if size <= limit:
        return None
    spaced = torch.linspace(0, size - 1, limit - len(extremes)).long()
    kept = torch.unique(torch.cat([spaced, *(e.reshape(1) for e in extremes)]))
    extra = len(kept) % multiple  # a block-scaled GEMM blocks these rows (columns): whole blocks
    if extra:
        spare = ~torch.isin(kept, torch.stack([e.reshape(()) for e in extremes]))
        drop = spare.nonzero().flatten()[:extra]
        kept = kept[~torch.isin(torch.arange(len(kept)), drop)]
    return kept


def _sample(call: GemmCall, g: Optional[torch.Tensor],
            multiple: int = 1) -> tuple[GemmCall, Any]:
    a, b, c = call.a, call.b, call.c
    if a.dim() != 2 or b.dim() != 2:
        return call, g
    gabs = None if g is None else g.abs()
    rows = _keep(a.shape[0], MAX_ROWS, a.abs().amax(1).argmax(),
                 *(() if gabs is None else (gabs.amax(1).argmax(),)), multiple=multiple)
    cols = _keep(b.shape[1], MAX_COLS, b.abs().amax(0).argmax(),
                 *(() if gabs is None else (gabs.amax(0).argmax(),)), multiple=multiple)
    if rows is not None:
        a, g, c = a[rows], None if g is None else g[rows], None if c is None else c[rows]
    if cols is not None:
        b, g = b[:, cols], None if g is None else g[:, cols]
        c = None if c is None else c[:, cols]
    return dataclasses.replace(call, a=a, b=b, c=c), g


def candidate_errors(a: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor], *,
                     c: Optional[torch.Tensor] = None, alpha: float = 1, beta: float = 1,
                     grad_input: bool, grad_weight: bool, dtype: torch.dtype,
                     recipes: Sequence[str] = ()
                     ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """(errors, max_abs) of the op `beta * c + alpha * (a [.., M, K] @ b [.., K, N])` with
    output gradient `g` (None: forward only), for bf16, fp16 and the float8 `recipes` (those
    float8 can run here: the caller asks `recipe_refusal`; none where float8 cannot run this
    GEMM); the float8 operands are in `dtype`, the 16-bit dtype of the plan (Note [The whole
    op is measured]). Large GEMMs are measured on a sample (Note [Measuring a sample of a
    large GEMM])."""
    c = None if c is None or beta == 0 else c.detach().float()
    call = GemmCall(a.detach().float(), b.detach().float(), None, alpha, beta)
    if c is not None:
        call = dataclasses.replace(call, c=c.expand(call.shape))
    multiple = max((FORMATS[r] for r in recipes if r in FORMATS), default=1)
    call, g = _sample(call, None if g is None else g.detach().float().reshape(call.shape),
                      multiple)
    grads = (grad_input, grad_weight)
    ref = _whole(call, g, grads, lambda t: t)
    errors = {}
    for cand in (*_DTYPES, *recipes):
        if cand in _DTYPES:
            low = _DTYPES[cand]
            got = _whole(call, g, grads, lambda t: t.to(low).float())
        else:
            got = _float8(call, g, grads, cand, dtype)
        errors[cand] = {k: relative_error(v, ref[k]) for k, v in got.items()}
    named = {"input": call.a, "weight": call.b, **({"bias": call.c} if call.c is not None
                                                   else {}),
             **ref, **({"grad_output": g} if g is not None else {})}
    return errors, {k: float(v.abs().max()) if v.numel() else 0.0 for k, v in named.items()}
