"""The emulated float8 GEMM: dequantize, a float32 GEMM, one rounding to the output dtype.

Note [The emulated float8 lowering]
A float8 GEMM's numbers are those of its operands' float8 values: the product of two float8
values is exact in float32 (at most 2 x 4 significant bits, exponents well inside float32's
range), and `torch._scaled_mm` accumulates those products in float32 and rounds once to its
output dtype. So dequantizing each operand to float32 (its float8 value times its inverse
scale), multiplying in float32 and rounding once gives the same numbers, with only the
summation order left to the GEMM library. This is what torch's own CPU `_scaled_mm` does where
it has no float8 kernel (its emulated fallback: bitwise equal, tests/test_float8_lowering.py),
and it is what fxamp runs wherever there are no float8 tensor cores: on the CPU, torch's
`_scaled_mm` takes oneDNN's float8 matmul on CPUs with AVX512-FP16/AMX, which took 5.5 s for
one 64 x 2048 x 8192 GEMM where the float32 GEMM of the dequantized operands takes 0.2 s
(issue 43's measurements), and which a few-GEMM model trained to NaN gradients on such a CPU
only (docs/float8.md, "Known differences"). The quantization itself (amax, scale, the
saturating cast to float8) is the same graph either way: only the GEMM is lowered differently,
and `explain()` shows the float8 casts on every device.
"""

from __future__ import annotations

import torch

__all__ = ["emulated_scaled_mm", "lowering_for"]


def lowering_for(device: torch.device) -> str:
    """"scaled_mm" (torch._scaled_mm on float8 tensor cores) on CUDA, "emulated" elsewhere
    (Note [The emulated float8 lowering])."""
    return "scaled_mm" if device.type == "cuda" else "emulated"


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)` for float8 `a` [M, K]
    and `b` [K, N], as (a * scale_a) @ (b * scale_b) in float32, rounded once to `out_dtype`
    (scales: 0-dim, or [M, 1] and [1, N]; the inverses of the casts' multipliers)."""
    product = torch.mm(a.to(torch.float32) * scale_a, b.to(torch.float32) * scale_b)
    return product.to(out_dtype)
