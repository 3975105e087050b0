"""Activation checkpointing under fxamp: reentrant, non-reentrant, selective, transformers.

Dynamo turns `torch.utils.checkpoint` into `tag_activation_checkpoint(body, *args)`; fxamp
keeps it one node with its body annotated under the level's policy (Note [Higher-order ops
keep their bodies] in fxamp/passes/hops.py), so AOTAutograd recomputes the body in backward
as it does for torch.compile. Before, O1/O2 failed to compile (KeyError
'_checkpoint_context_fn' inside torch's own pre-dispatch rule). Tolerances: tests/parity.py.
"""

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import fxamp
import parity

LEVELS = ["O0", "O1", "O2", "O3"]


def _save_matmuls(ctx, op, *args, **kwargs):
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16),
                                   nn.Linear(16, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        if self.how == "non_reentrant":
            h = checkpoint(self.block, h, use_reentrant=False)
        elif self.how == "reentrant":
            h = checkpoint(self.block, h, use_reentrant=True)
        else:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            h = checkpoint(self.block, h, use_reentrant=False, context_fn=context)
        return self.out(h)


def _make(how):
    def make():
        torch.manual_seed(0)
        return Checkpointed(how)

    return make


def _x():
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "selective"])
def test_checkpoint_gradients(how, level):
    parity.check(_make(how), [_x()], level)


def test_checkpointed_body_follows_the_policy():
    model = fxamp.compile(_make("non_reentrant")(), opt_level="O1", compiler="aot_eager")
    parity.grads(model, _x())
    gm = fxamp.backend_of(model).compiled_graphs[0].graph_module
    node = next(n for n in gm.graph.nodes if "tag_activation_checkpoint" in str(n.target))
    body = gm.get_submodule(node.args[0].target)
    linears = [n for n in body.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert [n.meta["val"].dtype for n in linears] == [torch.bfloat16] * 2


@pytest.mark.slow  # ~17 s; the checkpointed graphs' casts are checked without Inductor above
def test_checkpoint_through_inductor():
    model = fxamp.compile(_make("non_reentrant")(), opt_level="O2")
    parity.grads(model, _x())
