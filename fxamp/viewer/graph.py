"""fxamp's graphs after its passes as Model Explorer graphs: plain JSON data, no viewer needed.

One Model Explorer graph per fx graph (docs/explain.md, "In a graph viewer"): nodes
grouped into layers by module (namespaces from `nn_module_stack`), filled with the colour of
the dtype they run in, the casts fxamp inserted outlined, and fxamp's decision for each node
(policy and why, the float8 choice) in its attributes, which Model Explorer's side panel shows.
The dictionaries follow Model Explorer's graph JSON (`model_explorer.graph_builder`, camelCase
keys), so they load without the package on the machine that writes them.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from fxamp._compat import FWD_NN_MODULE_STACK, OpOverload
from fxamp.passes.annotate import FXAMP_META, short_dtype
from fxamp.passes.float8 import FLOAT8_META, is_float8_gemm
from fxamp.passes.hops import hop_spec
from fxamp.provenance import module_chain, source_line

__all__ = ["DTYPE_COLOURS", "CAST_BORDER", "BOUNDARY_BORDER", "FLOAT8", "runs_in",
           "namespace", "graph_json", "legend"]

FLOAT8 = "float8"
# Fill colours by the dtype a node runs in (ColorBrewer: told apart in print too; float8's
# purple is a mid tone, as saturated as the others, since a pale lavender reads as white).
DTYPE_COLOURS = {"f32": "#9ecae1", "bf16": "#a1d99b", "f16": "#fdae6b", FLOAT8: "#8c6bb1",
                 "f64": "#d9d9d9"}
CAST_BORDER = "#d6007e"  # casts fxamp inserted
BOUNDARY_BORDER = "#54278f"  # the model-boundary casts of fxamp.compile


def _tensors(val: Any) -> list[torch.Tensor]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def runs_in(node: fx.Node) -> Optional[str]:
    """The dtype a node computes in, as explain() writes it: "float8" for a float8 GEMM, else
    the dtype of its (first floating) output; None when it has no floating output."""
    if is_float8_gemm(node):
        return FLOAT8
    floating = [t for t in _tensors(node.meta.get("val")) if t.is_floating_point()]
    return short_dtype(floating[0].dtype) if floating else None


def _stack(node: fx.Node) -> Optional[dict]:
    return node.meta.get("nn_module_stack") or node.meta.get(FWD_NN_MODULE_STACK)


def _layers(node: fx.Node) -> list[tuple[str, str, str]]:
    """(layer name, module path, class name) of each module around `node`, outermost first;
    a layer is named by its path relative to the layer it sits in ("h.0" inside "transformer")."""
    layers, parent = [], ""
    for path, type_name in reversed(list(module_chain(_stack(node)))):
        if not path or path == parent:
            continue
        name = path[len(parent) + 1:] if parent and path.startswith(parent + ".") else path
        layers.append((name.replace("/", "_"), path, type_name))
        parent = path
    return layers


def namespace(node: fx.Node) -> str:
    """The Model Explorer namespace of `node`: its modules as nested layers, "transformer/h.0"."""
    return "/".join(name for name, _, _ in _layers(node))


def _common(namespaces: Iterable[str]) -> str:
    split = [ns.split("/") if ns else [] for ns in namespaces]
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return "/".join(common)


def _op_name(node: fx.Node) -> str:
    if is_float8_gemm(node):
        return node.meta[FLOAT8_META].op
    target = node.target
    name = str(target) if isinstance(target, OpOverload) else getattr(target, "__name__",
                                                                        str(target))
    return name.replace("aten.", "").replace(".default", "")


def _label(node: fx.Node, name: Optional[str] = None) -> str:
    """What Model Explorer shows and searches: an op is named with its module path, so that a
    model's thirteen Linears are told apart in the node table ("linear (encoder.layer.0...)");
    `name` replaces the op's (by its node's) where that is not enough."""
    decision = node.meta.get(FXAMP_META)
    if decision is not None and decision.inserted:
        return node.name  # named after what it casts and to which dtype: "fc1_weight_bf16"
    if decision is not None and decision.boundary:
        return f"boundary cast to {runs_in(node) or '-'}"
    if node.op in ("placeholder", "output"):
        return node.name if node.op == "placeholder" else "output"
    notes = ["float8"] if is_float8_gemm(node) else []
    layers = _layers(node)
    if layers:
        notes.append(layers[-1][1])
    label = name or _op_name(node)
    return f"{label} ({', '.join(notes)})" if notes else label


def _labels(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    # an op that occurs twice in one module (attention's two matmuls) is named by its node
    labels = {n: _label(n) for n in nodes}
    counts: dict[str, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    return {n: _label(n, n.name) if counts[label] > 1 and n.op == "call_function" else label
            for n, label in labels.items()}


def _type_of(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return short_dtype(val.dtype) + "[" + ",".join(str(s) for s in val.shape) + "]"
    return type(val).__name__ if val is not None else "-"


def _attrs(node: fx.Node) -> list[dict[str, str]]:
    attrs = {"op": str(node.target) if node.op == "call_function" else node.op,
             "runs in": runs_in(node) or "-",
             "output": ", ".join(_type_of(t) for t in _tensors(node.meta.get("val"))) or "-"}
    decision = node.meta.get(FXAMP_META)
    if decision is not None:
        attrs["input dtypes before fxamp's casts"] = ",".join(short_dtype(d) for d in decision.input_dtypes
                                   if d is not None) or "-"
        attrs["policy"] = decision.policy.value
        attrs["why"] = decision.reason
        if decision.inserted:
            attrs["fxamp"] = "cast inserted by fxamp"
        elif decision.boundary:
            attrs["fxamp"] = "model-boundary cast of fxamp.compile"
    choice = node.meta.get(FLOAT8_META)
    if choice is not None:
        attrs["float8"] = ("runs in float8: " if choice.float8 else "stays: ") + choice.reason
    layers = _layers(node)
    if layers:
        attrs["module"] = f"{layers[-1][1]} ({layers[-1][2]})"
    line = source_line(node.meta.get("stack_trace"))
    if line:
        attrs["source"] = line
    return [{"key": k, "value": v} for k, v in attrs.items()]


def _style(node: fx.Node) -> Optional[dict[str, str]]:
    decision = node.meta.get(FXAMP_META)
    style = {}
    colour = DTYPE_COLOURS.get(runs_in(node) or "")
    if colour:
        style["backgroundColor"] = colour
    if decision is not None and decision.inserted:
        style["borderColor"] = CAST_BORDER
    elif decision is not None and decision.boundary:
        style["borderColor"] = BOUNDARY_BORDER
    return style or None


def _bodies(gm: fx.GraphModule, node: fx.Node) -> list[str]:
    """The get_attr names of the bodies a higher-order op node runs."""
    spec = hop_spec(node.target) if node.op == "call_function" else None
    return [a.target for a in node.args if spec is not None and isinstance(a, fx.Node)
            and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)]


def _node_json(gm: fx.GraphModule, node: fx.Node, graph_id: str, ns: str,
               label: str) -> dict[str, Any]:
    shown = [n for n in node.all_input_nodes if not _is_body(gm, n)]
    out: dict[str, Any] = {
        "id": node.name, "label": label, "namespace": ns, "attrs": _attrs(node),
        "incomingEdges": [{"sourceNodeId": n.name, "sourceNodeOutputId": "0",
                           "targetNodeInputId": str(i)} for i, n in enumerate(shown)],
        "outputsMetadata": [{"id": str(i), "attrs": [{"key": "tensor_shape",
                                                      "value": _type_of(t)}]}
                            for i, t in enumerate(_tensors(node.meta.get("val")))]}
    bodies = _bodies(gm, node)
    if bodies:
        out["subgraphIds"] = [f"{graph_id}/{b}" for b in bodies]
    style = _style(node)
    if style:
        out["style"] = style
    return out


def _is_body(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule)


def _namespaces(gm: fx.GraphModule) -> dict[fx.Node, str]:
    # A graph input (a weight, the batch) goes into the innermost layer all its users share,
    # so that a layer holds its own weights and the top level stays readable.
    spaces = {n: namespace(n) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    for n in gm.graph.find_nodes(op="placeholder"):
        spaces[n] = _common(spaces.get(u, "") for u in n.users) if n.users else ""
    spaces[next(iter(gm.graph.find_nodes(op="output")))] = ""
    return spaces


def _group_attrs(gm: fx.GraphModule) -> dict[str, dict[str, str]]:
    groups = {}
    for node in gm.graph.nodes:
        names = []
        for name, path, type_name in _layers(node):
            names.append(name)
            groups["/".join(names)] = {"module": path, "class": type_name}
    return groups


def graph_json(gm: fx.GraphModule, graph_id: str,
               info: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """`gm` as Model Explorer graphs: its own, then one per higher-order op body (linked from
    the op's node as a subgraph, id "<graph_id>/<body>"). `info` is shown when no node is
    selected."""
    spaces = _namespaces(gm)
    labels = _labels([n for n in gm.graph.nodes if not _is_body(gm, n)])
    nodes = [_node_json(gm, n, graph_id, spaces[n], label) for n, label in labels.items()]
    groups = {"": dict(info or {}), **_group_attrs(gm)}
    graphs = [{"id": graph_id, "nodes": nodes, "groupNodeAttributes": groups}]
    for node in gm.graph.nodes:
        for body in _bodies(gm, node):
            graphs += graph_json(getattr(gm, body), f"{graph_id}/{body}")
    return graphs


def legend() -> str:
    """The colours, in words, for the graph's info panel."""
    fills = ", ".join(f"{dtype} {colour}" for dtype, colour in DTYPE_COLOURS.items())
    return (f"fill by the dtype a node runs in: {fills}; border {CAST_BORDER}: a cast fxamp "
            f"inserted, {BOUNDARY_BORDER}: a model-boundary cast")
