"""The op policy package: table names per torch build, op names checked when a config is
built, and a policy object of the user's own (NodePolicy) for custom ops and op families."""

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError, FxampError
from fxamp.policy import PRESETS, NodePolicy, unresolved_names

_DIMNAME = {  # named-tensor overloads: absent from the 2.13.0 CPU and the 2.14.1 builds
    "torch-cuda": ("cumprod.dimname", "cumsum.dimname", "log_softmax.Dimname",
                   "norm.names_ScalarOpt_dim", "prod.dim_Dimname", "softmax.Dimname",
                   "sum.dim_DimnameList"),
    "torch-cpu": ("index_copy.dimname", "prod.dim_Dimname"),
    "apex": (),
}
UNRESOLVED = {  # per supported torch build (the CI legs), every table name it lacks
    "2.11.0": {"torch-cuda": (), "torch-cpu": (), "apex": ()},
    "2.13.0": _DIMNAME,
    "2.14.1": {**_DIMNAME, "torch-cpu": tuple(sorted(  # 2.14 removed aten.cholesky and aten.qr
        _DIMNAME["torch-cpu"] + ("cholesky", "qr")))},
}


def test_table_names_this_build_does_not_have():
    version = torch.__version__.split("+")[0]
    if version not in UNRESOLVED:
        pytest.skip(f"torch {version} is not a CI build; the pinned lists are for "
                    f"{', '.join(UNRESOLVED)}")
    found = {preset: unresolved_names(preset) for preset in PRESETS}
    assert found == UNRESOLVED[version]


@pytest.mark.parametrize("key", ["aten.sofmax", "aten.softmax.integer", "aten.softmax.int.x",
                                 "softmx"])
def test_op_override_names_are_checked_when_the_config_is_built(key):
    with pytest.raises(ConfigError, match=f"op_overrides key '{key}' is not an ATen op"):
        AmpConfig.from_opt_level("O1", op_overrides={key: "fp32"})


def test_policy_choice_is_one_vocabulary():
    with pytest.raises(ConfigError, match="is not one of lower, fp32, promote, keep"):
        AmpConfig.from_opt_level("O1", module_overrides={"fc": "fp16"})
    config = AmpConfig.from_opt_level("O1", op_overrides={torch.ops.aten.softmax.int: "fp32"})
    assert config.op_overrides == (("aten.softmax.int", "fp32"),)


@torch.library.custom_op("fxamp_test::smooth", mutates_args=())
def smooth(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


@smooth.register_fake
def _(x):
    return torch.empty_like(x)


def _smooth_backward(ctx, grad):
    x, = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * (s + x * s * (1 - s))


smooth.register_autograd(_smooth_backward,
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x):
        return self.pool(smooth(self.fc(x)).unsqueeze(1))


class _Rules:
    """fp32 for the custom op; every max-pool overload in the low dtype."""

    def policy_for(self, node):
        if node.target is torch.ops.fxamp_test.smooth.default:
            return "fp32"
        if node.target.__name__.startswith("max_pool"):
            return fxamp.CastPolicy.LOWER
        return None


def _rows(report):
    return {r.op: (r.policy, r.reason, f"{r.inputs} -> {r.output}") for r in report.rows}


def test_a_node_policy_decides_custom_ops_and_op_families():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plain = _rows(fxamp.explain(_Net(), x, opt_level="O1"))
    assert plain["fxamp_test.smooth.default"][0] == "keep"  # no table knows it
    rows = _rows(fxamp.explain(_Net(), x, opt_level="O1", policy=_Rules()))
    assert rows["fxamp_test.smooth.default"] == ("fp32", "_Rules.policy_for", "bf16 -> f32")
    pool = next(op for op in rows if op.startswith("max_pool"))
    assert rows[pool][:2] == ("lower", "_Rules.policy_for")
    assert rows["linear.default"] == plain["linear.default"]  # None: the preset decides
    assert isinstance(_Rules(), NodePolicy)


def test_a_node_policy_must_answer_with_a_policy():
    class Bad:
        def policy_for(self, node):
            return "fp16"

    with pytest.raises(FxampError, match=r"Bad.policy_for\(.*\) returned 'fp16'; it must "
                                         r"return one of 'lower', 'fp32', 'promote', 'keep'"):
        fxamp.explain(_Net(), torch.randn(4, 8), opt_level="O1", policy=Bad())
    with pytest.raises(ConfigError, match="or an object with a policy_for"):
        AmpConfig.from_opt_level("O1", policy=object())
