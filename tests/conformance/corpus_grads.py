"""Patterns that use autograd beyond one backward per forward: double backward (gradient
penalties, MAML, through checkpointing), several backwards over one forward (retain_graph), and
`tensor.data` / `.detach()` read and written inside forward. Issue 24, items 3, 4 and 8."""

from __future__ import annotations

import torch
from torch import nn

from .corpus_autograd import Checkpointed, _stack
from .groups import DATA, DOUBLE_BACKWARD, RETAIN_GRAPH
from .harness import Pattern

B, D = 8, 32


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(D, D), nn.Linear(D, 1), nn.LayerNorm(D)

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.norm(x))))


def _critic():
    return Critic(), (torch.randn(B, D),)


def _gradient_penalty(model, inputs):
    """WGAN-GP: the critic's score and the penalty on the norm of its input gradient, which
    the harness's backward differentiates a second time."""
    x = inputs[0].detach().requires_grad_()
    score = model(x)
    (grad,) = torch.autograd.grad(score.float().sum(), x, create_graph=True)
    return score, (grad.norm(dim=1) - 1).pow(2)


def _maml(model, inputs):
    """One MAML inner step: fast weights from gradients with create_graph, the outer output
    through them (torch.func.functional_call)."""
    (x,) = inputs
    params = dict(model.named_parameters())
    inner = model(x).float().pow(2).mean()
    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
    fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
    return torch.func.functional_call(model, fast, (x,))


def _checkpointed_critic(**kwargs):
    return lambda: (Checkpointed(**kwargs), (torch.randn(B, D),))


def _two_backwards(model, inputs):
    """An ordinary step first (AOTAutograd compiles the backward then), then a forward whose
    graph two backwards run over: one here with retain_graph=True, the harness's after it."""
    model(*inputs).float().pow(2).mean().backward()
    out = model(*inputs)
    out.float().pow(2).mean().backward(retain_graph=True)
    return out


class Memory(nn.Module):
    """Tacotron2's decoder in small: the previous frame, read and stored through `.data`."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 4)
        self.register_buffer("previous", torch.zeros(1, D))

    def forward(self, x):
        h = self.a(x)
        out = self.b(torch.cat((self.previous.data, h)))
        self.previous.data.copy_(h.data[-1:])
        return out


def _data_read(self, h):
    return torch.cat((h.data[:1], h))  # Tacotron2's decoder: torch.cat((m.data[:1], y))


def _detach_read(self, h):
    return torch.cat((h.detach()[:1], h))


def _data_write(self, h):
    h.data[:1] = 0.0
    return torch.tanh(h)


def _data_write_saved(self, h):
    y = h * h  # saves h for backward; a write through .data does not trip autograd's check
    h.data.mul_(0.5)
    return y + h


def _detach_write(self, h):
    h.detach().mul_(0.5)
    return torch.tanh(h)


def _param_data_read(self, h):
    return h + self.a.weight.data.sum(0)


PATTERNS = [
    Pattern("gradient_penalty", DOUBLE_BACKWARD,
            "WGAN-GP: the norm of autograd.grad(score, x, create_graph=True) in the loss",
            _critic, call=_gradient_penalty, compiler="eager"),
    Pattern("maml_inner_step", DOUBLE_BACKWARD,
            "MAML: fast weights from autograd.grad(create_graph=True), functional_call",
            _critic, call=_maml, compiler="eager"),
    Pattern("gradient_penalty_checkpoint", DOUBLE_BACKWARD,
            "gradient penalty through torch.utils.checkpoint(use_reentrant=False)",
            _checkpointed_critic(use_reentrant=False), call=_gradient_penalty, compiler="eager"),
    # One Linear (two parameters). torch.compile + autocast fails this itself on torch 2.14
    # (autocast's bf16 copies are saved activations, marked donated): the peer is eager
    # autocast. With a LayerNorm or an activation plain torch.compile fails on every torch
    # (tests/test_double_backward.py has that case against eager).
    Pattern("retain_graph", RETAIN_GRAPH,
            "backward(retain_graph=True), then a second backward over the same forward",
            lambda: (nn.Linear(D, 4), (torch.randn(B, D),)), call=_two_backwards,
            inductor=True, peer_compiled=False),
    Pattern("data_read", DATA, "torch.cat((h.data[:1], h)) in forward (Tacotron2's decoder)",
            _stack(_data_read), inductor=True),
    Pattern("detach_read", DATA, "torch.cat((h.detach()[:1], h)) in forward",
            _stack(_detach_read)),
    Pattern("data_write", DATA, "h.data[:1] = 0 on an activation in forward",
            _stack(_data_write)),
    Pattern("data_write_saved", DATA,
            "h.data.mul_(0.5) on an activation saved for backward (y = h * h)",
            _stack(_data_write_saved)),
    Pattern("detach_write", DATA, "h.detach().mul_(0.5) on an activation in forward",
            _stack(_detach_write)),
    Pattern("param_data_read", DATA, "a parameter's .data read in forward",
            _stack(_param_data_read)),
    Pattern("buffer_data_write", DATA,
            "a buffer read and stored through .data in forward (the previous frame)",
            lambda: (Memory(), (torch.randn(B, D),))),
]
