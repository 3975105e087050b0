"""The precision planner (docs/planner.md): what it measures, the cost model's formulas, the
choices on a GPT-2 and on a model with a planted outlier layer (target h100), the plan applied
through fxamp.compile, its JSON and its refusals."""

import dataclasses
import json
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fxamp
from fxamp.errors import ConfigError
from fxamp.float8.config import recipe_refusal
from fxamp.float8.gemm import Float8MM
from fxamp.planner import GemmShape, PlannedGemm, PrecisionPlan, Target
from fxamp.planner.choose import _per_module, _planned
from fxamp.planner.cost import TARGETS, cast_time, gemm_time
from fxamp.planner.candidates import candidate_errors, relative_error
from fxamp.planner.measure import GemmMeasure, measure
from fxamp.planner.report import duration
from fxamp.provenance import OpSite
from planner_models import (Hostile, folded_norm_mlp, gpt2, lm_loss, offset_batch,
                            offset_regression, outlier_mlp, regression_batches, token_batch)

TOY = Target("toy", 1, 2, 2, 4, 1e9)  # compute-bound everywhere: float8 always pays
# torch 2.11 runs only tensor-scaled float8 GEMMs on CPU (2.13 and 2.14 row-scaled ones too):
# there rowwise is not measured and plans are tensorwise; elsewhere the tie between equally
# fast recipes goes to the more accurate, rowwise (Note [A recipe this device cannot run is
# not measured]).
ROWWISE = recipe_refusal("rowwise", "cpu", torch.bfloat16) is None
RECIPE = "rowwise" if ROWWISE else "tensorwise"


# ------------------------------------------------------------------------------ measuring
def test_candidate_errors_match_a_float64_reference():
    torch.manual_seed(0)
    a, b, g = torch.randn(32, 64), torch.randn(64, 48) / 8, torch.randn(32, 48)
    errors, max_abs = candidate_errors(a, b, g, grad_input=True, grad_weight=True,
                                       dtype=torch.bfloat16, recipes=("tensorwise",))
    assert sorted(errors) == ["bf16", "fp16", "tensorwise"]  # the recipes asked for only
    ref = {"output": a.double() @ b.double(), "grad_input": g.double() @ b.double().T,
           "grad_weight": a.double().T @ g.double()}
    q = lambda t: t.bfloat16().double()
    bf16 = {"output": q(q(a) @ q(b)), "grad_input": q(q(g) @ q(b).T),
            "grad_weight": q(q(a).T @ q(g))}
    for k in ref:  # the fp32 reference is within 1e-6 of float64: errors agree to 1e-4
        direct = float((bf16[k] - ref[k]).norm() / ref[k].norm())
        assert errors["bf16"][k] == pytest.approx(direct, rel=1e-3, abs=1e-6)
        assert 1e-4 < errors["bf16"][k] < 2 ** -7  # one bf16 rounding of each operand
    a16, b16 = a.bfloat16().requires_grad_(), b.bfloat16().requires_grad_()
    out = Float8MM.apply(a16, b16, "tensorwise")
    out.backward(g.bfloat16())
    assert errors["tensorwise"]["output"] == pytest.approx(
        float((out.detach().double() - ref["output"]).norm() / ref["output"].norm()), rel=1e-3)
    assert errors["tensorwise"]["grad_weight"] == pytest.approx(
        float((b16.grad.double() - ref["grad_weight"]).norm() / ref["grad_weight"].norm()),
        rel=1e-3)
    assert max_abs["input"] == float(a.abs().max())


def test_exact_operands_have_no_error_and_overflow_is_inf():
    a = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).repeat(8, 8)
    errors, _ = candidate_errors(a, a.T.contiguous(), None, grad_input=False,
                                 grad_weight=False, dtype=torch.bfloat16)
    assert errors["bf16"]["output"] == 0.0 and errors["fp16"]["output"] == 0.0
    assert relative_error(torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 1.0])) == math.inf


def test_candidate_errors_of_the_whole_op_match_a_float64_reference():
    # addmm: beta * c + alpha * (a @ b), c cancelling most of the product
    torch.manual_seed(0)
    a, b = 50 + torch.randn(32, 64), torch.randn(64, 48) / 8
    alpha, beta = 2.0, 0.5
    c = -(alpha / beta) * (a.mean(0) @ b)
    errors, max_abs = candidate_errors(a, b, None, c=c, alpha=alpha, beta=beta,
                                       grad_input=False, grad_weight=False,
                                       dtype=torch.bfloat16)
    ref = beta * c.double() + alpha * (a.double() @ b.double())
    q = lambda t: t.bfloat16().double()
    bf16 = q(beta * q(c) + alpha * (q(a) @ q(b)))
    assert errors["bf16"]["output"] == pytest.approx(
        float((bf16 - ref).norm() / ref.norm()), rel=1e-3)
    assert errors["bf16"]["output"] > 0.1  # the product alone: 0.003
    assert max_abs["bias"] == pytest.approx(float(c.abs().max()))
    # beta = 0 ignores c, its inf included, as addmm does
    ignored, _ = candidate_errors(a, b, None, c=torch.full((48,), math.inf), beta=0,
                                  grad_input=False, grad_weight=False, dtype=torch.bfloat16)
    assert ignored["bf16"]["output"] < 2 ** -7


@pytest.fixture(scope="module")
def hostile():
    x, mean = offset_batch()
    model = Hostile(mean)
    batch = (x, torch.zeros(model(x).numel()))
    return model, batch


def test_each_gemm_is_measured_as_the_op_runs_in_bf16(hostile):
    # the bias / c that cancels the product, alpha and beta, broadcast batch dims and a 1-D
    # operand: the measured bf16 error of each output is the real bf16 op's (autocast's)
    model, batch = hostile
    measures, _ = measure(model, [batch], F.mse_loss, dtype=torch.bfloat16, device_type="cpu",
                          recipes=())
    measured = {m.site.module: m.errors["bf16"]["output"] for m in measures}
    assert sorted(measured) == sorted(name for name, _ in model.named_children())
    for name, module in model.named_children():
        with torch.no_grad():
            ref = module(batch[0])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                real = relative_error(module(batch[0]), ref)
        assert measured[name] == pytest.approx(real, rel=0.05), name


def test_a_gemm_whose_bias_cancels_its_product_is_planned_in_fp32(hostile):
    model, batch = hostile
    plan = fxamp.plan(model, batch, F.mse_loss, target=TOY)
    sites = _by_module(plan)
    for cancelling in ("folded", "addmm", "baddbmm"):
        assert sites[cancelling].precision == "fp32", sites[cancelling].reason
        assert sites[cancelling].reason.startswith("fp32: the bf16 error of its output, ")
        assert sites[cancelling].error("bf16") > 0.3
    for plain in ("ignored", "broadcast", "matvec"):
        assert sites[plain].precision != "fp32" and sites[plain].error("bf16") < 0.01
    assert sites["broadcast"].reason == (
        "bf16: float8 cannot run it (matmul with broadcast batch dims [2, 1] and [3]); the "
        f"bf16 error is {sites['broadcast'].error('bf16'):.3g}.")
    assert plan.module_overrides() == {m: "fp32" for m in ("addmm", "baddbmm", "folded")}


# ------------------------------------------------------------------------------ the cost model
def test_cost_model_is_the_documented_roofline():
    h100 = TARGETS["h100"]
    s = GemmShape(4096, 4096, 4096)
    flops = 2 * 4096 ** 3
    # three compute-bound GEMMs: 3 * 2MKN / peak
    assert gemm_time(s, "bf16", h100) == pytest.approx(3 * flops / 989.4e12)
    # float8: half the GEMM time plus casts: 5 bytes an element, each tensor cast twice
    casts = 5 * 2 * 3 * 4096 ** 2 / 3350e9
    assert cast_time(s, h100) == pytest.approx(casts)
    assert gemm_time(s, "tensorwise", h100) == pytest.approx(3 * flops / 1978.9e12 + casts)
    # a small GEMM is memory-bound: bytes / bandwidth, and float8 loses to its casts
    small = GemmShape(64, 64, 64, grad_input=False)
    assert gemm_time(small, "bf16", h100) == pytest.approx(2 * 2 * 3 * 64 * 64 / 3350e9)
    assert gemm_time(small, "tensorwise", h100) > gemm_time(small, "bf16", h100)


# ------------------------------------------------------------------------------ choices (h100)
@pytest.fixture(scope="module")
def gpt2_plan():
    # d=2048, one layer: GEMMs large enough for float8 to pay on an H100 at the modeled
    # training batch (512 sequences of 32 tokens), measured on 2 sequences
    return fxamp.plan(gpt2(), token_batch(), lm_loss, target="h100", batch_size=512)


def _by_module(plan):
    return {s.module: s for s in plan.sites}


def test_gpt2_plan_puts_the_large_gemms_in_float8_and_keeps_the_small_ones(gpt2_plan):
    assert gpt2_plan.recipe == RECIPE
    sites = _by_module(gpt2_plan)
    for big in ("transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
                "transformer.h.0.attn.c_attn"):
        assert sites[big].precision == gpt2_plan.recipe, sites[big].reason
        assert sites[big].reason.startswith(f"float8 {gpt2_plan.recipe}: ")
        assert sites[big].error(gpt2_plan.recipe) <= 0.1
    for small in ("lm_head", "transformer.h.0.attn.c_proj"):  # 2048 x 512, 2048 x 2048
        assert sites[small].precision == "bf16"
        assert f"bf16: float8 {gpt2_plan.recipe} would take " in sites[small].reason
    attention = [s for s in gpt2_plan.sites if s.module == "transformer.h.0.attn"]
    assert len(attention) == 2 and all(s.precision == "bf16" and "float8 cannot run it ("
                                       "attention-style" in s.reason for s in attention)
    assert gpt2_plan.step_time() < gpt2_plan.step_time("bf16")
    assert gpt2_plan.step_time() < gpt2_plan.step_time(gpt2_plan.recipe)


@pytest.fixture(scope="module")
def outlier_plan():
    # the smallest MLP whose first GEMM pays in float8 on the modeled H100 batch (2048 x 4096;
    # at 1024 x 4096 bf16 wins): its outlier layer is 4096 x 4096, not 8192 x 8192
    return fxamp.plan(outlier_mlp(2048, 4096, 16), (torch.randn(64, 2048), torch.randn(64, 16)),
                      F.mse_loss, target="h100", batch_size=16384)


def test_outlier_layer_stays_bf16_for_its_float8_error(outlier_plan):
    sites = _by_module(outlier_plan)
    assert outlier_plan.recipe == RECIPE and sites["0"].precision == RECIPE, sites["0"].reason
    assert sites["2"].precision == "bf16"
    assert sites["2"].error("tensorwise") > 0.5
    if ROWWISE:
        assert sites["2"].error("rowwise") > 0.5
    else:  # not measured, and each GEMM float8 could run says so
        assert "rowwise" not in dict(sites["2"].errors)
        assert all(f" float8 rowwise was not measured: torch {torch.__version__} cannot run it "
                   "on cpu; torch._scaled_mm refused a row-scaled float8 GEMM (" in s.reason
                   for s in outlier_plan.sites)
    assert sites["2"].reason.startswith(f"bf16: the float8 {outlier_plan.recipe} error of its "
                                        "output, ") and "exceeds the budget 0.1" in \
        sites["2"].reason
    assert sites["2"].max_abs >= 1e6  # its input's planted feature
    assert sites["4"].precision == "bf16" and "would take" in sites["4"].reason
    text = outlier_plan.explain()
    assert "fxamp precision plan | target h100 | error budget 0.1" in text
    assert "float8: 1 of 3 GEMMs" in text


def test_fp16_plan_keeps_the_outlier_layer_in_fp32():
    model = outlier_mlp()
    plan = fxamp.plan(model, regression_batches(1)[0], F.mse_loss, target=TOY, dtype="fp16")
    sites = _by_module(plan)
    assert sites["2"].precision == "fp32" and sites["2"].reason.startswith("fp32: fp16 overflows")
    assert plan.module_overrides() == {"2": "fp32"}
    assert plan.to_config().module_overrides == (("2", "fp32"),)


def _refuse(*recipes):
    # recipe_refusal as on a torch that runs none of `recipes` here (torch 2.11 on CPU: rowwise)
    return lambda recipe, device, dtype: (f"torch._scaled_mm refused {recipe} (its words)"
                                          if recipe in recipes else None)


def test_a_recipe_this_torch_cannot_run_is_not_measured_and_the_plan_says_why():
    # Note [A recipe this device cannot run is not measured]: the plan is one fxamp.compile
    # can apply here, and each GEMM float8 could run says why the other recipe is missing.
    batch = regression_batches(1)[0]
    with mock.patch("fxamp.planner.choose.recipe_refusal", _refuse("rowwise")):
        plan = fxamp.plan(outlier_mlp(), batch, F.mse_loss, target=TOY)
    assert plan.recipe == "tensorwise" and [s.precision for s in plan.sites] == [
        "tensorwise", "bf16", "tensorwise"]
    assert all("rowwise" not in dict(s.errors) for s in plan.sites)
    assert plan.sites[1].reason == (
        "bf16: the float8 tensorwise error of its output, "
        f"{plan.sites[1].error('tensorwise'):.3g}, exceeds the budget 0.1; the bf16 error is "
        f"{plan.sites[1].error('bf16'):.3g}. float8 rowwise was not measured: torch "
        f"{torch.__version__} cannot run it on cpu; torch._scaled_mm refused rowwise (its "
        "words).")
    fxamp.compile(outlier_mlp(), plan=plan, compiler="aot_eager")(batch[0])
    # none of the recipes asked for: float8 cannot run any GEMM, and each says why
    with mock.patch("fxamp.planner.choose.recipe_refusal", _refuse("rowwise")):
        plan = fxamp.plan(outlier_mlp(), batch, F.mse_loss, target=TOY, recipes="rowwise")
    assert plan.recipe is None and plan.to_config().float8 is None
    assert [s.precision for s in plan.sites] == ["bf16"] * 3
    assert plan.sites[0].reason == (
        f"bf16: float8 cannot run it (torch {torch.__version__} cannot run float8 rowwise on "
        "cpu; torch._scaled_mm refused rowwise (its words)); the bf16 error is "
        f"{plan.sites[0].error('bf16'):.3g}.")
    assert PrecisionPlan.from_json(plan.to_json()) == plan


# ------------------------------------------------------------------------------ applying
def _train(model, batches, lr=3e-3, **kw):
    fxamp.compile(model, compiler="aot_eager", **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


def test_planned_training_lands_within_half_percent_of_bf16_where_all_float8_does_not():
    # The toy target makes float8 pay for every GEMM, so only the measured errors decide:
    # the outlier layer stays bf16, the two others run in float8.
    batches = regression_batches(60)
    plan = fxamp.plan(outlier_mlp(), batches[0], F.mse_loss, target=TOY)
    assert [s.precision for s in plan.sites] == [plan.recipe, "bf16", plan.recipe]
    bf16 = _train(outlier_mlp(), batches, opt_level="O1")
    planned = _train(outlier_mlp(), batches, plan=plan)
    all_float8 = _train(outlier_mlp(), batches, opt_level="O1", float8="tensorwise")
    assert abs(planned - bf16) <= 0.005 * bf16, (planned, bf16)
    assert all_float8 > 1.2 * bf16, (all_float8, bf16)


def test_planned_training_with_a_cancelling_bias_lands_on_fp32():
    # The frozen first layer's bias cancels its product: bf16 loses the centred signal (its
    # error about 0.4), so the plan keeps that layer in fp32 and trains as fp32 does.
    batches, mean = offset_regression(60)
    plan = fxamp.plan(folded_norm_mlp(mean), batches[0], F.mse_loss, target=TOY)
    assert plan.modules("fp32") == ["0"], plan.explain()
    fp32 = _train(folded_norm_mlp(mean), batches, lr=1e-2, opt_level="O0")
    bf16 = _train(folded_norm_mlp(mean), batches, lr=1e-2, opt_level="O1")
    planned = _train(folded_norm_mlp(mean), batches, lr=1e-2, plan=plan)
    assert abs(planned - fp32) <= 0.01 * fp32, (planned, fp32)
    assert bf16 > 1.05 * fp32, (bf16, fp32)


def test_compile_with_a_plan_shows_its_reasons_in_explain():
    batch = regression_batches(1)[0]
    plan = fxamp.plan(outlier_mlp(), batch, F.mse_loss, target=TOY)
    model = fxamp.compile(outlier_mlp(), plan=plan, compiler="aot_eager")
    config = fxamp.config_of(model)
    assert config.float8.recipe == plan.recipe and config.float8.skip_modules == ("2",)
    report = fxamp.explain(model, batch[0])
    gemms = {g.module: g for g in report.gemms}
    assert gemms["0"].float8 and f"plan: float8 {plan.recipe}: " in gemms["0"].reason
    assert not gemms["2"].float8 and "skip_modules '2'; stays bf16; plan: bf16: the float8 " \
        f"{plan.recipe} error of its output, " in gemms["2"].reason
    rows = [r for r in report.rows if r.module == "2" and r.op.startswith("linear")]
    assert rows and "plan: bf16: the float8" in rows[0].reason


# ------------------------------------------------------------------------------ JSON, refusals
def test_json_round_trip(tmp_path):
    plan = fxamp.plan(outlier_mlp(), regression_batches(1)[0], F.mse_loss, target=TOY)
    assert PrecisionPlan.from_json(plan.to_json()) == plan
    path = str(tmp_path / "plan.json")
    plan.to_json(path)
    loaded = PrecisionPlan.from_json(path)
    assert loaded == plan and loaded.to_config() == plan.to_config()
    with pytest.raises(ConfigError, match=r"not an fxamp plan \(version 1\): the JSON has no "
                                          r"'fxamp_plan': 1 key"):
        PrecisionPlan.from_json('{"sites": []}')
    with pytest.raises(ConfigError, match="malformed fxamp plan JSON"):
        PrecisionPlan.from_json('{"fxamp_plan": 1, "sites": []}')
    edited = plan.to_json().replace('"precision": "bf16"', '"precision": "fp8"')
    with pytest.raises(ConfigError, match=r"plan site '2' \(linear_1\): precision 'fp8' is not "
                                          rf"one of 'fp32', 'bf16', '{RECIPE}'"):
        PrecisionPlan.from_json(edited)


def test_a_promotion_is_a_new_plan_and_a_new_config():
    plan = fxamp.plan(outlier_mlp(), regression_batches(1)[0], F.mse_loss, target=TOY)
    promoted = plan.with_precision("0", "fp32", "promoted by hand")
    assert promoted.to_config().module_overrides == (("0", "fp32"),)
    assert promoted.float8_config().skip_modules == ("0", "2")
    assert dict(promoted.reasons())["0"] == "promoted by hand"
    with pytest.raises(ConfigError, match="module 'head' has no GEMM in this plan"):
        plan.with_precision("head", "fp32", "")


@pytest.mark.parametrize("kwargs, message", [
    (dict(target="a100"), "target='a100' is not one of 'h100', 'h200', 'b200', 'cpu' or a "
                          "fxamp.planner.Target"),
    (dict(error_budget=1.5), "error_budget=1.5 must be a relative error in (0, 1), e.g. 0.1"),
    (dict(error_budget=0), "error_budget=0 must be a relative error in (0, 1)"),
    (dict(error_budget="0.1"), "error_budget='0.1' (str) must be a relative error in (0, 1)"),
    (dict(dtype="fp8"), "dtype='fp8' is not one of 'bf16', 'fp16'"),
    (dict(recipes=("delayed",)), "recipes=('delayed',) must name float8 recipes among "
                                 "'tensorwise', 'rowwise', 'mxfp8', 'nvfp4'"),
    (dict(batch_size=0), "batch_size=0"),
])
def test_bad_arguments_are_refused_by_name_and_leave_the_model_alone(kwargs, message):
    model = outlier_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        fxamp.plan(model, regression_batches(1)[0], F.mse_loss, **kwargs)
    assert message in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_compile_refuses_a_plan_it_cannot_apply_before_changing_the_model():
    plan = fxamp.plan(outlier_mlp(), regression_batches(1)[0], F.mse_loss, target=TOY)
    other = outlier_mlp()
    with pytest.raises(ConfigError, match=r"the plan names modules \['2', '4'\] that "
                                          "Sequential does not have"):
        fxamp.compile(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()), plan=plan)
    with pytest.raises(ConfigError, match="float8= conflicts with plan=: the plan sets float8"):
        fxamp.compile(other, plan=plan, float8="rowwise")
    with pytest.raises(ConfigError, match="fxamp.compile got plan= and config="):
        fxamp.compile(other, plan=plan, config=fxamp.AmpConfig.from_opt_level("O1"))
    with pytest.raises(ConfigError, match="plan= takes a fxamp.plan"):
        fxamp.compile(other, plan="plan.json")
    assert fxamp.backend_of(other) is None
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(),
                                                 outlier_mlp().state_dict().values()))


def test_plan_reasons_are_checked_with_the_config():
    with pytest.raises(ConfigError, match=r"plan_reasons=\(\('0', 1\),\) must be a tuple of "
                                          r"\(module path, reason\) string pairs"):
        fxamp.AmpConfig.from_opt_level("O1", plan_reasons=(("0", 1),))


# ------------------------------------------------------------------------------ strict JSON
def _site(module, precision, errors, max_abs=4.0, **kw):
    fields = dict(phase="forward", graph=0, node="linear", op="aten.linear.default",
                  source_op="aten.linear.default", module=module, module_type="Linear",
                  source_line="model.py:12 in forward: return self.proj(x)",
                  shape=(64, 64, 64), batch=0, grads=("grad_input", "grad_weight"),
                  float8_refusal=None, errors=errors, times=(("fp32", 1.5e-6), ("fp16", 8e-7)),
                  max_abs=max_abs, precision=precision, reason=f"{precision}: why.")
    return PlannedGemm(**{**fields, **kw})


def _small_plan():
    # an fp16 overflow: an inf error and an inf max|x|, which JSON has no number for
    return PrecisionPlan(TARGETS["h100"], 0.1, "fp16", None, (
        _site("a", "fp16", (("bf16", 0.003), ("fp16", 0.0004))),
        _site("b", "fp32", (("bf16", 0.003), ("fp16", math.inf)), max_abs=math.inf,
              shape=None, float8_refusal="matmul of a 2-D and a 1-D operand")),
        batches=2, batch_scale=8.0, planning_seconds=1.25)


def _strict(text):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_is_strict_and_round_trips_infinities_exactly():
    plan = _small_plan()
    text = plan.to_json()
    data = _strict(text)  # no Infinity / NaN anywhere
    assert data["sites"][1]["errors"][1] == ["fp16", "inf"] and \
        data["sites"][1]["max_abs"] == "inf"
    assert PrecisionPlan.from_json(text) == plan
    with pytest.raises(ConfigError, match=r"malformed fxamp plan JSON: Infinity is not JSON \(a "
                                          r'non-finite number is written "inf"'):
        PrecisionPlan.from_json(text.replace('"inf"', "Infinity"))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(PrecisionPlan)])
def test_json_without_a_field_is_refused_by_its_name(field):
    data = _strict(_small_plan().to_json())
    del data[field]
    with pytest.raises(ConfigError, match=rf"malformed fxamp plan JSON: field '{field}' is "
                                          r"missing \(write plans with plan.to_json\(\)\)"):
        PrecisionPlan.from_json(json.dumps(data))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["sites"][1].pop("reason"), "field 'sites[1].reason' is missing"),
    (lambda d: d["target"].pop("bandwidth_gbs"), "field 'target.bandwidth_gbs' is missing"),
    (lambda d: d.update(notes="x"), "field 'notes' is not one of PrecisionPlan's"),
    (lambda d: d.update(batches="2"), "batches must be a JSON integer, not '2'"),
    (lambda d: d.update(batches=2.0), "batches must be a JSON integer, not 2.0"),
    (lambda d: d.update(batch_scale="x"), 'batch_scale must be a number (or "inf", "-inf", '
                                          "\"nan\"), not 'x'"),
    (lambda d: d["sites"][0].update(shape=[64, 64]), "sites[0].shape must be an array of 3, "
                                                     "not [64, 64]"),
    (lambda d: d["sites"][0]["errors"][0].__setitem__(1, None), "sites[0].errors[0][1] must "
                                                               "be a number"),
    (lambda d: d.update(sites={}), "sites must be a JSON array, not {}"),
])
def test_json_with_a_wrong_field_is_refused_by_its_path(edit, message):
    data = _strict(_small_plan().to_json())
    edit(data)
    with pytest.raises(ConfigError) as info:
        PrecisionPlan.from_json(json.dumps(data))
    assert message in str(info.value)


# ------------------------------------------------------------------------------ reasons
def test_durations_read_in_their_unit_to_three_digits():
    assert [duration(s) for s in (0, 3.2e-11, 5.24e-8, 8.5e-7, 9.9996e-7, 1.234e-5, 4.567e-3,
                                  2.5)] == \
        ["0 s", "0.032 ns", "52.4 ns", "850 ns", "1 us", "12.3 us", "4.57 ms", "2.5 s"]


def _measured(module, shape=(64, 64, 64), *, low=0.003, f8=0.04, refusal=None, where="output",
              max_abs=10.0, low_name="bf16"):
    site = OpSite("forward", 0, f"mm_{module}", "aten.mm.default", "aten.mm.default", module)
    m = GemmMeasure(site, "Linear", "model.py:3", shape, 0, refusal, True, True)
    m.add({low_name: {where: low, "grad_weight": low / 2},
           **({} if refusal else {"tensorwise": {where: f8, "grad_weight": f8 / 2}})},
          {"output": max_abs})
    return m


def _reasons(measures, low="bf16"):
    sites = [_planned(m, "tensorwise", low, 0.1, TARGETS["h100"], 1.0) for m in measures]
    return [s.reason for s in _per_module(sites, "tensorwise", low)]


def test_reasons_read_as_sentences():
    reasons = _reasons([
        _measured("tiny"),
        _measured("big", (16384, 4096, 4096)),
        _measured("cancel", low=0.441),
        _measured("attention", refusal="attention-style batched GEMM (q @ k^T, attn @ v)"),
        _measured("outlier", (16384, 4096, 4096), f8=0.98),
        _measured("spike", (16384, 4096, 4096), f8=math.inf, where="grad_input"),
    ])
    assert reasons == [
        "bf16: float8 tensorwise would take 51.4 ns a step against 22 ns in bf16 (its casts "
        "alone take 36.7 ns); its error 0.04 is within the budget 0.1.",
        "float8 tensorwise: 1.28 ms a step against 1.67 ms in bf16 (1.30x faster, casts "
        "included); its error 0.04 is within the budget 0.1.",
        "fp32: the bf16 error of its output, 0.441, exceeds the budget 0.1.",
        "bf16: float8 cannot run it (attention-style batched GEMM (q @ k^T, attn @ v)); the "
        "bf16 error is 0.003.",
        "bf16: the float8 tensorwise error of its output, 0.98, exceeds the budget 0.1; the "
        "bf16 error is 0.003.",
        "bf16: the float8 tensorwise error of its grad_input, inf (an overflow), exceeds the "
        "budget 0.1; the bf16 error is 0.003.",
    ]


def test_reasons_of_the_per_module_rules_and_the_overflows_read_as_sentences():
    from fxamp.planner.plan import ROOT
    reasons = _reasons([
        _measured("block", low=math.inf, max_abs=1.5e6, low_name="fp16"),
        _measured("block", (16384, 4096, 4096), low_name="fp16", low=0.0004),
        _measured(ROOT, low=0.5, low_name="fp16"),
        _measured("mlp", (16384, 4096, 4096), low_name="fp16", low=0.0004),
        _measured("mlp", low_name="fp16", low=0.0004),
    ], low="fp16")
    assert reasons == [
        "fp32: fp16 overflows in its output (its largest |x| is 1.5e+06).",
        "float8 tensorwise: 1.28 ms a step against 1.67 ms in fp16 (1.30x faster, casts "
        "included); its error 0.04 is within the budget 0.1. It runs in fp32 with the rest of "
        "its module: a module override covers all its ops.",
        "fp32: the fp16 error of its output, 0.5, exceeds the budget 0.1. No module override "
        "can reach a GEMM at the top level, so it stays fp16.",
        "float8 tensorwise: 1.28 ms a step against 1.67 ms in fp16 (1.30x faster, casts "
        "included); its error 0.04 is within the budget 0.1. It stays fp16 with another GEMM of "
        "its module: skip_modules is per module.",
        "fp16: float8 tensorwise would take 51.4 ns a step against 22 ns in fp16 (its casts "
        "alone take 36.7 ns); its error 0.04 is within the budget 0.1.",
    ]
