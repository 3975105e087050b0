"""Higher-order ops keep their meaning: custom autograd.Function, Tensor.register_hook in forward.

Note [Higher-order ops keep their bodies] (fxamp/passes/hops.py). Before it, fxamp traced a
Function's forward inline under no_grad: every parameter before it got no gradient, at every
level, and a hook registered in forward was dropped. Tolerances: tests/parity.py.
"""

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp.testing import format_graph
import parity

LEVELS = ["O0", "O1", "O2", "O3"]


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class ScaledTanh(torch.autograd.Function):
    """forward + setup_context (the torch.func style), a non-tensor argument, a wrong-looking
    backward (x3) that only this Function's own backward can explain."""

    @staticmethod
    def forward(x, scale):
        return torch.tanh(x) * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, scale = inputs
        ctx.save_for_backward(x)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * ctx.scale * (1 - torch.tanh(x) ** 2), None


class WithFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        h = Square.apply(h) if self.fn == "square" else ScaledTanh.apply(h, 0.5)
        return self.b(h)


class WithHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)  # triples every gradient before `a`
        return self.b(h)


def _x():
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


def _model(cls, *args):
    def make():
        torch.manual_seed(0)
        return cls(*args)

    return make


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("fn", ["square", "setup_context"])
def test_autograd_function_gradients(fn, level):
    parity.check(_model(WithFunction, fn), [_x()], level)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_autograd_function_through_backend(level):
    backend = lambda m: torch.compile(m, backend=fxamp.backend(level, compiler="aot_eager"))
    parity.check(_model(WithFunction, "setup_context"), [_x()], "O1" if level == "O1" else "O2",
                 compiled=backend)


@pytest.mark.parametrize("level", LEVELS)
def test_register_hook_in_forward(level):
    parity.check(_model(WithHook), [_x()], level)


def test_inductor_runs_the_users_backward():
    model = fxamp.compile(_model(WithFunction, "setup_context")(), opt_level="O1")
    parity.grads(model, _x())  # raises if any gradient is None


def test_function_forward_follows_the_policy():
    # Inside the Function's forward autocast applies, as in eager; the op stays one node.
    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.nn.functional.linear(x, w).softmax(-1)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors  # fp32; g is bf16, as under autocast: backward casts
            g = g.float()
            return g @ w, g.t() @ x

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8))

        def forward(self, x):
            return Inner.apply(x, self.w)

    model = fxamp.compile(M(), opt_level="O1", compiler="aot_eager")
    model(_x()).float().sum().backward()
    gm = fxamp.backend_of(model).compiled_graphs[0].graph_module
    assert [n.name for n in gm.graph.nodes if "autograd_function_apply" in str(n.target)]
    body = gm.get_submodule(next(n for n in gm.graph.nodes
                                 if "autograd_function_apply" in str(n.target)).args[0].target)
    assert "linear: bf16[32,4] = linear(x_bf16, w_bf16)" in format_graph(body).replace(
        "arg0_1_bf16", "x_bf16").replace("arg1_1_bf16", "w_bf16")
    assert "softmax: bf16[32,4] = softmax.int(linear, -1)" in format_graph(body)
    assert model.w.grad is not None
