"""Where float8 GEMMs run (Note [The emulated float8 lowering] in fxamp/float8/emulated.py) and
the Inductor options of CPU graphs (Note [Inductor's cache and the CPU's instruction set] in
fxamp/_compat/inductor.py; their cache entries across processes: tests/test_warm_start.py).

The emulated GEMM is compared with torch's own CPU `_scaled_mm` on the same float8 operands:
where that is torch's emulated fallback (CPUs without AVX512-FP16/AMX, or
ATEN_CPU_CAPABILITY=avx2) the two are bitwise equal; oneDNN's float8 matmul (AVX512-FP16/AMX
CPUs) sums in another order, so the test allows what two float32 sums of the same K exact
products can differ by (the error bound of each, elementwise) and one rounding of the output.
"""

import pytest
import torch

import fxamp
from fxamp import _compat
from fxamp.float8.emulated import emulated_scaled_mm, lowering_for
from fxamp.testing import float8_gemms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROWWISE_ON_CPU = _compat.scaled_mm_refusal("cpu", True, torch.bfloat16) is None


def _operands(m, k, n, dtype_a):
    torch.manual_seed(0)
    a = (torch.randn(m, k) * 40).clamp(-400, 400).to(dtype_a)
    b = (torch.randn(n, k) * 40).clamp(-400, 400).to(E4M3).t()  # column-major, as _scaled_mm
    return a, b


def _float64(a, b, sa, sb):
    return (a.double() * sa.double()) @ (b.double() * sb.double())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype_a", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, pytest.param(True, marks=pytest.mark.skipif(
    not ROWWISE_ON_CPU, reason="torch._scaled_mm has no row-scaled CPU kernel before 2.13"))])
def test_the_emulated_gemm_gives_scaled_mm_numbers(rowwise, dtype_a, out_dtype):
    a, b = _operands(48, 256, 32, dtype_a)
    sa, sb = (torch.rand(48, 1) + 0.5, torch.rand(1, 32) + 0.5) if rowwise else (
        torch.tensor(0.37), torch.tensor(1.7))
    got = emulated_scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    peer = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    # Products of float8 values are exact in float32; only the summation order may differ.
    # Each float32 sum of K products is within K * 2**-24 * sum|products| of the exact one
    # (elementwise), and the output dtype rounds once.
    eps = torch.finfo(out_dtype).eps
    exact = _float64(a, b, sa, sb)
    magnitude = _float64(a.abs(), b.abs(), sa.abs(), sb.abs())
    sums = a.shape[1] * 2 ** -24 * magnitude
    assert ((got.double() - peer.double()).abs() <= eps * peer.double().abs() + 2 * sums).all()
    assert ((got.double() - exact).abs() <= eps * exact.abs() + sums).all()


def test_the_emulated_gemm_keeps_zeros_and_extremes():
    a = torch.tensor([[0.0, 448.0, -448.0, 2 ** -9] * 4] * 16).to(E4M3)
    b = torch.eye(16).to(E4M3).t()
    got = emulated_scaled_mm(a, b, scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                             out_dtype=torch.float32)
    assert torch.equal(got, a.float())  # denormal 2**-9 and the e4m3 maximum survive


def test_gemms_lower_by_device():
    assert lowering_for(torch.device("cpu")) == "emulated"
    assert lowering_for(torch.device("cuda", 0)) == "scaled_mm"
    assert lowering_for(torch.device("meta")) == "emulated"


def test_cpu_graphs_have_no_scaled_mm():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(16, 64, requires_grad=True)
    report = fxamp.explain(model, x, opt_level="O2", float8="tensorwise", backward=True)
    graphs = [g.graph_module for g in report.graphs] + list(report.backward_graphs)
    assert not [n for gm in graphs for n in gm.graph.nodes
                if n.target is torch.ops.aten._scaled_mm.default]
    forward = [g for gm in report.graphs for g in float8_gemms(gm.graph_module)]
    backward = [g for gm in report.backward_graphs for g in float8_gemms(gm)]
    assert len(backward) == 4 and {g.operands for g in backward} == {(E5M2, E4M3)}
    assert not forward  # the forward graphs hold fxamp's float8_linear calls, traced later


def test_cpu_code_options_name_the_picked_width():
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    assert _compat.cpu_code_options() == ({"cpp.simdlen": isa.bit_width()} if isa else {})


# The cache entries of another vector width: tests/test_warm_start.py (three processes, one cache).
