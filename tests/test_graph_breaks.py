"""Graph breaks at O1: the code between fxamp's graphs runs under the level's policy.

Note [Eager regions run under autocast] (docs/design.md). Before, the eager code
after a break met bf16 activations with fp32 weights (`mat1 and mat2 must have the same
dtype`) or ran silently in fp32. Each model is trained three steps, and each step's gradients
must match (tests/parity.py tolerances) fp32 eager and torch.compile + autocast; and with a
break, O1 must give the gradients it gives without one: to 1e-6 relative (the same ops in the
same dtypes, only where Dynamo cuts the graph differs), 4e-3 for `.item()` (its traceable twin
multiplies by a bf16 0-d tensor instead of the exact Python float: 2**-9 relative, twice).
"""

import copy
import zlib

import pytest
import torch
import torch.nn as nn

import fxamp
import parity


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Frames Dynamo compiled for an earlier test (a torch.nn forward called from eager code)
    # would otherwise be reused here, with an equal backend, and hide what an eager region does.
    torch._dynamo.reset()


def _item(self, h):
    return h * (1.0 + 0.1 * torch.sigmoid(h.mean()).item())


def _print(self, h):
    print("a print inside forward", end="\r")
    return torch.relu(h)


def _builtin(self, h):
    return h * float(zlib.crc32(b"fxamp") % 3 + 1)  # Dynamo cannot trace zlib.crc32


def _branch(self, h):
    return torch.relu(h) if h.sum() > 0 else torch.tanh(h)  # data-dependent: breaks


def _explicit(self, h):
    torch._dynamo.graph_break()
    return h


@torch.compiler.disable
def _eager_linear(linear, h):
    return linear(h)  # runs eagerly: the bf16 activation meets the fp32 weight


def _disabled(self, h):
    return _eager_linear(self.mid, h)


def _mid(self, h):
    return self.mid(h)


def _none(self, h):
    return h


BREAKS = {"item": _item, "print": _print, "builtin": _builtin, "branch": _branch,
          "explicit": _explicit, "compiler_disable": _disabled}
_TRACEABLE = {"item": lambda self, h: h * (1.0 + 0.1 * torch.sigmoid(h.mean())),
              "print": lambda self, h: torch.relu(h),
              "builtin": lambda self, h: h * float(zlib.crc32(b"fxamp") % 3 + 1),
              "explicit": _none, "compiler_disable": _mid}


class Net(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.middle = middle
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.mid = nn.Linear(16, 16) if middle in (_disabled, _mid) else None

    def forward(self, x):
        h = self.middle(self, self.a(x))
        h = self.b(h)  # a torch.nn forward right after the break
        return self.c(torch.softmax(h, -1) * h)


def _make(middle):
    def make():
        torch.manual_seed(0)
        return Net(middle)

    return make


def _batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(32, 8, generator=gen) for _ in range(3)]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for x in batches:
        steps.append(parity.grads(model, x))
        opt.step()
        opt.zero_grad()
    return steps


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_o1_with_a_break_trains_like_o1_without(kind):
    with_break = fxamp.compile(_make(BREAKS[kind])(), opt_level="O1", compiler="aot_eager")
    if kind == "branch":  # no traceable twin: compare with autocast (data-dependent)
        for x in _batches():
            parity.check(lambda: copy.deepcopy(with_break), [x], "O1",
                         compiled=lambda m: m)
        return
    without = fxamp.compile(_make(_TRACEABLE[kind])(), opt_level="O1", compiler="aot_eager")
    bound = 4e-3 if kind == "item" else 1e-6
    for (loss_a, grad_a), (loss_b, grad_b) in zip(_train(with_break, _batches()),
                                                  _train(without, _batches())):
        assert parity.rel(grad_a, grad_b) <= bound and parity.rel(loss_a, loss_b) <= bound


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_o1_with_a_break_matches_fp32_and_autocast(kind):
    parity.check(_make(BREAKS[kind]), [_batches()[0]], "O1")


def test_full_backward_hook_at_o1():
    # A module with a full backward hook is run outside Dynamo's graph (a break).
    def make():
        torch.manual_seed(0)
        model = Net(_none)
        model.b.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 3.0,))
        return model

    parity.check(make, [_batches()[0]], "O1")


def test_graphs_do_not_apply_autocast_twice():
    # Inside fxamp's graphs only fxamp's policy applies: an op overridden to fp32 stays fp32
    # although the call runs under torch.autocast (which would lower aten.linear). The eager
    # regions get autocast's table, overrides apply in the graphs (docs/backend.md).
    model = fxamp.compile(_make(_none)(), opt_level="O1", compiler="aot_eager",
                          op_overrides={"aten.linear": "fp32"})
    assert model(_batches()[0]).dtype == torch.float32


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_other_levels_with_breaks(level):
    parity.check(_make(_item), [_batches()[0]], level)


class _BreakBetween(nn.Module):
    """`self.down` is loaded before the call that breaks: after the break it reaches the resume
    function as a stack slot, not as `self.down`."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.down(_explicit(self, self.up(x)))


def test_module_override_after_a_break_names_the_module():
    # Note [Module paths in the model's terms] (fxamp/provenance.py): Dynamo names `down` in
    # the resume function "L['___stack0']"; its override to fp32 was silently lost (bf16 out).
    model = fxamp.compile(_BreakBetween(), opt_level="O1", dtype=torch.bfloat16,
                          compiler="aot_eager", module_overrides={"down": "fp32"})
    assert model(torch.randn(4, 8)).dtype == torch.float32
    paths = {node.meta["nn_module_stack"][key][0]
             for g in fxamp.model.prepare.backend_of(model).compiled_graphs
             for node in g.graph_module.graph.nodes
             for key in node.meta.get("nn_module_stack") or {}}
    assert paths == {"up", "down"}
