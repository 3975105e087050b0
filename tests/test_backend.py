"""The backend through real torch.compile + Inductor: compile counts, composition, caching."""

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx

import fxamp
from examples import models


class _Counting:
    """An inner compiler that counts the graphs it is handed, then runs Inductor."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return compile_fx(gm, example_inputs)


def test_twenty_training_steps_compile_each_graph_once():
    model, (x,) = models.mlp()
    counting = _Counting()
    fxamp.compile(model, opt_level="O1", compiler=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    target = torch.randint(0, 4, (x.shape[0],))
    for _ in range(20):
        F.cross_entropy(model(x).float(), target).backward()
        opt.step()
        opt.zero_grad()
    assert counting.calls == 1


def test_registered_backend_name():
    model, (x,) = models.mlp()
    compiled = torch.compile(model, backend="fxamp")
    assert compiled(x).dtype == torch.bfloat16  # O1, torch-cpu policy, bf16 on CPU


def test_inductor_options_are_checked_before_compiling():
    # They used to reach Inductor and fail inside Dynamo at the first call.
    with pytest.raises(fxamp.ConfigError, match=r"options \['not_an_inductor_option'\] are not "
                                                r"Inductor config settings"):
        fxamp.backend(opt_level="O1", options={"not_an_inductor_option": 1})
    assert fxamp.backend(opt_level="O1", options={"max_autotune": False}) is not None


def test_dynamic_shapes_one_graph():
    model, (x,) = models.mlp()
    reference = copy.deepcopy(model)
    fxamp.compile(model, opt_level="O2", dynamic=True, compiler="aot_eager")
    for batch in (8, 5, 3):
        inputs = torch.randn(batch, x.shape[1])  # fresh tensors: a slice's base adds guards
        out = model(inputs)
        assert out.shape == (batch, 4) and out.dtype == torch.float32
        torch.testing.assert_close(out, reference(inputs), atol=3e-2, rtol=3e-2)
    backend = fxamp.backend_of(model)
    assert len(backend.compiled_graphs) == 1


def test_fxamp_adds_no_graph_breaks():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    model, x = Broken(), torch.randn(2, 4)
    plain = torch._dynamo.explain(copy.deepcopy(model))(x)
    fxamp.compile(model, opt_level="O1", compiler="aot_eager")
    model(x)
    # plain's two graphs, and the output's cast to fp32 (Note [O1's outputs are fp32]) in the
    # model's call, which resumes after the break as a graph of its own (O2's inputs' and
    # outputs' casts do the same): no break of fxamp's
    graphs = fxamp.backend_of(model).compiled_graphs
    assert plain.graph_count == 2 and len(graphs) == 3
    last = [n.target for n in graphs[-1].graph_module.graph.nodes if n.op == "call_function"]
    assert last == [torch.ops.aten.to.dtype]


def _linear_dtypes(model):
    """The dtypes the linears of `model`'s compiled graphs compute in."""
    return {n.meta["val"].dtype for g in fxamp.backend_of(model).compiled_graphs
            for n in g.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default}


def test_changed_policy_never_reuses_a_stale_graph():
    model, (x,) = models.mlp()
    first = fxamp.compile(copy.deepcopy(model), opt_level="O1")
    second = fxamp.compile(copy.deepcopy(model), opt_level="O1",
                           op_overrides={"aten.linear": "fp32"})
    first(x), second(x)
    assert _linear_dtypes(first) == {torch.bfloat16} and _linear_dtypes(second) == {
        torch.float32}
    a, b = fxamp.backend_of(first), fxamp.backend_of(second)
    assert a != b and a == fxamp.FxampBackend(a.config)


def test_many_compiled_models_each_get_their_own_cache():
    """Note [One code object per compiled model]: no model falls back to eager."""
    model, (x,) = models.mlp()
    for _ in range(10):
        compiled = fxamp.compile(copy.deepcopy(model), opt_level="O1", compiler="aot_eager")
        compiled(x)
        assert len(fxamp.backend_of(compiled).compiled_graphs) == 1
        assert _linear_dtypes(compiled) == {torch.bfloat16}


def test_fullgraph_passes_through_to_dynamo():
    def fn(x):
        torch._dynamo.graph_break()
        return x + 1

    compiled = torch.compile(fn, backend=fxamp.backend(compiler="aot_eager"), fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(torch.randn(2))


def test_cast_model_outputs_at_the_boundary():
    model, (x,) = models.mlp()
    fxamp.compile(model, opt_level="O2", cast_model_outputs=torch.bfloat16,
                  compiler="aot_eager")
    assert model(x).dtype == torch.bfloat16
    with pytest.raises(fxamp.ConfigError, match="cast_model_outputs applies at the model"):
        fxamp.backend(opt_level="O2", cast_model_outputs=torch.float32)


class _Pair(torch.nn.Module):
    """Returns its outputs in the containers models use: a named tuple and an OrderedDict."""

    Out = collections.namedtuple("Out", "logits hidden")

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return self.Out(h, [h]), collections.OrderedDict(h=h, n=torch.arange(2))


def test_boundary_casts_keep_the_output_containers():
    model = _Pair()
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")
    out, named = model(torch.randn(2, 4))
    assert type(out) is _Pair.Out and type(out.hidden) is list
    assert type(named) is collections.OrderedDict
    assert (out.logits.dtype, out.hidden[0].dtype) == (torch.float32, torch.float32)
    assert (named["h"].dtype, named["n"].dtype) == (torch.float32, torch.int64)


def test_a_loss_scale_setting_does_not_recompile():
    # The backend keys on the graph part of the config only (AmpConfig.graph): loss-scale and
    # master-weight settings change nothing in the graph, so Dynamo reuses the compiled one.
    def fn(x):
        return torch.mm(x, x).softmax(-1)

    first = fxamp.backend(opt_level="O1", compiler="aot_eager", loss_scale=128.0)
    second = fxamp.backend(opt_level="O1", compiler="aot_eager", max_loss_scale=2.0**16)
    other_policy = fxamp.backend(opt_level="O1", compiler="aot_eager",
                                 op_overrides={"aten.mm": "fp32"})
    x = torch.randn(4, 4)
    for backend in (first, second, other_policy):
        torch.compile(fn, backend=backend)(x)
    assert first == second and first != other_policy
    assert [len(b.compiled_graphs) for b in (first, second, other_policy)] == [1, 0, 1]
