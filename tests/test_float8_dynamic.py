"""Float8 GEMMs at symbolic shapes (Note [Float8 GEMMs at symbolic shapes] in
fxamp/passes/float8.py): a graph made dynamic by `mark_dynamic` or by Dynamo's recompile for a
new batch size or sequence length keeps its GEMMs in float8 (tensorwise, rowwise, delayed
histories, per-entry batched GEMMs), checked by the dtypes of the `_scaled_mm` nodes of the
forward and backward graphs and by numerics against the float64 recipe reference."""

import pytest
import torch

import fxamp
from float8_reference import dequant
from fxamp import _compat
from fxamp.float8 import Float8Config
from fxamp.testing import float8_gemms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_NO_ROWWISE = pytest.mark.skipif(
    _compat.scaled_mm_refusal("cpu", True, torch.bfloat16) is not None,
    reason="torch._scaled_mm has no row-scaled CPU kernel before 2.13")
RECIPES = ["tensorwise", pytest.param("rowwise", marks=_NO_ROWWISE)]
SHAPES = [(2, 16), (3, 32), (5, 48)]  # (batch, sequence): M = 32, 96, 240


class Graphs:
    """A compiler that records the forward and backward graphs AOTAutograd gives it."""

    def __init__(self):
        self.forward, self.backward = [], []
        self.compiler = _compat.aot_autograd(fw_compiler=self._keep(self.forward),
                                             bw_compiler=self._keep(self.backward))

    @staticmethod
    def _keep(graphs):
        def compile_(gm, _):
            graphs.append(gm)
            return _compat.make_boxed_func(gm.forward)
        return compile_


def _scaled_mms(gm):
    """(operand dtypes, output dtype, whether M or N is symbolic) of every float8 GEMM."""
    out = []
    for g in float8_gemms(gm):
        shape = g.node.meta["val"].shape
        out.append((g.operands, g.out, not all(isinstance(d, int) for d in shape)))
    return out


def _plain_mms(gm):
    """The GEMMs that are not float8 (in either lowering)."""
    float8 = {g.node for g in float8_gemms(gm)}
    return [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default,
                                                      torch.ops.aten.addmm.default,
                                                      torch.ops.aten.bmm.default)
            and n not in float8]


def _close(actual, expected, what):
    # _scaled_mm accumulates in fp32 and rounds once to bf16; the reference is float64
    err = (actual.double() - expected).abs().max().item()
    bound = 2 ** -7 * expected.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (one bf16 rounding)"


def _reference(x, w, g, recipe, amax_x=None, amax_w=None):
    """Output, grad_input, grad_weight of x @ w.T (x [M, K] bf16, w [N, K]) in the recipe, in
    float64; amax_x / amax_w: delayed scaling's, for the input and weight operands."""
    rowwise, pow2 = recipe == "rowwise", recipe == "rowwise"
    go = E4M3 if rowwise else E5M2
    out = (dequant(x, E4M3, -1, rowwise, pow2, amax_x)
           @ dequant(w.t(), E4M3, 0, rowwise, pow2, amax_w))
    gx = dequant(g, go, -1, rowwise, pow2) @ dequant(w, E4M3, 0, rowwise, pow2, amax_w)
    gw = dequant(g.t(), go, -1, rowwise, pow2) @ dequant(x, E4M3, 0, rowwise, pow2, amax_x)
    return out, gx, gw


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(64, 64, bias=False)


def _run(model, shapes, mark):
    """Forward and backward at each (batch, sequence); yields x, y, g for each."""
    g_gen = torch.Generator().manual_seed(1)
    for i, (batch, seq) in enumerate(shapes):
        x = (torch.randn(batch, seq, 64, generator=g_gen) * (i + 1)).requires_grad_()
        if mark:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
        model.zero_grad()
        y = model(x)
        # bf16 values (the output's cast makes the gradient bf16 before its GEMMs)
        g = torch.randn(y.shape, generator=g_gen).bfloat16().to(y.dtype)
        y.backward(g)
        yield x, y, g


@pytest.mark.parametrize("mark", [True, False], ids=["mark_dynamic", "automatic"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_gemms_at_varying_batch_and_sequence_lengths(recipe, mark):
    graphs, model = Graphs(), _linear()
    fxamp.compile(model, opt_level="O1", float8=recipe, compiler=graphs.compiler)
    for x, y, g in _run(model, SHAPES, mark):
        xb, wb = x.detach().reshape(-1, 64).bfloat16(), model.weight.detach().bfloat16()
        out, gx, gw = _reference(xb, wb, g.reshape(-1, 64), recipe)
        assert y.dtype == torch.float32  # O1's output: Note [O1's outputs are fp32]
        _close(y.reshape(-1, 64), out, f"output at {tuple(x.shape)}")
        _close(x.grad.reshape(-1, 64), gx, f"grad_input at {tuple(x.shape)}")
        _close(model.weight.grad, gw, f"grad_weight at {tuple(x.shape)}")
    # one graph (mark_dynamic) or two (static, then dynamic after the recompile), the last
    # one dynamic in M and with every GEMM in float8: e4m3 x e4m3 forward, the recipe's
    # gradient dtype backward, nothing left for a bf16 mm
    assert len(graphs.forward) == (1 if mark else 2)
    grad = E4M3 if recipe == "rowwise" else E5M2
    assert _scaled_mms(graphs.forward[-1]) == [((E4M3, E4M3), torch.bfloat16, True)]
    assert sorted(_scaled_mms(graphs.backward[-1]), key=str) == sorted(
        [((grad, E4M3), torch.bfloat16, True), ((grad, E4M3), torch.bfloat16, False)], key=str)
    assert not _plain_mms(graphs.forward[-1]) and not _plain_mms(graphs.backward[-1])


def test_delayed_histories_carry_across_the_recompile():
    graphs, model = Graphs(), _linear()
    fxamp.compile(model, opt_level="O1", float8=Float8Config(scaling="delayed", history_len=4),
                  compiler=graphs.compiler)
    seen = []
    for x, y, g in _run(model, SHAPES, mark=False):
        xb, wb = x.detach().reshape(-1, 64).bfloat16(), model.weight.detach().bfloat16()
        # scaled from the amaxes of the steps before (its own at the first step)
        out, gx, gw = _reference(xb, wb, g.reshape(-1, 64), "tensorwise",
                                 amax_x=max(seen) if seen else None, amax_w=wb.abs().max())
        _close(y.reshape(-1, 64), out, f"output at {tuple(x.shape)}")
        _close(x.grad.reshape(-1, 64), gx, f"grad_input at {tuple(x.shape)}")
        _close(model.weight.grad, gw, f"grad_weight at {tuple(x.shape)}")
        seen.append(xb.abs().max().float())
    # the static graph and the dynamic one read and push the same histories
    hist = {k: v for k, v in model.state_dict().items() if k.startswith("fxamp_float8_")}
    assert sorted(hist) == ["fxamp_float8_amax_root_linear0_input",
                            "fxamp_float8_amax_root_linear0_weight"]
    assert torch.equal(hist["fxamp_float8_amax_root_linear0_input"],
                       torch.stack([*reversed(seen), torch.tensor(0.0)]))
    assert len(graphs.forward) == 2
    assert _scaled_mms(graphs.forward[-1]) == [((E4M3, E4M3), torch.bfloat16, True)]


class Experts(torch.nn.Module):
    """x [E, T, K] @ w [E, K, N]: one GEMM per expert, T tokens each (dynamic)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(2, 64, 64) * 0.1)

    def forward(self, x):
        return torch.bmm(x, self.w)


def test_a_batched_gemm_with_a_symbolic_number_of_rows():
    graphs, model = Graphs(), Experts()
    fxamp.compile(model, opt_level="O1", float8="tensorwise", compiler=graphs.compiler)
    for tokens in (16, 48):
        x = torch.randn(2, tokens, 64)
        torch._dynamo.mark_dynamic(x, 1)
        y = model(x)
        for e in range(2):  # each expert its own GEMM, scaled on its own
            ref = (dequant(x[e].bfloat16(), E4M3, -1, False, False)
                   @ dequant(model.w[e].detach().bfloat16(), E4M3, 0, False, False))
            _close(y[e], ref, f"expert {e} at {tokens} tokens")
    assert len(graphs.forward) == 1
    assert _scaled_mms(graphs.forward[0]) == [((E4M3, E4M3), torch.bfloat16, True)] * 2


def test_a_size_that_breaks_a_rule_recompiles_and_stays_named():
    # Note [Float8 GEMMs at symbolic shapes]: M % 16 == 0 is a guard of the dynamic graph; a
    # batch with M = 2 * 17 recompiles, and in that graph the GEMM stays bf16, named
    model = _linear()
    fxamp.compile(model, opt_level="O1", float8="tensorwise", compiler="aot_eager")
    for batch, seq in [(2, 16), (3, 16), (2, 17), (4, 16)]:
        model(torch.randn(batch, seq, 64)).sum().backward()
    compiled = fxamp.backend_of(model).compiled_graphs
    choices = [n.meta["fxamp_float8"] for g in compiled for n in g.graph_module.graph.nodes
               if "fxamp_float8" in n.meta]
    assert [c.float8 for c in choices] == [True, True, False], choices
    assert "not all multiples of 16 (or data-dependent)" in choices[-1].reason
    assert not all(isinstance(d, int) for d in choices[1].shape)  # the dynamic graph


# torch 2.11's C++ code generation has no emulate_precision_casts (its codegen/cpp.py never reads
# it; 2.13's and 2.14.1's do): a kernel that casts fp32 to bf16 and on to float8 skips the bf16
# rounding, so float8 codes near a rounding boundary flip and the output is off the recipe by
# more than one bf16 rounding (docs/float8.md, "Known differences"; test_float8.py's torchao
# comparison likewise). The float8 GEMMs and their symbolic shapes are still checked there.
_OLD_INDUCTOR = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)


@pytest.mark.slow  # Inductor compiles the static and the dynamic graph: minutes on 2 cores
@pytest.mark.xfail(_OLD_INDUCTOR, strict=True, raises=AssertionError,
                   reason="torch 2.11's C++ kernels skip the bf16 rounding before float8")
def test_inductor_runs_the_dynamic_float8_graph():
    model = _linear()
    fxamp.compile(model, opt_level="O1", float8="tensorwise",
                  options={"emulate_precision_casts": True})
    checks = []  # (actual, reference, what): compared after the graphs' checks
    for x, y, g in _run(model, SHAPES, mark=False):
        xb, wb = x.detach().reshape(-1, 64).bfloat16(), model.weight.detach().bfloat16()
        out, gx, gw = _reference(xb, wb, g.reshape(-1, 64), "tensorwise")
        at = tuple(x.shape)
        checks += [(y.detach().reshape(-1, 64), out, f"output at {at}"),
                   (x.grad.reshape(-1, 64), gx, f"grad_input at {at}"),
                   (model.weight.grad.clone(), gw, f"grad_weight at {at}")]
    compiled = fxamp.backend_of(model).compiled_graphs
    assert [g.stats.float8_gemms for g in compiled] == [1, 1]
    choice = next(n.meta["fxamp_float8"] for n in compiled[-1].graph_module.graph.nodes
                  if "fxamp_float8" in n.meta)
    assert not isinstance(choice.shape[0], int)  # M is symbolic in the second graph
    for actual, expected, what in checks:
        _close(actual, expected, what)


def test_gemm_flops_of_a_dynamic_graph_are_counted_at_the_traced_sizes():
    """explain()'s float8 FLOP share reads each GEMM's FLOPs; at a symbolic M they are counted
    at the sizes the graph was traced with (they were 0, so a dynamic graph showed 0 %)."""
    model = _linear()
    fxamp.compile(model, opt_level="O1", float8="tensorwise", compiler="aot_eager")
    x = torch.randn(2, 16, 64)
    torch._dynamo.mark_dynamic(x, 0)
    model(x)
    (graph,) = fxamp.backend_of(model).compiled_graphs
    choices = [n.meta["fxamp_float8"] for n in graph.graph_module.graph.nodes
               if "fxamp_float8" in n.meta]
    assert [(c.float8, c.flops) for c in choices] == [(True, 2 * 32 * 64 * 64)]
    assert not all(isinstance(d, int) for d in next(
        n for n in graph.graph_module.graph.nodes if "fxamp_float8" in n.meta).meta["val"].shape)
