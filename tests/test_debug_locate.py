"""The overflow locator: planted overflows in known ops, forward and backward, are named with
their module path; clean steps report none; the debug tools leave the plain graph unchanged.

fp16 on the CPU (the CPU default is bf16, whose range is fp32's): only fp16 overflows at
the magnitudes a tiny model reaches.
"""

import pytest

expecttest = pytest.importorskip("expecttest")  # golden graphs: not on the GPU machines

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._functorch.aot_autograd import make_boxed_func

import fxamp
from examples import models
from fxamp.debug import OverflowLocator, locate_overflow
from fxamp.testing import format_graph

FP16 = dict(dtype=torch.float16)


def _mlp(fc1=1.0, fc2=1.0):
    model, (x,) = models.mlp()
    with torch.no_grad():
        model.fc1.weight.mul_(fc1)
        model.fc2.weight.mul_(fc2)
    return model, x


def test_clean_step_reports_none():
    model, x = _mlp()
    report = locate_overflow(model, x, **FP16)
    assert not report.found and report.site is None and report.nonfinite_inputs == ()
    assert report.values_checked["forward"] > 0 and report.values_checked["backward"] > 0
    assert "no op produced an inf or NaN" in str(report)


def test_forward_overflow_names_the_op_and_module():
    model, x = _mlp(fc1=1e5)
    report = locate_overflow(model, x, **FP16)
    site = report.site
    assert (site.phase, site.op, site.source_op, site.module, site.module_type) == (
        "forward", "aten.addmm.default", "aten.linear.default", "fc1", "Linear")
    assert "models.py" in site.source_line and "self.fc1(x)" in site.source_line
    assert site.policy.startswith("lower")
    assert all(s.nonfinite == 0 for s in site.inputs)
    assert site.outputs[0].dtype == "f16" and site.outputs[0].nonfinite > 0
    assert site.fix == {"module_overrides": {"fc1": "fp32"}}
    assert report.values_checked["backward"] == 0  # no backward after a forward overflow
    text = str(report)
    assert "forward: aten.linear.default in fc1 (Linear), graph 0" in text
    assert "module_overrides={'fc1': 'fp32'}" in text
    assert model.fc1.weight.dtype == torch.float32 and model.fc1.weight.grad is None


def test_backward_overflow_names_the_forward_op_it_differentiates():
    model, x = _mlp(fc2=300.0)
    assert not locate_overflow(model, x, loss_scale=1.0, **FP16).found
    report = locate_overflow(model, x, loss_scale=1000.0, **FP16)
    site = report.site
    assert (site.phase, site.op, site.source_op, site.module) == (
        "backward", "aten.mm.default", "aten.linear.default", "fc2")
    assert "backward: backward of aten.linear.default in fc2 (Linear)" in str(report)
    assert "loss scale 1000" in site.suggestion


def test_nested_module_path_in_a_transformer_block():
    model, (x,) = models.attention()
    with torch.no_grad():
        model.mlp[2].weight.mul_(1e5)
    site = locate_overflow(model, x, **FP16).site
    assert (site.phase, site.module, site.source_op) == ("forward", "mlp.2",
                                                         "aten.linear.default")


class _Normalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.ln(self.fc1(x)))


def test_the_suggested_fix_keeps_the_step_finite():
    torch.manual_seed(0)
    model, x = _Normalised(), torch.randn(8, 16)
    with torch.no_grad():
        model.fc1.weight.mul_(1e5)
    site = locate_overflow(model, x, **FP16).site
    assert site.module == "fc1"
    fixed = locate_overflow(model, x, **FP16, **site.fix)
    assert not fixed.found, str(fixed)


def test_a_top_level_op_in_a_function_gets_an_op_override():
    a, b = torch.full((4, 8), 300.0), torch.full((8, 4), 300.0)
    site = locate_overflow(lambda a, b: (a @ b).relu(), (a, b), **FP16).site
    assert (site.phase, site.source_op, site.module) == ("forward", "aten.matmul.default", "")
    assert site.fix == {"op_overrides": {"aten.matmul": "fp32"}}
    assert not locate_overflow(lambda a, b: (a @ b).relu(), (a, b), **FP16, **site.fix).found


def test_loss_fn_overflow_is_reported_as_the_loss():
    model, x = _mlp()
    report = locate_overflow(model, (x, 1e6), lambda out, k: (out.half() * k).sum(), **FP16)
    assert (report.site.phase, report.site.op) == ("loss", "aten.mul.Tensor")
    assert "loss_fn" in report.site.suggestion


def test_scaled_loss_gradient_overflowing_at_the_output():
    # O1's fp32 output (Note [O1's outputs are fp32]): the scaled gradient overflows where the
    # output's cast sends it back to f16; with a f16 output it overflows entering the graph
    model, x = _mlp()
    site = locate_overflow(model, x, loss_scale=1e5, **FP16).site
    assert (site.phase, site.source_op, site.fix) == ("backward", "aten.to.dtype", {})
    assert "lower the loss scale" in site.suggestion
    site = locate_overflow(model, x, loss_scale=1e5, cast_model_outputs=torch.float16,
                           **FP16).site
    assert (site.phase, site.op, site.fix) == ("backward", "tangent", {})
    assert "lower the loss scale" in site.suggestion


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.fc(x) @ x.transpose(-1, -2)
        mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).triu(1)
        return F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)


def test_a_minus_inf_mask_is_not_an_overflow():
    torch.manual_seed(0)
    assert not locate_overflow(_Masked(), torch.randn(2, 4, 8), **FP16).found


def test_a_non_finite_parameter_is_listed_not_blamed_on_an_op():
    model, x = _mlp()
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    report = locate_overflow(model, x, **FP16)
    assert not report.found and report.nonfinite_inputs == ("fc2_weight (graph 0)",)


def test_a_compiled_model_is_checked_with_its_own_config_and_left_alone():
    model, x = _mlp(fc1=1e5)
    fxamp.compile(model, opt_level="O2", compiler="aot_eager", **FP16)
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}
    report = locate_overflow(model, x)
    assert report.config.opt_level == "O2" and report.site.module == "fc1"
    for name, value in model.state_dict(keep_vars=True).items():
        assert torch.equal(value, before[name])
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(fxamp.ConfigError, match="prepared by fxamp.compile with O2"):
        locate_overflow(model, x, opt_level="O1")


def test_debug_mode_through_compile_checks_a_training_loop():
    model, x = _mlp(fc1=1e5)
    locator = OverflowLocator()
    fxamp.compile(model, compiler=locator, **FP16)
    model(x).float().sum().backward()
    site = locator.report(fxamp.config_of(model)).site
    assert (site.phase, site.module) == ("forward", "fc1")
    locator.reset()
    assert not locator.report(fxamp.config_of(model)).found


class _Recorder:
    """compiler="aot_eager", recording the forward and backward graphs it runs."""

    def __init__(self):
        self.graphs = []

    def _keep(self, gm, _):
        self.graphs.append(format_graph(gm, marks=False))
        return make_boxed_func(gm.forward)

    def __call__(self, gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=self._keep, bw_compiler=self._keep)


# Note: dynamic=False because Dynamo's automatic-dynamic memory is keyed by (file, line, name)
# of the code, which every model compiled in this process shares: after another test ran a
# model on a different batch size, shapes would be symbolic.
def _plain_graphs():
    model, x = _mlp()
    recorder = _Recorder()
    fxamp.compile(model, compiler=recorder, dynamic=False, **FP16)
    model(x).float().sum().backward()
    return recorder.graphs


class TestDebugOffIsThePlainGraph(expecttest.TestCase):
    def test_graphs_identical_with_and_without_the_debug_tools(self):
        plain = _plain_graphs()
        self.assertExpectedInline(plain[0], """\
primals_1: f32[32,16]
primals_2: f32[32]
primals_3: f32[8,16]
primals_4: f32[4,32]
primals_5: f32[4]
_to_copy: f16[8,16] = _to_copy(primals_3, dtype=f16)
_to_copy_1: f16[32,16] = _to_copy(primals_1, dtype=f16)
_to_copy_2: f16[32] = _to_copy(primals_2, dtype=f16)
_to_copy_3: f16[4,32] = _to_copy(primals_4, dtype=f16)
_to_copy_4: f16[4] = _to_copy(primals_5, dtype=f16)
t: f16[16,32] = t(_to_copy_1)
addmm: f16[8,32] = addmm(_to_copy_2, _to_copy, t)
relu: f16[8,32] = relu(addmm)
t_1: f16[32,4] = t(_to_copy_3)
addmm_1: f16[8,4] = addmm(_to_copy_4, relu, t_1)
_to_copy_5: f32[8,4] = _to_copy(addmm_1, dtype=f32)
t_2: f16[4,32] = t(t_1)
return [_to_copy_5, _to_copy, relu, t_2]""")
        self.assertExpectedInline(plain[1], """\
_to_copy: f16[8,16]
relu: f16[8,32]
t_2: f16[4,32]
tangents_1: f32[8,4]
_to_copy_6: f16[8,4] = _to_copy(tangents_1, dtype=f16, layout=torch.strided, device=device(type='cpu'))
mm: f16[8,32] = mm(_to_copy_6, t_2)
t_3: f16[4,8] = t(_to_copy_6)
mm_1: f16[4,32] = mm(t_3, relu)
t_4: f16[32,4] = t(mm_1)
sum_1: f16[1,4] = sum.dim_IntList(_to_copy_6, [0], True)
view: f16[4] = view(sum_1, [4])
t_5: f16[4,32] = t(t_4)
detach: f16[8,32] = detach(relu)
detach_1: f16[8,32] = detach(detach)
threshold_backward: f16[8,32] = threshold_backward(mm, detach_1, 0)
t_6: f16[32,8] = t(threshold_backward)
mm_2: f16[32,16] = mm(t_6, _to_copy)
t_7: f16[16,32] = t(mm_2)
sum_2: f16[1,32] = sum.dim_IntList(threshold_backward, [0], True)
view_1: f16[32] = view(sum_2, [32])
t_8: f16[32,16] = t(t_7)
_to_copy_7: f32[4] = _to_copy(view, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_8: f32[4,32] = _to_copy(t_5, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_9: f32[32] = _to_copy(view_1, dtype=f32, layout=torch.strided, device=device(type='cpu'))
_to_copy_10: f32[32,16] = _to_copy(t_8, dtype=f32, layout=torch.strided, device=device(type='cpu'))
return [_to_copy_10, _to_copy_9, None, _to_copy_8, _to_copy_7]""")
        # The debug tools compile the same graphs and leave no state behind.
        model, x = _mlp()
        locator = OverflowLocator()
        fxamp.compile(model, compiler=locator, dynamic=False, **FP16)
        model(x).float().sum().backward()
        record = locator.graphs[0]
        ours = [format_graph(record.forward, marks=False), format_graph(record.backward,
                                                                         marks=False)]
        self.assertEqual(ours, plain)
        fxamp.range_stats(*_mlp(), **FP16)
        self.assertEqual(_plain_graphs(), plain)


def test_a_source_line_never_names_fxamps_own_files():
    # an nn.Sequential of torch modules: the only frame outside torch in its trace was fxamp's
    # compiled-call entry (fxamp/_compat/modules.py, call_impl), which the report printed as
    # the overflowing op's source; now no source line is printed rather than fxamp's
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(2, 8)
    x[0, 0] = 1e6
    text = str(fxamp.locate_overflow(model, x, opt_level="O1", dtype=torch.float16))
    assert "forward: aten._to_copy.default in 0 (Linear)" in text
    assert "call_impl" not in text and "_compat" not in text and "  source" not in text
