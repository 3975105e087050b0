"""Readable graphs with a dtype on every value, for explain(), logs and golden tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxamp._compat import OpOverload
from fxamp.passes.annotate import FXAMP_META, short_dtype

__all__ = ["format_graph", "node_dtypes"]


def _type_of(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return short_dtype(val.dtype) + "[" + ",".join(str(s) for s in val.shape) + "]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_type_of(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "-"


def _arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, torch.dtype):
        return short_dtype(a)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x) for x in a) + "]"
    return repr(a)


def _target(node: fx.Node) -> str:
    target = node.target
    name = str(target) if isinstance(target, OpOverload) else getattr(
        target, "__name__", str(target))
    return name.replace("aten.", "").replace(".default", "")


def _mark(node: fx.Node) -> str:
    decision = node.meta.get(FXAMP_META)
    if decision is None:
        return ""
    return "  # fxamp" if decision.inserted else "  # fxamp boundary" if decision.boundary else ""


def _line(node: fx.Node, marks: bool) -> str:
    if node.op == "placeholder":
        return f"{node.name}: {_type_of(node.meta.get('val'))}"
    if node.op == "output":
        out = node.args[0]
        return f"return {_arg(list(out) if isinstance(out, (tuple, list)) else out)}"
    args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
    line = f"{node.name}: {_type_of(node.meta.get('val'))} = {_target(node)}({', '.join(args)})"
    return line + (_mark(node) if marks else "")


def format_graph(gm: fx.GraphModule, *, marks: bool = True) -> str:
    """One line per node: `name: dtype[shape] = op(args)`, casts fxamp inserted marked `# fxamp`
    and its model-boundary casts `# fxamp boundary`."""
    return "\n".join(_line(node, marks) for node in gm.graph.nodes
                     if node.op in ("placeholder", "output", "call_function"))


def node_dtypes(gm: fx.GraphModule) -> dict[str, str]:
    """{node name: dtype} for every node whose value is a tensor."""
    return {n.name: short_dtype(n.meta["val"].dtype) for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}
