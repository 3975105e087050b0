"""Private kernels: foreach ops, GradScaler's unscale, float8 GEMMs."""

from __future__ import annotations

from typing import Optional

import torch

# One kernel per list instead of one per tensor. Checked on 2.11.0, 2.13.0, 2.14.1.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_
# GradScaler's own unscale kernel: grads *= inv_scale in place, found_inf (a 1-element float
# tensor) set to 1 if any is inf/nan; tensors on one device. Checked on 2.11.0, 2.13.0, 2.14.1.
unscale_and_check_ = torch._amp_foreach_non_finite_check_and_unscale_


def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
              scale_b: torch.Tensor, out_dtype: torch.dtype,
              use_fast_accum: bool = False) -> torch.Tensor:
    """`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`: a float8 GEMM whose result is
    `(a * scale_a) @ (b * scale_b)` (scales are the inverse of the cast's multipliers), `a`
    row-major and `b` column-major. The same spelling on 2.11.0, 2.13.0, 2.14.1 (public
    `torch.nn.functional.scaled_mm` exists there too, with a different scale vocabulary).
    On CPU: tensor scales on all three; row/column scales only from 2.13 (2.11: "only supports
    per-tensor scaling for CPU backend"), see `scaled_mm_refusal`."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def scaled_mm_refusal(device_type: str, rowwise: bool, out_dtype: torch.dtype) -> Optional[str]:
    """Why `scaled_mm` cannot run on `device_type` with these scales and output dtype (the
    error of a 16x16 probe), or None when it can. Asked once per config, before anything
    changes; the probe is a real call because support depends on the build and the GPU
    (CUDA needs compute capability 8.9+), not on the version alone."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        device = torch.device(device_type)
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        shape_a, shape_b = ((16, 1), (1, 16)) if rowwise else ((), ())
        scaled_mm(a, a.t(), scale_a=torch.ones(shape_a, device=device),
                  scale_b=torch.ones(shape_b, device=device), out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, TypeError, AssertionError) as e:
        return str(e).strip().splitlines()[0][:300]
    return None
