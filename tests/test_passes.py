"""The passes on tiny traced graphs (no Dynamo, no Inductor): dtypes per node, invariants,
overrides and their precedence, validation errors by text."""

import re

import pytest
import torch
import torch.nn.functional as F

from fxamp import AmpConfig, BannedOpError, FxampError
from fxamp.passes.insert_casts import is_fxamp_cast
from fxamp.testing import format_graph, node_dtypes, transform


def _config(level="O1", device="cpu", **kw):
    return AmpConfig.from_opt_level(level, **kw).resolve(device)


def _check_invariants(gm):
    casts = [n for n in gm.graph.nodes if is_fxamp_cast(n)]
    keys = [(n.args[0], n.kwargs["dtype"]) for n in casts]
    assert len(keys) == len(set(keys)), "one cast per value per dtype"
    assert not any(is_fxamp_cast(n.args[0]) for n in casts), "no cast of a cast"
    for n in casts:
        src = n.args[0].meta["val"]
        assert src.dtype not in (torch.float64,) and src.is_floating_point()
        assert n.meta["val"].dtype == n.kwargs["dtype"]
    return casts


def test_tensors_of_another_device_are_never_cast():
    gm = transform(lambda a, b: torch.mm(a, b), torch.randn(2, 2), torch.randn(2, 2),
                   config=_config(device="cuda"))
    assert _check_invariants(gm) == [] and node_dtypes(gm)["mm"] == "f32"


def test_fp64_ints_and_bools_are_never_cast():
    def fn(x, d, i, m):
        return torch.mm(x, x), torch.mm(d, d), i * 2, torch.where(m, x, x)

    args = (torch.randn(4, 4), torch.randn(4, 4, dtype=torch.float64),
            torch.arange(4), torch.rand(4, 4) > 0.5)
    gm = transform(fn, *args, config=_config())
    casts = _check_invariants(gm)
    assert [c.args[0].name for c in casts] == ["x_1"]
    assert [t.dtype for t in gm(*args)] == [torch.bfloat16, torch.float64, torch.int64,
                                            torch.float32]


def test_one_cast_per_value_shared_by_consumers():
    gm = transform(lambda x, w: torch.mm(x, w) + torch.mm(w, x),
                   torch.randn(4, 4), torch.randn(4, 4), config=_config())
    assert len(_check_invariants(gm)) == 2


def test_promote_uses_widest_input_and_fp32_set_opt_dtype_sets_dtype():
    def fn(a, b):
        low = torch.mm(a, b)
        return torch.cat([low, a]), torch.cat([low, low]), torch.softmax(low, -1)

    gm = transform(fn, torch.randn(2, 2), torch.randn(2, 2),
                   config=_config(policy="torch-cuda", dtype="fp16"))  # softmax: dtype=f32
    graph = format_graph(gm)
    assert "softmax: f32[2,2] = softmax.int(mm, -1, dtype=f32)" in graph
    assert [t.dtype for t in gm(torch.randn(2, 2), torch.randn(2, 2))] == [
        torch.float32, torch.float16, torch.float32]


def test_op_override_beats_table_and_module_override_beats_op_override():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.head(self.body(x))

    import fxamp

    report = fxamp.explain(Net(), torch.randn(2, 4), opt_level="O1",
                           op_overrides={"aten.linear": "fp32"}, module_overrides={"head": "lower"})
    rows = {r.module: r for r in report.rows}
    assert (rows["body"].policy, rows["body"].output) == ("fp32", "f32")
    assert rows["body"].reason == "op override 'aten.linear'"
    assert (rows["head"].policy, rows["head"].output) == ("lower", "bf16")
    assert rows["head"].reason == "module override 'head' on head"


def test_module_override_by_class_name_keeps_layernorm_fp32_at_o2():
    import fxamp
    from examples import models

    model, inputs = models.attention()
    report = fxamp.explain(model, *inputs, opt_level="O2",
                           module_overrides={"LayerNorm": "fp32"})
    norms = [r for r in report.rows if r.op == "layer_norm.default"]
    assert len(norms) == 2 and all(r.output == "f32" and r.policy == "fp32" for r in norms)
    graph = format_graph(report.graphs[0].graph_module)
    # the fp32 island's output goes back to bf16 for the next bf16 linear
    assert "layer_norm_bf16: bf16[2,8,16] = _to_copy(layer_norm, dtype=bf16)  # fxamp" in graph


def test_banned_op_names_the_alternative():
    fn = lambda p, t: F.binary_cross_entropy(torch.sigmoid(p), t)
    args = (torch.randn(4), torch.rand(4))
    with pytest.raises(BannedOpError, match=re.escape(
            "aten.binary_cross_entropy.default in <top level> is banned under O1 with f16: "
            "torch.nn.functional.binary_cross_entropy / nn.BCELoss is unsafe in low precision")):
        transform(fn, *args, config=_config(device="cpu", policy="torch-cuda", dtype="fp16"))
    # torch's CPU policy runs it in fp32 instead, as torch.autocast does on CPU
    assert transform(fn, *args, config=_config()).__call__(*args).dtype == torch.float32


def test_banned_op_can_be_overridden():
    fn = lambda p, t: F.binary_cross_entropy(torch.sigmoid(p), t)
    config = _config(policy="apex", op_overrides={"aten.binary_cross_entropy": "fp32"})
    gm = transform(fn, torch.randn(4), torch.rand(4), config=config)
    assert gm(torch.randn(4), torch.rand(4)).dtype == torch.float32


def test_apex_refuses_inplace_fp32_op_on_low_input():
    def fn(x, w):
        return torch.mm(x, w).exp_()

    with pytest.raises(FxampError, match=re.escape(
            "in-place exp_ on a bf16 tensor cannot run in fp32 as the apex table asks; "
            "use the out-of-place exp")):
        transform(fn, torch.randn(2, 2), torch.randn(2, 2), config=_config(policy="apex"))


def test_o1_numerics_match_autocast_bitwise_on_cpu():
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 16), torch.randn(32, 16), torch.randn(32)

    def fn(x, w, b):
        return torch.log_softmax(F.linear(x, w, b).relu(), -1).sum(-1)

    gm = transform(fn, x, w, b, config=_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(x, w, b)
    assert torch.equal(gm(x, w, b), expected)


def test_o1_runs_the_fused_encoder_layer_in_the_low_dtype_as_cpu_autocast():
    # nn.TransformerEncoderLayer's eval fast path: CPU autocast reaches the matmuls inside the
    # fused kernel (the output is 16-bit); fxamp lowers its inputs (tables.py).
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    params = [layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias,
              layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
              layer.norm1.weight, layer.norm1.bias, layer.norm2.weight, layer.norm2.bias,
              layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias]

    def fn(x, *p):
        return torch._transformer_encoder_layer_fwd(x, 16, 2, *p[:4], False, False, 1e-5,
                                                    *p[4:])

    args = (torch.randn(4, 6, 16), *(p.detach() for p in params))
    gm = transform(fn, *args, config=_config())
    assert node_dtypes(gm)["_transformer_encoder_layer_fwd"] == "bf16"
    assert len(_check_invariants(gm)) == len(args)
    ref = fn(*(a.double() for a in args))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_error = (fn(*args).double() - ref).norm() / ref.norm()
    error = (gm(*args).double() - ref).norm() / ref.norm()
    assert error <= 2 * autocast_error  # the conformance suite's O1 rule


def test_dtypes_per_node_o3_batch_norm_stays_mixed_when_stats_are_fp32():
    def fn(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True)

    args = (torch.randn(4, 3), torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3))
    gm = transform(fn, *args, config=_config("O3"))
    dtypes = node_dtypes(gm)
    assert dtypes["batch_norm"] == "bf16" and dtypes["x_1"] == "f32"
    assert [c.args[0].name for c in _check_invariants(gm)] == ["x_1"]  # stats untouched


def test_users_own_autocast_region_wins():
    def fn(x, w):
        h = torch.mm(x, w)
        with torch.autocast("cpu", enabled=False):
            inner = torch.mm(h.float(), w)
        return h, inner

    gm = transform(fn, torch.randn(2, 2), torch.randn(2, 2), config=_config())
    dtypes = node_dtypes(gm)
    assert dtypes["mm"] == "bf16" and dtypes["mm_1"] == "f32"
    decision = next(n for n in gm.graph.nodes if n.name == "mm_1").meta["fxamp"]
    assert decision.reason == "inside the user's torch.autocast(enabled=False) region"


def test_keep_override_that_mixes_dtypes_is_refused_before_running():
    import fxamp
    from examples import models

    model, inputs = models.attention()
    # sdpa is lowered to bf16 and feeds proj, which the override leaves with fp32 weights
    with pytest.raises(FxampError, match=re.escape("aten.linear.default in proj (File ")) as info:
        fxamp.explain(model, *inputs, opt_level="O1", op_overrides={"aten.linear": "keep"})
    assert "would get bf16 and f32 inputs under policy 'keep' (op override 'aten.linear'); " \
           "it needs one dtype: override it to 'lower' or 'fp32'" in str(info.value)


def test_op_override_key_forms():
    fn = lambda x, w: torch.softmax(torch.mm(x, w), -1)
    for key in ("aten.softmax.int", "aten.softmax", "softmax", "softmax.int"):
        gm = transform(fn, torch.randn(2, 2), torch.randn(2, 2),
                       config=_config(op_overrides={key: "fp32"}))
        assert node_dtypes(gm)["softmax"] == "f32", key


def test_first_listed_module_override_wins():
    import fxamp
    from examples import models

    model, inputs = models.attention()
    report = fxamp.explain(model, *inputs, opt_level="O1",
                           module_overrides={"mlp.0": "keep", "mlp.*": "fp32"})
    rows = {r.module: r for r in report.rows if r.op == "linear.default"}
    assert rows["mlp.0"].policy == "keep" and rows["mlp.2"].policy == "fp32"
