"""Capture: lower Dynamo's torch-level graph to the pre-dispatch ATen graph the passes edit.

Pre-dispatch tracing keeps the ops torch.autocast itself sees (aten.linear, aten.softmax.int,
aten.batch_norm), folds Dynamo's several spellings of one op into one overload, and leaves
autograd to run later, on the graph with casts (see Note [Why casts are inserted before
autograd] in insert_casts.py). Running Dynamo's graph through an Interpreter under
`preserve_node_meta` carries each node's stack trace and nn_module_stack onto the ATen nodes.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from fxamp._compat import EXAMPLE_VALUE, make_fx, rename_node

__all__ = ["to_aten", "fake_inputs"]


def fake_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode) -> list[Any]:
    """Fake versions of a backend's example inputs (symbolic where Dynamo made them so)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fakes = []
    for node, value in zip(placeholders, example_inputs):
        example = node.meta.get(EXAMPLE_VALUE)
        if isinstance(value, torch.Tensor):
            fakes.append(fake_mode.from_tensor(value))
        else:
            fakes.append(example if example is not None else value)
    return fakes


def to_aten(gm: fx.GraphModule, fakes: Sequence[Any], fake_mode) -> fx.GraphModule:
    """Re-trace `gm` to ATen with `pre_dispatch=True` under `fake_mode`, keeping node metadata."""

    def run(*args):
        return fx.Interpreter(gm).run(*args)

    with fx_traceback.preserve_node_meta(), fake_mode:
        aten_gm = make_fx(run, pre_dispatch=True)(*fakes)
    sources = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for node, source in zip(list(aten_gm.graph.find_nodes(op="placeholder")), sources):
        node.meta["fxamp_source"] = source
        node.target = rename_node(node, readable_name(source))
    aten_gm.recompile()
    return aten_gm


_DYNAMO_NOISE = re.compile(r"(?<![^_])(modules|parameters|buffers)_")


def readable_name(dynamo_name: str) -> str:
    """'l_self_modules_fc_parameters_weight_' -> 'fc_weight', 'l_x_' -> 'x'."""
    name = re.sub(r"^l_(self_|model_)?", "", dynamo_name)
    name = _DYNAMO_NOISE.sub("", name).strip("_")
    return name or dynamo_name
