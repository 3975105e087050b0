"""Patterns that reach past the graph: custom autograd.Functions, activation checkpointing,
graph breaks, and the user's own torch.autocast regions inside forward."""

from __future__ import annotations

import functools
import zlib

import torch
from torch import nn
from torch.utils import checkpoint as ckpt

from .groups import BREAKS, CHECKPOINTING, FUNCTION_GROUP, USER_AUTOCAST
from .harness import Pattern

B, D = 8, 32

# The symptoms on main (2026-11-23), item numbers as in issue 10.


class Square(torch.autograd.Function):
    """The old style: forward takes ctx."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class ScaledTanh(torch.autograd.Function):
    """The new style: forward without ctx, setup_context, a non-tensor argument."""

    @staticmethod
    def forward(x, alpha):
        return torch.tanh(x) * alpha

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.alpha = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (ctx.alpha - out * out / ctx.alpha), None


class Stack(nn.Module):
    """a -> middle(h) -> b, where `middle` is the pattern under test."""

    def __init__(self, middle):
        super().__init__()
        self.a, self.b, self.middle = nn.Linear(D, D), nn.Linear(D, 4), middle

    def forward(self, x):
        return self.b(self.middle(self, self.a(x)))


def _stack(middle):
    return lambda: (Stack(middle), (torch.randn(B, D),))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.LayerNorm(D)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Checkpointed(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(D, D), nn.ModuleList([Block(), Block()]), \
            nn.Linear(D, 4)
        self.kwargs = kwargs

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = ckpt.checkpoint(block, h, **self.kwargs)
        return self.out(h)


def _save_matmuls(ctx, op, *args, **kwargs):
    save = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return ckpt.CheckpointPolicy.MUST_SAVE if save else ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(**kwargs):
    return lambda: (Checkpointed(**kwargs), (torch.randn(B, D),))


def _item(self, h):
    return h * (1.0 + 0.1 * torch.sigmoid(h.mean()).item())


def _print(self, h):
    print("conformance: a print inside forward", end="\r")
    return torch.relu(h)


def _builtin(self, h):
    return h * float(zlib.crc32(b"fxamp") % 3 + 1)  # Dynamo cannot trace zlib.crc32


def _branch(self, h):
    return torch.relu(h) if h.sum() > 0 else torch.tanh(h)  # data-dependent: breaks


def _fp32_region(self, h):
    with torch.autocast("cpu", enabled=False):
        h = torch.nn.functional.linear(h.float(), self.a.weight.float() * 0.5)
    return torch.relu(h)


def _fp16_region(self, h):
    with torch.autocast("cpu", dtype=torch.float16):
        h = torch.nn.functional.linear(h, self.a.weight * 0.5)
    return torch.relu(h.float())


PATTERNS = [
    Pattern("autograd_function", FUNCTION_GROUP, "custom autograd.Function (forward takes ctx)",
            _stack(lambda self, h: Square.apply(h)), inductor=True),
    Pattern("autograd_function_setup_context", FUNCTION_GROUP,
            "custom autograd.Function with setup_context and a non-tensor argument",
            _stack(lambda self, h: ScaledTanh.apply(h, 2.0))),
    Pattern("checkpoint_reentrant", CHECKPOINTING, "torch.utils.checkpoint(use_reentrant=True)",
            _checkpointed(use_reentrant=True)),
    Pattern("checkpoint_non_reentrant", CHECKPOINTING,
            "torch.utils.checkpoint(use_reentrant=False)",
            _checkpointed(use_reentrant=False), inductor=True),
    Pattern("selective_checkpoint", CHECKPOINTING,
            "selective activation checkpointing (create_selective_checkpoint_contexts)",
            _checkpointed(use_reentrant=False, context_fn=functools.partial(
                ckpt.create_selective_checkpoint_contexts, _save_matmuls))),
    Pattern("break_item", BREAKS, "graph break: .item() in forward", _stack(_item),
            inductor=True),
    Pattern("break_print", BREAKS, "graph break: print() in forward", _stack(_print)),
    Pattern("break_builtin", BREAKS, "graph break: a builtin Dynamo cannot trace (zlib.crc32)",
            _stack(_builtin)),
    Pattern("break_branch", BREAKS,
            "graph break: a data-dependent `if` on a tensor", _stack(_branch)),
    Pattern("autocast_fp32_region", USER_AUTOCAST,
            "torch.autocast(enabled=False) region in forward",
            _stack(_fp32_region)),
    Pattern("autocast_fp16_region", USER_AUTOCAST,
            "torch.autocast(dtype=float16) region inside bf16 O1",
            _stack(_fp16_region), levels=("O1",)),
]
