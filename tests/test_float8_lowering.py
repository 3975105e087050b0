"""Where float8 GEMMs run (Note [The emulated float8 lowering] in fxamp/float8/emulated.py) and
the Inductor cache entries of CPU graphs (Note [Inductor's cache and the CPU's instruction set]
in fxamp/_compat/inductor.py).

The emulated GEMM is compared with torch's own CPU `_scaled_mm` on the same float8 operands:
where that is torch's emulated fallback (CPUs without AVX512-FP16/AMX, or
ATEN_CPU_CAPABILITY=avx2) the two are bitwise equal; oneDNN's float8 matmul (AVX512-FP16/AMX
CPUs) sums in another order, so the test allows one rounding of the output dtype.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fxamp
from fxamp import _compat
from fxamp.float8.emulated import emulated_scaled_mm, lowering_for
from fxamp.testing import float8_gemms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROWWISE_ON_CPU = _compat.scaled_mm_refusal("cpu", True, torch.bfloat16) is None
AVX512 = os.path.exists("/proc/cpuinfo") and " avx512f" in open("/proc/cpuinfo").read()


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
    # products of float8 values are exact in float32; only the summation order may differ
    eps = torch.finfo(out_dtype).eps
    torch.testing.assert_close(got, peer, rtol=eps, atol=0)
    exact = _float64(a, b, sa, sb)
    # one rounding of the output dtype, and float32 sums of K products
    magnitude = _float64(a.abs(), b.abs(), sa.abs(), sb.abs())
    bound = (eps * exact.abs() + a.shape[1] * 2 ** -24 * magnitude).max().item()
    assert (got.double() - exact).abs().max().item() <= bound


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


_SCRIPT = textwrap.dedent("""
    import copy, torch, fxamp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 64))
    reference, x = copy.deepcopy(model), torch.randn(32, 64)
    fxamp.compile(model, opt_level="O1")
    for m in (model, reference):
        m(x).float().square().mean().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        err = (p.grad - r.grad).abs().max().item()
        assert err <= 2 ** -6 * r.grad.abs().max().item(), err  # bf16 GEMMs against fp32
""")


def _run(cache, **env):
    # the default width unless `env` names one (CI's avx2 run of this file sets it for us)
    inherited = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env = {**inherited, "TORCHINDUCTOR_CACHE_DIR": str(cache), **env}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _entries(cache):
    return sum(len(files) for _, _, files in os.walk(cache / "fxgraph"))


@pytest.mark.skipif(not AVX512, reason="needs a CPU with AVX-512 (two vector widths to pick)")
def test_graphs_for_another_vector_width_are_other_cache_entries(tmp_path):
    # Inductor's FX graph cache does not key on the instruction set it generated code for; an
    # avx2 process sharing the cache loaded AVX-512 kernels and trained to NaN or wrong
    # gradients on some runs. With the width in each graph's config, the avx2 process compiles
    # graphs of its own (and its gradients are right: the script checks them against fp32).
    _run(tmp_path)
    wide = _entries(tmp_path)
    _run(tmp_path, ATEN_CPU_CAPABILITY="avx2")
    assert _entries(tmp_path) == 2 * wide > 0
