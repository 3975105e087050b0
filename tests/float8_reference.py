"""The float8 rounding of torchao's recipes, written by hand for the reference GEMMs of
tests/test_float8.py, tests/test_float8_batched.py and tests/test_float8_dynamic.py (float64
after the rounding)."""

import torch


def dequant(x, dtype, dim, rowwise, pow2, amax=None):
    """x rounded through float8 the recipe's way, back in float64 (written from torchao's
    description): scale = finfo.max / amax over the contraction dim `dim` (rowwise) or the
    whole matrix, rounded down to a power of two when `pow2`, saturated, cast. `amax`: delayed
    scaling's (the largest of a history) instead of x's own."""
    if amax is None:
        amax = x.abs().amax(dim=dim, keepdim=True) if rowwise else x.abs().max()
    scale = (torch.finfo(dtype).max / torch.as_tensor(amax).double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).double() / scale.double()
