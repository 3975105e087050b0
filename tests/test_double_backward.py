"""Higher-order gradients and repeated backwards through fxamp's graphs (issue 24, items 3 and 8).

- `compiler="eager"` runs fxamp's cast graph under eager autograd, so a `create_graph=True`
  gradient is differentiated again (Note [Double backward runs the cast graph eagerly]); every
  other compiler refuses such a backward with a ConfigError naming that fix, never torch's
  "does not currently support double backward" at the second backward.
- Graphs are compiled without donated buffers (Note [Graphs whose backward runs twice] in
  backend.py), so `backward(retain_graph=True)` followed by a second backward works where
  AOTAutograd's donated buffers refused it.
Tolerances: O0 casts nothing, and its gradients are compared with fp32 eager's bit for bit
(eager compiler) or to 1e-6 (AOTAutograd may order a reduction differently); O1 with autocast's
error budget (tests/conformance/harness.py, Note [Conformance tolerance]).
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxamp
from fxamp.errors import ConfigError


class Critic(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 16), nn.Linear(16, 1), nn.LayerNorm(8)
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.norm(x)
        if self.checkpointed:
            return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), h, use_reentrant=False))
        return self.b(torch.tanh(self.a(h)))


def _critic(**kwargs):
    torch.manual_seed(0)
    return Critic(**kwargs), torch.randn(6, 8)


def _penalty_step(model, x, *, autocast=False):
    """One WGAN-GP step: loss = score + (|d score / dx| - 1)^2, gradients to the parameters."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        score = model(x)
    (grad,) = torch.autograd.grad(score.float().sum(), x, create_graph=True)
    loss = score.float().mean() + (grad.norm(dim=1) - 1).pow(2).mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_o0_eager_double_backward_is_fp32_eager_bit_for_bit(checkpointed):
    base, x = _critic(checkpointed=checkpointed)
    want = _penalty_step(copy.deepcopy(base), x)
    model = fxamp.compile(copy.deepcopy(base), opt_level="O0", compiler="eager")
    for _ in range(2):
        got = _penalty_step(model, x)
    for name, g in want.items():
        assert torch.equal(got[name], g), name


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_o1_eager_double_backward_within_autocast_budget(checkpointed):
    base, x = _critic(checkpointed=checkpointed)
    fp32 = _penalty_step(copy.deepcopy(base), x)
    autocast = _penalty_step(copy.deepcopy(base), x, autocast=True)
    model = fxamp.compile(copy.deepcopy(base), opt_level="O1", compiler="eager")
    got = _penalty_step(model, x)
    y = model(x)  # the cast graph ran, not an fp32 one: bf16 values (cast to fp32 on the way out)
    assert y.dtype == torch.float32 and torch.equal(y, y.bfloat16().float())
    assert any(_rel(autocast[n], g) > 1e-3 for n, g in fp32.items())  # autocast did round
    for name, g in fp32.items():
        assert _rel(got[name], g) <= 2 * _rel(autocast[name], g) + 4 * 2.0**-9, name


def test_backend_eager_runs_double_backward():
    base, x = _critic()
    want = _penalty_step(copy.deepcopy(base), x)
    model = copy.deepcopy(base)
    model.compile(backend=fxamp.backend("O1", compiler="eager"))
    got = _penalty_step(model, x)
    assert max(_rel(got[n], g) for n, g in want.items()) < 0.05


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_create_graph_through_aot_graph_is_refused_naming_the_fix(level, checkpointed):
    base, x = _critic(checkpointed=checkpointed)
    model = fxamp.compile(base, opt_level=level, compiler="aot_eager")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = x.clone().requires_grad_()
    score = model(x)
    with pytest.raises(ConfigError, match="compiler='eager'") as caught:
        torch.autograd.grad(score.float().sum(), x, create_graph=True)
    assert "compiler='aot_eager'" in str(caught.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_create_graph_is_refused_too():
    base, x = _critic()
    model = fxamp.compile(base, opt_level="O1", compiler="aot_eager")
    with pytest.raises(ConfigError, match="create_graph=True"):
        model(x).sum().backward(create_graph=True)


def test_first_order_backward_and_no_grad_calls_are_untouched():
    base, x = _critic()
    want = copy.deepcopy(base)
    want(x).sum().backward()
    model = fxamp.compile(base, opt_level="O0", compiler="aot_eager")
    with torch.no_grad():
        model(x)
    with torch.enable_grad():  # grad mode outside backward is not create_graph
        torch.autograd.grad(model(x).sum(), model.a.weight)
    model(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


class Mlp(nn.Module):
    """Saves activations that are no graph input or output: plain torch.compile's AOTAutograd
    marks them donated and refuses a backward that keeps its graph after an ordinary one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 16), nn.Linear(16, 2), nn.LayerNorm(16)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


def _two_backwards(model, x):
    model(x).pow(2).mean().backward()  # the backward is compiled here, by an ordinary backward
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.pow(2).mean().backward(retain_graph=True)
    out.sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor",
                                                               marks=pytest.mark.slow)])
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_second_backward_over_one_forward(level, compiler):
    torch.manual_seed(0)
    base, x = Mlp(), torch.randn(4, 8)
    want = _two_backwards(copy.deepcopy(base), x)
    got = _two_backwards(fxamp.compile(base, opt_level=level, compiler=compiler), x)
    bound = 1e-5 if level == "O0" else 0.05  # O1/O2: bf16 rounding of a 16-wide layer
    assert max(_rel(got[n], g) for n, g in want.items()) < bound


@pytest.mark.slow
def test_create_graph_through_inductor_graph_is_refused():
    base, x = _critic()
    model = fxamp.compile(base, opt_level="O1")
    x = x.clone().requires_grad_()
    with pytest.raises(ConfigError, match="compiler='inductor'"):
        torch.autograd.grad(model(x).float().sum(), x, create_graph=True)
