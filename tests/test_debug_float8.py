"""The overflow locator on float8 models, every recipe (issue 39): it reads float8 values (which
have no isfinite on CPU) as the numbers they hold, names the float8 GEMM that overflowed by its
op, and its fix keeps that GEMM finite."""

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.float8.config import recipe_refusal


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with torch.no_grad():
        model[0].weight[:4].mul_(1e4)  # the first GEMM's output overflows fp16
    return model


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.skipif(
    recipe_refusal("rowwise", "cpu", torch.float16) is not None,
    reason="this torch's torch._scaled_mm has no row-scaled float8 GEMM on CPU (2.13+ has)")),
    "mxfp8", "nvfp4"])
def test_the_locator_finds_the_float8_gemm_and_its_fix_keeps_it_finite(recipe):
    torch.manual_seed(1)
    model, x = _model(), torch.randn(32, 64) * 100
    kwargs = dict(opt_level="O1", dtype=torch.float16, float8=recipe)
    report = fxamp.locate_overflow(model, x, **kwargs)
    assert report.site.headline == "forward: float8_linear in 0 (Linear), graph 0"
    assert report.site.fix == {"module_overrides": {"0": "fp32"}}
    # the emulated GEMM's float32 product rounded to the output dtype is the op that overflows
    assert report.site.op == "aten._to_copy.default"
    out = report.site.outputs[0]
    assert (out.dtype, out.shape) == ("f16", (32, 64)) and out.nonfinite > 0
    healed = fxamp.locate_overflow(model, x, **kwargs, **report.site.fix)
    assert healed.site.module == "2"  # module 0 is finite now; the next GEMM overflows
