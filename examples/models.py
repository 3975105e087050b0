"""Tiny deterministic models for examples, docs, tests and `python -m fxamp explain`.

Each factory takes no arguments and returns `(model, example_inputs)`, where `example_inputs`
is a tuple to call the model with. Weights and inputs come from a fixed seed inside
`torch.random.fork_rng`, so every call returns the same values and the caller's RNG is left
alone. Dimensions stay at 32 or below: low-precision matmuls are slow on CPUs without bf16 units.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["mlp", "cnn", "attention", "MLP", "CNN", "AttentionBlock"]

SEED = 0


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self, channels: int = 4, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(x.flatten(1))


class AttentionBlock(nn.Module):
    """A pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.ln2(x))


def _build(cls: type, *shape: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    # fork_rng: seed the default initialisers without disturbing the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = cls()
        return model, (torch.randn(*shape),)


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Linear(16, 32) -> relu -> Linear(32, 4); input 8x16."""
    return _build(MLP, 8, 16)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Conv2d(1, 4) -> BatchNorm2d -> relu -> MaxPool2d -> Linear(64, 10); input 2x1x8x8."""
    return _build(CNN, 2, 1, 8, 8)


def attention() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A pre-LN transformer block, dim 16, 2 heads, causal; input 2x8x16."""
    return _build(AttentionBlock, 2, 8, 16)
