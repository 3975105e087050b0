"""The planner and the block-scaled recipes (docs/planner.md, "Block-scaled recipes"): their
errors measured by the emulated GEMM the float8 pass runs, their cost on the roofline of a
device with their tensor cores (B200), shapes their blocks cannot take refused by name, a plan
that chooses one applied through fxamp.compile."""

import pytest
import torch

import fxamp
from fxamp.errors import ConfigError
from fxamp.float8.block_gemm import BlockScaledMM
from fxamp.planner import GemmShape, Target
from fxamp.planner.candidates import _keep, candidate_errors
from fxamp.planner.cost import TARGETS, cast_time, gemm_time

B200 = TARGETS["b200"]


# ------------------------------------------------------------------------------ cost model
def test_block_recipes_are_timed_only_where_their_tensor_cores_are():
    big = GemmShape(8192, 4096, 4096)
    t = {p: gemm_time(big, p, B200) for p in ("bf16", "tensorwise", "mxfp8", "nvfp4")}
    assert t["nvfp4"] < t["mxfp8"] < t["bf16"]  # compute-bound: the peaks decide
    assert not TARGETS["h100"].supports("mxfp8") and TARGETS["h100"].supports("tensorwise")
    with pytest.raises(ConfigError, match=r"target 'h100' has no nvfp4 tensor cores "
                                          r"\(nvfp4_tflops=None\)"):
        TARGETS["h100"].peak("nvfp4")


def test_block_casts_count_their_scales():
    shape = GemmShape(64, 64, 64)
    per_element = {p: cast_time(shape, B200, p) / cast_time(shape, B200) * 5
                   for p in ("mxfp8", "nvfp4")}
    assert per_element["mxfp8"] == pytest.approx(2 + 1 + 1 / 32)  # read bf16, e4m3 + e8m0/32
    assert per_element["nvfp4"] == pytest.approx(2 + 2 + 0.5 + 1 / 16)  # + the amax pass


def test_a_target_without_block_cores_is_valid_and_bad_peaks_are_refused():
    assert not Target("t", 1, 2, 2, 4, 10).supports("mxfp8")
    with pytest.raises(ConfigError, match="Target mxfp8_tflops"):
        Target("t", 1, 2, 2, 4, 10, mxfp8_tflops=-1.0)


# ------------------------------------------------------------------------------ measuring
def test_block_errors_are_the_emulated_gemms_the_pass_runs():
    torch.manual_seed(0)
    a, b, g = torch.randn(64, 64), torch.randn(64, 32) / 8, torch.randn(64, 32)
    errors, _ = candidate_errors(a, b, g, grad_input=True, grad_weight=True,
                                 dtype=torch.bfloat16, recipes=("mxfp8", "nvfp4"))
    ref = {"output": a.double() @ b.double(), "grad_input": g.double() @ b.double().T,
           "grad_weight": a.double().T @ g.double()}
    for recipe, worst in (("mxfp8", 0.08), ("nvfp4", 0.3)):
        a16, b16 = a.bfloat16().requires_grad_(), b.bfloat16().requires_grad_()
        out = BlockScaledMM.apply(a16, b16, recipe)
        out.backward(g.bfloat16())
        got = {"output": out, "grad_input": a16.grad, "grad_weight": b16.grad}
        for k in ref:
            direct = float((got[k].detach().double() - ref[k]).norm() / ref[k].norm())
            assert errors[recipe][k] == pytest.approx(direct, rel=1e-3)
            assert errors["bf16"][k] < errors[recipe][k] < worst


def test_a_sample_of_a_large_gemm_keeps_whole_blocks_and_the_extremes():
    kept = _keep(5000, 1024, torch.tensor(7), torch.tensor(4999), multiple=32)
    assert len(kept) % 32 == 0 and 992 <= len(kept) <= 1024
    assert {7, 4999} <= set(kept.tolist())
    assert len(_keep(5000, 1024, torch.tensor(7))) == 1024  # no block recipe: as before


# ------------------------------------------------------------------------------ planning
class Wide(torch.nn.Module):
    """A 2048-wide layer (compute-bound at 8192 rows on B200) and a head whose N=48 is not a
    multiple of the blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wide = torch.nn.Linear(2048, 2048)
        self.head = torch.nn.Linear(2048, 48)

    def forward(self, x):
        return self.head(torch.relu(self.wide(x)))


def _plan(**kwargs):
    x = torch.randn(32, 2048, generator=torch.Generator().manual_seed(1))
    return fxamp.plan(Wide(), x, recipes=("mxfp8",), batch_size=8192, **kwargs)


def test_b200_plans_mxfp8_where_it_pays_and_names_the_shape_it_cannot_take():
    plan = _plan(target="b200")
    by_module = {s.module: s for s in plan.sites}
    assert plan.recipe == "mxfp8" and by_module["wide"].precision == "mxfp8"
    assert by_module["wide"].reason.startswith("float8 mxfp8: ")
    head = by_module["head"]
    assert head.precision == "bf16" and head.float8_refusal == (
        "the grad_input GEMM reduces over N=48, not a multiple of mxfp8's block of 32")
    assert "mxfp8" not in dict(head.times)
    config = plan.float8_config()
    assert config.recipe == "mxfp8" and config.skip_modules == ()
    model = fxamp.compile(Wide(), opt_level="O1", plan=plan, compiler="aot_eager")
    model(torch.randn(32, 2048)).sum().backward()
    text = str(fxamp.explain(model, torch.randn(32, 2048)))
    assert "mxfp8: e4m3 in blocks of 32" in text
    assert torch.isfinite(model.wide.weight.grad).all()


def test_a_target_without_block_cores_keeps_the_16_bit_dtype_and_says_why():
    plan = _plan(target="h100")
    wide = next(s for s in plan.sites if s.module == "wide")
    assert plan.recipe is None and wide.precision == "bf16"
    assert "the target h100 has no mxfp8 tensor cores, so float8 mxfp8 is not modeled" in (
        wide.reason)


def test_a_block_plan_survives_json():
    plan = _plan(target="b200")
    again = type(plan).from_json(plan.to_json())
    assert again == plan and again.target.mxfp8_tflops == 4500.0
