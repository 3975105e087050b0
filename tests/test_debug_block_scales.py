"""The block scales explain(ranges=True) and the viewer report for the block-scaled recipes.

Each row's smallest and largest scale against the scales computed here from the recipe's rules
in float64 (MXFP8: 2**ceil(log2(amax / 448)) per block of 32, torchao's RCEIL; NVFP4: the
per-tensor scale amax / (448 * 6) times the e4m3 block scale amax_block / 6 over it), planted
floor and zero blocks counted exactly, the gradient's blocks along N, batched GEMMs, and what
the text and the viewer show. The graphs run with aot_eager's numerics (nothing is compiled by
Inductor: the rows are of values, not of generated code).
"""

import math

import pytest
import torch

import fxamp

F8 = lambda recipe: fxamp.Float8Config(recipe=recipe, min_dim=1)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def _rows(report, node, operand):
    return [r for r in report.ranges.block_scales if r.node == node and r.operand == operand]


def _mx_scales(x: torch.Tensor) -> torch.Tensor:
    amax = x.double().reshape(-1, 32).abs().amax(dim=-1)
    amax = amax[amax > 0]
    return torch.exp2(torch.ceil(torch.log2(amax / 448)))


def _nvfp4_scales(x: torch.Tensor) -> torch.Tensor:
    blocks = x.float().reshape(-1, 16).abs().amax(dim=-1)
    tensor = x.float().abs().max()
    block = (blocks / 6 * (448 * 6 / tensor)).clamp(2**-6, 448).to(torch.float8_e4m3fn).float()
    return (tensor / (448 * 6)) * block[blocks > 0]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_each_operands_scales_are_the_recipes(recipe):
    model, x = _mlp(), torch.randn(32, 64)
    x[:, :32] *= 1e-3  # half of every row's blocks much smaller than the others
    report = fxamp.explain(model, x, opt_level="O1", float8=F8(recipe), ranges=True,
                           backward=True)
    want = _mx_scales if recipe == "mxfp8" else _nvfp4_scales
    (row,) = _rows(report, "float8_linear", "input")
    ref = want(x.to(torch.bfloat16))  # O1 casts the input to bf16 before the GEMM
    assert row.blocks == x.numel() // (32 if recipe == "mxfp8" else 16)
    assert row.min_scale == pytest.approx(float(ref.min()), rel=1e-6)
    assert row.max_scale == pytest.approx(float(ref.max()), rel=1e-6)
    assert row.at_floor == row.zero == 0
    # the weight along K (NVFP4: one scale per 16x16 tile), the gradient along N
    (weight,) = _rows(report, "float8_linear", "weight")
    w = model[0].weight.detach().to(torch.bfloat16)
    if recipe == "mxfp8":
        ref = want(w)  # weight [N, K]: its rows are blocks along K
        assert (weight.min_scale, weight.max_scale) == pytest.approx(
            (float(ref.min()), float(ref.max())), rel=1e-6)
    assert weight.blocks == w.numel() // (32 if recipe == "mxfp8" else 16)
    assert [r.node for r in report.ranges.block_scales if r.operand == "grad_output"] == [
        "float8_linear_1", "float8_linear"]  # in the backward's order
    (grad,) = _rows(report, "float8_linear_1", "grad_output")
    assert grad.blocks == 32 * 64 // (32 if recipe == "mxfp8" else 16)
    assert 0 < grad.min_scale <= grad.max_scale < math.inf


def test_floor_and_zero_blocks_are_counted():
    # NVFP4's block scale floor is e4m3's 2**-6 times the per-tensor scale: a block 2**-20
    # below the tensor's largest hits it; an all-zero block is counted apart (M = 16: NVFP4's
    # grad_weight GEMM reduces over M in blocks of 16)
    model, x = _mlp(), torch.randn(16, 64)
    x[0, :16] = 2.0**-20
    x[1, 16:32] = 0
    report = fxamp.explain(model, x, opt_level="O1", float8=F8("nvfp4"), ranges=True,
                           backward=False)
    (row,) = _rows(report, "float8_linear", "input")
    assert row.blocks == 64 and row.at_floor == row.zero == 1 / 64
    assert not _rows(report, "float8_linear", "grad_output")  # no backward asked for
    text = str(report)
    assert "block scales (nvfp4;" in text
    assert "0 float8_linear input: 64 blocks, scales " in text
    assert "1.56% at the floor, 1.56% zero" in text


def test_batched_gemms_have_rows_per_operand():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(2, 64, 64) / 8)

        def forward(self, x):
            return torch.bmm(x, self.w)

    x = torch.randn(2, 32, 64)
    report = fxamp.explain(Experts(), x, opt_level="O1", float8=F8("mxfp8"), ranges=True,
                           backward=True)
    rows = {r.operand: r for r in report.ranges.block_scales}
    assert set(rows) == {"input", "weight", "grad_output"}
    # each entry its own GEMM, in blocks of 32 along K: the input [2, 32, 64], the weight
    # [2, 64, 64]; the gradient [2, 32, 64] along N
    assert (rows["input"].blocks, rows["weight"].blocks, rows["grad_output"].blocks) == (
        128, 256, 128)


def test_tensorwise_has_no_block_rows():
    report = fxamp.explain(_mlp(), torch.randn(32, 64), opt_level="O1", float8="tensorwise",
                           ranges=True)
    assert report.ranges.block_scales == () and "block scales" not in str(report)


def test_the_viewer_shows_the_floor_share_and_each_operands_range():
    model, x = _mlp(), torch.randn(16, 64)
    x[0, :16] = 2.0**-20
    report = fxamp.explain(model, x, opt_level="O1", float8=F8("nvfp4"), ranges=True)
    view = report.graph_view()
    overlay = view.overlay("block scales at floor pct")["forward 0"]
    assert overlay["results"] == {"float8_linear": {"value": 1.56},
                                  "float8_linear_1": {"value": 0.0}}
    assert [t["bgColor"] for t in overlay["thresholds"]] == ["#ffffff", "#e31a1c"]
    nodes = {n["id"]: n for n in view.graphs[0]["nodes"]}
    words = {a["key"]: a["value"] for a in nodes["float8_linear"]["attrs"]}
    assert words["block scales at floor pct"].startswith("nvfp4: input: 64 blocks, scales ")
    assert "; weight: 512 blocks, scales " in words["block scales at floor pct"]
    assert "float8 input scale" not in [o["name"] for o in view.overlays]  # tensorwise-style
