"""Float8 scales (torchao's numerics): amax -> scale, the saturating cast, delayed scales."""

from __future__ import annotations

import torch

__all__ = ["EPS", "amax_to_scale", "cast_to_float8", "delayed_scale"]

EPS = 1e-12  # torchao's floor on amax: an all-zero tensor gets a finite scale


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """finfo(dtype).max / amax in float64 (eager and compiled agree), as float32."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def cast_to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale saturated to the float8 range (no inf from a stale or rounded scale)."""
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype)


def delayed_scale(x: torch.Tensor, history: torch.Tensor, dtype: torch.dtype,
                  update: bool = True) -> torch.Tensor:
    """finfo.max / (the history's largest amax, or x's own before anything was seen); with
    `update`, pushes x's amax into the history in place (Note [Delayed scaling lives in the
    model], Note [Eval forwards leave the histories alone]). A 2-D history [len, B] keeps one
    per batch entry of a batched x [B, M, K]: scales [B, 1, 1]."""
    if history.dim() == 1:
        amax = torch.max(torch.abs(x)).to(torch.float32)
        seen = history.max()
    else:
        amax = x.abs().amax(dim=(-2, -1)).to(torch.float32)
        seen = history.amax(dim=0)
    scale = amax_to_scale(torch.where(seen > 0, seen, amax), dtype, False)
    if update:
        history.copy_(torch.cat([amax.view(1, *amax.shape), history[:-1]]))
    return scale if history.dim() == 1 else scale.view(-1, 1, 1)
