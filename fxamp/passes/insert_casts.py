"""Insert casts: materialise the annotations as `aten._to_copy` nodes.

Note [Why casts are inserted before autograd]: the graph this pass edits is the pre-dispatch
ATen graph, which has no backward yet. AOTAutograd differentiates it afterwards, so every cast
gets its mirror in the backward (a bf16 matmul's grad is cast back to the fp32 parameter's
dtype) and activations saved for backward are saved in the dtype they were computed in.
Being before functionalization too, the graph has in-place updates of views: a cast is placed
after the last write to its source (Note [Casts and in-place updates of views] in aliasing.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.fx as fx

from fxamp._compat import detect_fake_mode, pytree
from fxamp.passes.aliasing import Aliasing
from fxamp.passes.annotate import FXAMP_META, OpDecision, short_dtype

__all__ = ["insert_casts", "is_fxamp_cast"]

_CAST = torch.ops.aten._to_copy.default


def is_fxamp_cast(node: fx.Node) -> bool:
    """Whether insert_casts created `node` (its decision says so)."""
    decision = node.meta.get(FXAMP_META)
    return decision is not None and decision.inserted


class _Casts:
    """One cast per (value, version, dtype), where a version is the last write to the value's
    storage before its reader; a cast of one of our casts goes back to its source."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.aliasing = Aliasing.of(graph)
        self.cache: dict[tuple[fx.Node, Optional[fx.Node], torch.dtype], fx.Node] = {}
        self.count = 0
        self.placeholder_anchor: Optional[fx.Node] = None

    def get(self, src: fx.Node, dtype: torch.dtype, consumer: fx.Node, why: str) -> fx.Node:
        written = self.aliasing.last_write(src, consumer)
        if is_fxamp_cast(src) and _val(src.args[0]).dtype == dtype and written is None:
            return src.args[0]  # no back-to-back inverse casts
        key = (src, written, dtype)
        if key not in self.cache:
            self.cache[key] = self._make(src, written, dtype, consumer, why)
        return self.cache[key]

    def _make(self, src: fx.Node, written: Optional[fx.Node], dtype: torch.dtype,
              consumer: fx.Node, why: str) -> fx.Node:
        anchor = written or src
        at_top = anchor.op == "placeholder"  # keep placeholders contiguous at the top
        if at_top:
            anchor = self.placeholder_anchor or list(self.graph.find_nodes(op="placeholder"))[-1]
        with self.graph.inserting_after(anchor):
            cast = self.graph.create_node("call_function", _CAST, (src,), {"dtype": dtype},
                                          name=f"{src.name}_{short_dtype(dtype)}")
        if at_top:
            self.placeholder_anchor = cast
        val = _val(src)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in consumer.meta:
                cast.meta[key] = consumer.meta[key]
        with _fake_mode(val):
            cast.meta["val"] = val.to(dtype)
        cast.meta[FXAMP_META] = OpDecision(
            policy=consumer.meta[FXAMP_META].policy, reason=why,
            input_dtypes=(val.dtype,), arg_casts={}, val=cast.meta["val"], inserted=True)
        self.count += 1
        return cast


def _val(node: fx.Node) -> Any:
    decision = node.meta.get(FXAMP_META)
    return decision.val if decision is not None and decision.val is not None \
        else node.meta.get("val")


def _fake_mode(val: Any):
    return detect_fake_mode([val]) or contextlib.nullcontext()


def _cast_inputs(node: fx.Node, decision: OpDecision, casts: _Casts) -> None:
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    for i, dtype in decision.arg_casts.items():
        leaves[i] = casts.get(leaves[i], dtype, node, f"{decision.policy.value} input of {node.name}")
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    if decision.set_dtype_kwarg:
        kwargs = {**kwargs, "dtype": torch.float32}
    node.args, node.kwargs = tuple(args), kwargs


def _restore_output(node: fx.Node, dtype: torch.dtype, casts: _Casts) -> None:
    users = list(node.users)
    cast = casts.get(node, dtype, node, f"{node.name} back to the model dtype")
    for user in users:
        user.replace_input_with(node, cast)
    casts.aliasing.share(cast, node)


def insert_casts(gm: fx.GraphModule) -> int:
    """Materialise every node's OpDecision; returns the number of cast nodes inserted."""
    graph = gm.graph
    casts = _Casts(graph)
    for node in list(graph.nodes):
        decision = node.meta.get(FXAMP_META)
        if decision is None or decision.inserted:
            continue
        if decision.arg_casts or decision.set_dtype_kwarg:
            _cast_inputs(node, decision, casts)
        if decision.val is not None:
            node.meta["val"] = decision.val
        if decision.restore_output is not None:
            _restore_output(node, decision.restore_output, casts)
    return casts.count

