"""`tensor.data` and `.detach()` read and written inside forward (issue 24, item 4).

Dynamo records `t.data` as `_get_data_attr(t)`; fxamp's re-trace keeps that call as a node
(Note [tensor.data is traced as .data] in fxamp/passes/capture.py). Before, pre-dispatch tracing baked the traced value into the graph as a constant: O0
failed with "Please convert all Tensors to FakeTensors first", Inductor with "Cannot access data
pointer of Tensor". O0 casts nothing, so its results are compared with fp32 eager's to 1e-6
(AOTAutograd may order a reduction differently); the other levels in tests/conformance
(corpus_grads.py).
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxamp


class Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(8, 8), nn.Linear(8, 3), kind
        self.register_buffer("previous", torch.zeros(1, 8))

    def forward(self, x):
        h = self.a(x)
        if self.kind == "data_read":
            h = torch.cat((h.data[:1], h))
        elif self.kind == "data_write":
            h.data[:1] = 0.0
        elif self.kind == "data_inplace":
            h.data.mul_(0.5)
        elif self.kind == "data_write_saved":  # h is saved for y's backward; .data has its own
            y = h * h                          # version counter, so autograd does not object
            h.data.zero_()
            h = y + h
        elif self.kind == "detach_write":
            h.detach()[1:].mul_(0.5)
        elif self.kind == "param_data":
            h = h + self.a.weight.data.sum(0)
        elif self.kind == "buffer_data":
            h = torch.cat((self.previous.data, h))
            self.previous.data.copy_(h.data[-1:])
        elif self.kind == "checkpointed":
            h = checkpoint(lambda t: torch.cat((t.data[:1], torch.tanh(t))), h,
                           use_reentrant=False)
        return self.b(torch.tanh(h))


KINDS = ["data_read", "data_write", "data_inplace", "data_write_saved", "detach_write", "param_data", "buffer_data",
         "checkpointed"]


def _steps(model, x):
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.pow(2).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.detach(), grads, model.previous.detach().clone()


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_o0_matches_fp32_eager(kind, compiler):
    torch.manual_seed(0)
    base, x = Net(kind), torch.randn(4, 8)
    want = _steps(copy.deepcopy(base), x)
    got = _steps(fxamp.compile(base, opt_level="O0", compiler=compiler), x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-7)


def test_data_is_a_node_not_a_constant():
    model = fxamp.compile(Net("data_read"), opt_level="O1", compiler="aot_eager")
    model(torch.randn(4, 8)).sum().backward()
    gm = fxamp.backend_of(model).compiled_graphs[0].graph_module
    assert "_get_data_attr" in gm.code
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"], gm.code


@pytest.mark.slow
def test_data_read_under_inductor():
    torch.manual_seed(0)
    base, x = Net("data_read"), torch.randn(4, 8)
    want = _steps(copy.deepcopy(base), x)
    got = _steps(fxamp.compile(base, opt_level="O0"), x)
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-6, msg=name)
