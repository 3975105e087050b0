"""Readable graphs with a dtype on every value, for golden tests, explain() and logs."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxamp._compat import FakeTensorMode, OpOverload, make_fx
from fxamp.passes.annotate import FXAMP_META, short_dtype
from fxamp.rules import BOUNDARY_REASON

__all__ = ["format_graph", "node_dtypes", "cast_nodes"]


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


def format_graph(gm: fx.GraphModule, *, marks: bool = True) -> str:
    """One line per node: `name: dtype[shape] = op(args)`, casts fxamp inserted marked `# fxamp`."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"{node.name}: {_type_of(node.meta.get('val'))}")
        elif node.op == "output":
            lines.append(f"return {_arg(list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else node.args[0])}")
        elif node.op == "call_function":
            args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
            line = f"{node.name}: {_type_of(node.meta.get('val'))} = {_target(node)}({', '.join(args)})"
            decision = node.meta.get(FXAMP_META)
            if marks and type(decision).__name__ == "CastInfo":
                line += "  # fxamp"
            elif marks and decision is not None and decision.reason == BOUNDARY_REASON:
                line += "  # fxamp boundary"
            lines.append(line)
    return "\n".join(lines)


def node_dtypes(gm: fx.GraphModule) -> dict[str, str]:
    """{node name: dtype} for every node whose value is a tensor."""
    return {n.name: short_dtype(n.meta["val"].dtype) for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def cast_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The dtype-conversion nodes of a graph (fxamp's and the user's)."""
    kinds = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default,
             torch.ops.aten.to.dtype}
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in kinds]




def transform(fn, *example_inputs, config) -> fx.GraphModule:
    """Trace `fn` to the pre-dispatch ATen graph on fake tensors and run fxamp's passes on it.

    The same capture and pipeline the backend uses, without Dynamo or a compiler: for tests
    of the passes on tiny graphs (milliseconds) and for checking single ops. `config` must be
    resolved (`AmpConfig.from_opt_level(...).resolve("cpu")`).
    """
    from fxamp.passes import run_passes

    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        gm = make_fx(fn, pre_dispatch=True)(*fakes)
    run_passes(gm, config, fake_mode)
    return gm
