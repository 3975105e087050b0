"""Patterns built from layers and module features: hooks, buffers, in-place ops, side
computations in fp64/complex, attention masks, embedding bags, tying, parametrizations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from .groups import BUFFERS, HOOKS, LAYERS, PARAM, SIDE
from .harness import Pattern

B, D = 8, 32


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


class MLP(nn.Module):
    def __init__(self, d_in: int = D, d_out: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, D), nn.Linear(D, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _module_hooks():
    model = MLP()
    model.fc1.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    model.fc1.register_forward_hook(lambda m, args, out: out + 1.0)
    return model, (_x(B, D),)


def _backward_hook():
    model = MLP()
    model.fc2.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 3.0,))
    return model, (_x(B, D),)


class TensorHook(MLP):
    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 3.0)
        return self.fc2(h)


class RunningMean(nn.Module):
    """A buffer the forward updates in place (an EMA of the activations), read back next call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.float().mean(0), alpha=0.1)
            self.calls += 1
        return h - self.ema


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)
        self.act, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.0, inplace=True)

    def forward(self, x):
        h = self.drop(self.act(self.fc1(x)))
        g = self.fc2(h)
        g += x
        return F.leaky_relu_(g, 0.1)


class SideComputations(nn.Module):
    """An fp64 statistic and a complex FFT beside the network: fxamp must leave them alone."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("scale64", torch.linspace(1, 2, D, dtype=torch.float64))

    def forward(self, x):
        h = self.fc(x)
        stat = (h.double() * self.scale64).pow(2).mean(0)
        spectrum = torch.fft.rfft(h.float(), dim=-1)
        return h, stat, spectrum * torch.polar(torch.ones(()), torch.tensor(0.3))


class MaskedAttention(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.qkv, self.out, self.causal = nn.Linear(D, 3 * D), nn.Linear(D, D), causal

    def forward(self, x, pad):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        mask = None if self.causal else pad[:, None, None, :]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.out(h.transpose(1, 2).flatten(2))


def _attention(causal: bool):
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, 9:] = False
    return lambda: (MaskedAttention(causal), (_x(2, 12, D), pad))


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, D, mode="mean")
        self.head = nn.Linear(D, 3)

    def forward(self, ids, offsets, weights):
        return self.head(self.bag(ids, offsets) + F.embedding_bag(
            ids, self.bag.weight, offsets, mode="sum", per_sample_weights=weights))


def _bag():
    ids = torch.randint(0, 50, (20,))
    return Bag(), (ids, torch.tensor([0, 4, 9, 15]), torch.rand(20))


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(40, D), nn.Linear(D, D)
        self.head = nn.Linear(D, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _parametrized(kind: str):
    def build():
        model = MLP()
        if kind == "weight_norm":
            parametrizations.weight_norm(model.fc1)
        else:
            parametrizations.spectral_norm(model.fc1)
        return model, (_x(B, D),)
    return build


def _functional_call(model, inputs):
    params = dict(model.named_parameters())
    return torch.func.functional_call(model, params, inputs)


PATTERNS = [
    Pattern("mlp", LAYERS, "Linear-ReLU-Linear, the baseline", lambda: (MLP(), (_x(B, D),)),
            levels=("O1", "O2", "O3"), inductor=True),
    Pattern("module_hooks", HOOKS, "forward pre-hook and forward hook changing input and output",
            _module_hooks),
    Pattern("backward_hook", HOOKS,
            "register_full_backward_hook scaling a module's input gradient",
            _backward_hook),
    Pattern("tensor_hook", HOOKS, "Tensor.register_hook on an activation inside forward",
            lambda: (TensorHook(), (_x(B, D),)), inductor=True),
    Pattern("buffer_update", BUFFERS, "register_buffer updated in place in forward (EMA, counter)",
            lambda: (RunningMean(), (_x(B, D),)), inductor=True),
    Pattern("inplace", LAYERS, "ReLU(inplace=True), Dropout(inplace=True), +=, F.leaky_relu_",
            lambda: (InPlace(), (_x(B, D),))),
    Pattern("fp64_complex_side", SIDE,
            "fp64 statistic and complex FFT beside the net (dtypes kept)",
            lambda: (SideComputations(), (_x(B, D),))),
    Pattern("sdpa_pad_mask", LAYERS, "scaled_dot_product_attention with a boolean padding mask",
            _attention(False), inductor=True),
    Pattern("sdpa_causal", LAYERS,
            "scaled_dot_product_attention with is_causal=True", _attention(True)),
    Pattern("embedding_bag", LAYERS,
            "nn.EmbeddingBag (mean) + F.embedding_bag with per-sample weights",
            _bag),
    Pattern("weight_tying", LAYERS, "LM head sharing the embedding's weight",
            lambda: (TiedLM(), (torch.randint(0, 40, (2, 10)),))),
    Pattern("weight_norm", PARAM, "parametrizations.weight_norm", _parametrized("weight_norm")),
    Pattern("spectral_norm", PARAM, "parametrizations.spectral_norm (power-iteration buffers)",
            _parametrized("spectral_norm")),
    Pattern("functional_call", PARAM, "torch.func.functional_call(model, params, x)",
            lambda: (MLP(), (_x(B, D),)), call=_functional_call),
]
