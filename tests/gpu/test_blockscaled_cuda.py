"""The block-scaled recipes on a GPU (skipped without CUDA; the GPU report's tests stage runs it).

- Every GPU: `mxfp8` and `nvfp4` run the emulated lowering on CUDA (Note [Block-scaled recipes
  are emulated only]): one Linear's output and both gradients, through aot_eager and Inductor,
  against the same model's on the CPU (same quantized values; the float32 GEMMs' summation
  order differs, so within one bf16 rounding of the largest value), and explain() says the
  GEMMs are emulated on cuda.
- Compute capability 10.0+ only (never lent here yet: H100/H200 are 9.0): torch._scaled_mm's
  block-scaled MXFP8 GEMM on fxamp's quantized operands, their scales swizzled by
  `swizzle_block_scales`, against the emulated GEMM: the building blocks of the hardware
  lowering, checked on the hardware before it is wired into the pass.
"""

import copy

import pytest
import torch

import fxamp
from fxamp.float8.blocks import swizzle_block_scales
from fxamp.float8.blockscaled import BlockFormat, blockscaled_mm
from fxamp.float8.mxfp8 import mx_quantize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_emulated_on_cuda_as_on_the_cpu(recipe, compiler):
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 256)
    x = torch.randn(64, 128)
    results = {}
    for device in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(device)
        fxamp.compile(m, opt_level="O1", dtype=torch.bfloat16, float8=recipe,
                      compiler="aot_eager" if device == "cpu" else compiler)
        xi = x.to(device).requires_grad_()
        out = m(xi)
        out.float().pow(2).mean().backward()
        results[device] = [t.detach().float().cpu() for t in (out, xi.grad, m.weight.grad)]
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        assert torch.isfinite(cuda).all()
        torch.testing.assert_close(cuda, cpu, rtol=0, atol=2**-7 * float(cpu.abs().max()))
    report = fxamp.explain(copy.deepcopy(model).cuda(), x.cuda(), opt_level="O1", float8=recipe)
    assert "emulated on cuda" in str(report)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0),
                    reason="needs compute capability 10.0+ (block-scaled tensor cores)")
def test_scaled_mm_on_swizzled_mxfp8_scales_is_the_emulated_gemm():
    torch.manual_seed(0)
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)  # [N, K]: b = w.t()
    qa, qw = mx_quantize(a, dim=-1), mx_quantize(w, dim=-1)
    out = torch._scaled_mm(qa.data, qw.data.t(), swizzle_block_scales(qa.scale),
                           swizzle_block_scales(qw.scale), out_dtype=torch.bfloat16)
    fmt = BlockFormat("mxfp8")
    ref = blockscaled_mm(a, w.t(), a_format=fmt, b_format=fmt, out_dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0,
                               atol=2**-7 * float(ref.float().abs().max()))
