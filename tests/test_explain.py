"""explain(): the report's parts, the metadata on inserted casts, logs through TORCH_LOGS."""

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fxamp
from examples import models
from fxamp.passes.insert_casts import is_fxamp_cast


@pytest.fixture(scope="module")
def report():
    model, inputs = models.cnn()
    return fxamp.explain(model, *inputs, opt_level="O2", backward=True)


def test_report_sections_and_counts(report):
    text = str(report)
    assert text.startswith("fxamp O2 | dtype bf16 | policy torch-cpu | device cpu\n"
                           "graphs: 1 | graph breaks: 0 | casts inserted: 2 (+2 at the model boundary) | "
                           "ops kept in fp32: 1")
    for section in ("== forward graph 0 (after fxamp) ==", "== backward graph 0 ==",
                    "== compute ops =="):
        assert section in text
    bn = next(r for r in report.rows if r.op == "batch_norm.default")
    assert (bn.module, bn.policy, bn.reason, bn.output) == ("bn", "fp32", "keep_batchnorm_fp32",
                                                          "f32")


def test_inserted_casts_carry_metadata(report):
    gm = report.graphs[0].graph_module
    casts = [n for n in gm.graph.nodes if is_fxamp_cast(n)]
    assert len(casts) == report.casts_inserted == 2
    for cast in casts:
        assert cast.meta["val"].dtype == cast.kwargs["dtype"]
        assert "models.py" in cast.meta["stack_trace"]
        assert any("bn" in path for path, _ in cast.meta["nn_module_stack"].values())


def test_explain_leaves_the_callers_model_alone():
    model, inputs = models.cnn()
    fxamp.explain(model, *inputs, opt_level="O3")
    assert model.conv.weight.dtype == torch.float32 and fxamp.config_of(model) is None


def test_explain_reports_graph_breaks():
    def fn(x):
        x = torch.mm(x, x)
        torch._dynamo.graph_break()
        return torch.mm(x, x)

    report = fxamp.explain(fn, torch.randn(2, 2), opt_level="O1")
    assert report.graph_breaks == 1 and len(report.graphs) == 2
    assert "graph breaks: 1" in str(report)
    assert "break: Call to `torch._dynamo.graph_break()`" in str(report)


def test_explain_keeps_other_compiled_models_compiled():
    # torch._dynamo.explain would reset Dynamo and make the training model compile again.
    model, (x,) = models.mlp()
    counting = CompileCounter()
    compiled = torch.compile(model, backend=counting)
    compiled(x)
    other, inputs = models.cnn()
    fxamp.explain(other, *inputs, opt_level="O1")
    compiled(x)
    assert counting.frame_count == 1


def test_torch_logs_shows_the_passes():
    code = ("import fxamp; from examples import models; m, (x,) = models.mlp(); "
            "fxamp.compile(m, compiler='aot_eager'); m(x)")
    env = {**os.environ, "TORCH_LOGS": "+fxamp"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr
    assert "fxamp O1 (torch-cpu): PassStats(ops_annotated=2" in result.stderr
    assert "linear: bf16[8,32] = linear(args_0_bf16, fc1_weight_bf16, fc1_bias_bf16)" in \
        result.stderr


class _UserCasts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).double().sum().float()


@pytest.mark.parametrize("level, boundary", [("O1", 0), ("O2", 1)])  # O2: the input
def test_the_users_own_casts_are_not_boundary_casts(level, boundary):
    report = fxamp.explain(_UserCasts(), torch.randn(2, 4), opt_level=level)
    assert report.boundary_casts == boundary
    text = str(report)
    assert "= to.dtype(linear, f64)\n" in text and "= to.dtype(sum_1, f32)\n" in text


def test_explain_takes_a_model_fxamp_compile_prepared():
    # explain, locate_overflow and range_stats share one preparation: a model fxamp.compile
    # prepared is explained with its own config (on main before, explain refused it as
    # "already prepared" while locate_overflow accepted it).
    model, inputs = models.cnn()
    fresh = fxamp.explain(model, *inputs, opt_level="O2")
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")
    weight = model.conv.weight.detach().clone()
    report = fxamp.explain(model, *inputs)
    assert report.config == fxamp.config_of(model) and report.config.opt_level == "O2"
    assert [(r.op, r.policy, r.inputs, r.output) for r in report.rows] == \
        [(r.op, r.policy, r.inputs, r.output) for r in fresh.rows]
    assert len(fxamp.backend_of(model).compiled_graphs) == 0  # the model itself never ran
    assert torch.equal(model.conv.weight, weight)
    with pytest.raises(fxamp.ConfigError, match="prepared by fxamp.compile with O2"):
        fxamp.explain(model, *inputs, opt_level="O1")
