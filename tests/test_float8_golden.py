"""Golden graphs of the float8 pass (tensorwise, O2 bf16, CPU): the forward graph after fxamp
and the backward AOTAutograd derives from it, a dtype on every value.

Regenerate after an intended change with `EXPECTTEST_ACCEPT=1 python -m pytest <this file>`.
"""

import pytest
import torch

expecttest = pytest.importorskip("expecttest")

import fxamp
from fxamp import _compat
from fxamp.testing import float8_gemms, format_graph


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64, bias=False)
        self.fc2 = torch.nn.Linear(64, 32, bias=False)  # N=32 < min_dim: stays bf16

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _scaled_mm_operands(gm):
    """(operand dtypes, output dtype) of every float8 GEMM in a graph (either lowering)."""
    return [(tuple(map(str, g.operands)), str(g.out)) for g in float8_gemms(gm)]


class TestFloat8Golden(expecttest.TestCase):
    def test_two_layers_tensorwise(self):
        report = fxamp.explain(TwoLayers(), torch.randn(16, 64), opt_level="O2",
                               float8="tensorwise", backward=True)
        self.assertExpectedInline(format_graph(report.graphs[0].graph_module), """\
args_0: f32[16,64]
fc1_weight: bf16[64,64]
fc2_weight: bf16[32,64]
to: bf16[16,64] = to.dtype(args_0, bf16)  # fxamp boundary
float8_linear: bf16[16,64] = float8_linear(to, fc1_weight, None, 'tensorwise')
relu: bf16[16,64] = relu(float8_linear)
linear_1: bf16[16,32] = linear(relu, fc2_weight)
to_1: f32[16,32] = to.dtype(linear_1, f32)  # fxamp boundary
return [to_1]""")
        self.assertExpectedInline(format_graph(report.backward_graphs[0], marks=False), """\
view: bf16[16,64]
relu: bf16[16,64]
detach: bf16[16,64]
t_1: bf16[64,32]
tangents_1: f32[16,32]
_to_copy_13: bf16[16,32] = _to_copy(tangents_1, dtype=bf16, layout=torch.strided, device=device(type='cpu'))
t_2: bf16[32,16] = t(_to_copy_13)
mm_2: bf16[32,64] = mm(t_2, relu)
t_3: bf16[64,32] = t(mm_2)
t_4: bf16[32,64] = t(t_1)
mm_3: bf16[16,64] = mm(_to_copy_13, t_4)
t_5: bf16[32,64] = t(t_3)
detach_1: bf16[16,64] = detach(detach)
threshold_backward: bf16[16,64] = threshold_backward(mm_3, detach_1, 0)
view_2: bf16[16,64] = view(threshold_backward, [16, 64])
abs_3: bf16[16,64] = abs(view_2)
max_3: bf16[] = max(abs_3)
_to_copy_14: f64[] = _to_copy(max_3, dtype=f64)
clamp_4: f64[] = clamp(_to_copy_14, 1e-12)
reciprocal_4: f64[] = reciprocal(clamp_4)
mul_6: f64[] = mul.Tensor(reciprocal_4, 57344.0)
_to_copy_15: f32[] = _to_copy(mul_6, dtype=f32)
_to_copy_16: f32[16,64] = _to_copy(view_2, dtype=f32)
mul_7: f32[16,64] = mul.Tensor(_to_copy_16, _to_copy_15)
clamp_5: f32[16,64] = clamp(mul_7, -57344.0, 57344.0)
_to_copy_17: e5m2[16,64] = _to_copy(clamp_5, dtype=e5m2)
t_7: e5m2[64,16] = t(_to_copy_17)
abs_5: bf16[16,64] = abs(view)
max_5: bf16[] = max(abs_5)
_to_copy_25: f64[] = _to_copy(max_5, dtype=f64)
clamp_8: f64[] = clamp(_to_copy_25, 1e-12)
reciprocal_8: f64[] = reciprocal(clamp_8)
mul_12: f64[] = mul.Tensor(reciprocal_8, 448.0)
_to_copy_26: f32[] = _to_copy(mul_12, dtype=f32)
_to_copy_27: f32[16,64] = _to_copy(view, dtype=f32)
mul_13: f32[16,64] = mul.Tensor(_to_copy_27, _to_copy_26)
clamp_9: f32[16,64] = clamp(mul_13, -448.0, 448.0)
_to_copy_28: e4m3[16,64] = _to_copy(clamp_9, dtype=e4m3)
reciprocal_9: f32[] = reciprocal(_to_copy_15)
reciprocal_10: f32[] = reciprocal(_to_copy_26)
_to_copy_29: f32[64,16] = _to_copy(t_7, dtype=f32)
mul_14: f32[64,16] = mul.Tensor(_to_copy_29, reciprocal_9)
_to_copy_30: f32[16,64] = _to_copy(_to_copy_28, dtype=f32)
mul_15: f32[16,64] = mul.Tensor(_to_copy_30, reciprocal_10)
mm_5: f32[64,64] = mm(mul_14, mul_15)
_to_copy_31: bf16[64,64] = _to_copy(mm_5, dtype=bf16)
t_8: bf16[64,64] = t(_to_copy_31)
t_9: bf16[64,64] = t(t_8)
return [None, t_9, t_5]""")
        # the weight gradient of fc1 is one e5m2 x e4m3 GEMM with a bf16 result
        self.assertEqual(_scaled_mm_operands(report.backward_graphs[0]),
                         [(("torch.float8_e5m2", "torch.float8_e4m3fn"), "torch.bfloat16")])


class Batched(torch.nn.Module):
    """A grouped expert GEMM, a linear written as a bmm of an expanded weight, and an
    attention-style bmm (Note [Batched float8 GEMMs])."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(torch.randn(2, 32, 16))
        self.proj = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        h = torch.bmm(x, self.experts)
        h = torch.bmm(h, self.proj.expand(2, 16, 16))
        return torch.bmm(h, h.transpose(1, 2))


class TestFloat8BatchedGolden(expecttest.TestCase):
    def test_batched_tensorwise(self):
        report = fxamp.explain(Batched(), torch.randn(2, 16, 32), opt_level="O2",
                               float8=fxamp.Float8Config(min_dim=16), backward=True)
        self.assertExpectedInline(format_graph(report.graphs[0].graph_module), """\
args_0: f32[2,16,32]
experts: bf16[2,32,16]
proj: bf16[16,16]
to: bf16[2,16,32] = to.dtype(args_0, bf16)  # fxamp boundary
float8_bmm: bf16[2,16,16] = float8_bmm(to, experts, None, 'tensorwise')
float8_bmm_1: bf16[2,16,16] = float8_bmm(float8_bmm, proj, None, 'tensorwise')
transpose: bf16[2,16,16] = transpose.int(float8_bmm_1, 1, 2)
bmm_2: bf16[2,16,16] = bmm(float8_bmm_1, transpose)
to_1: f32[2,16,16] = to.dtype(bmm_2, f32)  # fxamp boundary
return [to_1]""")
        self.assertExpectedInline(report.gemm_report(), """\
== GEMMs (float8 tensorwise, dynamic scaling) ==
op   module  [B*]M x K x N  runs in  why
bmm  <root>  2*16x32x16     float8   tensorwise: e4m3 x e4m3, grad e5m2, bf16 out; 2 GEMMs, one per batch entry, scaled per entry
bmm  <root>  32x16x16       float8   tensorwise: e4m3 x e4m3, grad e5m2, bf16 out; one flattened GEMM (the right operand has one batch entry)
bmm  <root>  2*16x16x16     -        attention-style batched GEMM (no parameter operand): off by default, batched_activations=True includes it (Note [Attention-style batched GEMMs stay by default]); stays bf16
float8: 2 of 3 GEMMs, 75.0 % of GEMM FLOPs""")
        # backward: the experts' grad_weight, one GEMM per entry (their grad_input, for the
        # input x, is dead code), and the flattened bmm's grad_input and grad_weight
        self.assertEqual(_scaled_mm_operands(report.backward_graphs[0]),
                         4 * [(("torch.float8_e5m2", "torch.float8_e4m3fn"), "torch.bfloat16")])


ROWWISE_ON_CPU = _compat.scaled_mm_refusal("cpu", True, torch.bfloat16) is None


class TestFloat8GradWeightHpGolden(expecttest.TestCase):
    @pytest.mark.skipif(not ROWWISE_ON_CPU, reason="torch._scaled_mm has no row-scaled CPU "
                        "kernel before 2.13")
    def test_rowwise_with_gw_hp_backward_gemms(self):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                                    torch.nn.Linear(64, 64, bias=False))
        report = fxamp.explain(model, torch.randn(16, 64), opt_level="O2",
                               float8="rowwise_with_gw_hp", backward=True)
        name = lambda d: str(d).replace("torch.", "")
        dtype = lambda n: name(n.meta["val"].dtype)
        graph = report.backward_graphs[0]
        float8 = {g.node: g for g in float8_gemms(graph)}
        gemms = [f"float8({name(float8[n].operands[0])}, {name(float8[n].operands[1])}) -> "
                 f"{name(float8[n].out)}" if n in float8 else
                 f"{n.target.__name__}({dtype(n.args[0])}, {dtype(n.args[1])}) -> {dtype(n)}"
                 for n in graph.graph.nodes
                 if n.target in (torch.ops.aten._scaled_mm.default, torch.ops.aten.mm.default)]
        # grad_input of the second layer in float8 (row-scaled gradient, tensor-scaled
        # weight); both grad_weights in bf16 (the first layer's grad_input is dead: x)
        self.assertExpectedInline("\n".join(gemms), """\
float8(float8_e4m3fn, float8_e4m3fn) -> bfloat16
mm.default(bfloat16, bfloat16) -> bfloat16
mm.default(bfloat16, bfloat16) -> bfloat16""")


class ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(3))

    def forward(self, x):
        for fc in self.fc:
            x = torch.relu(fc(x))
        return x


def _casts_to(gm, dtype):
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default
            and n.kwargs.get("dtype") is dtype]


def test_a_tensor_scaled_gradient_is_cast_once():
    # Note [Cast once, then transpose]: fc2 and fc3 need grad_input and grad_weight, fc1 (whose
    # input is the model's) grad_weight only: one e5m2 cast per gradient, its transpose for the
    # second GEMM (5 casts when the transposed gradient was cast anew).
    report = fxamp.explain(ThreeLayers(), torch.randn(16, 64), opt_level="O2",
                           float8="tensorwise", backward=True)
    assert len(_casts_to(report.backward_graphs[0], torch.float8_e5m2)) == 3
