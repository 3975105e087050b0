"""What fxamp measured, as Model Explorer node data: one value (and colour) per node of a graph.

Each overlay is built from data fxamp already has, keyed to the nodes of the graphs `explain()`
shows: the dtype each node runs in; fp16 headroom (65504 / max|x|) from `range_stats`; the op
`locate_overflow` found; the planner's per-GEMM errors, modeled times and choices; the float8
scales the example batch gives (a block-scaled GEMM's: the spread of its block scales). Rows
measured on the graphs AOTAutograd derived name the node of fxamp's graph they come from
(`source_node`); the planner's GEMMs are matched by module, op and rank (a float8 GEMM is a new
node with a new name).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx

from fxamp.debug.ranges import FP16_MAX, NEAR_MAX, RangeTable
from fxamp.debug.report import OverflowReport
from fxamp.float8.config import RECIPES
from fxamp.float8.scaling import amax_to_scale
from fxamp.passes.float8 import FLOAT8_META, is_float8_gemm
from fxamp.passes.float8_operands import GEMM_OPS
from fxamp.passes.hops import policy_bodies
from fxamp.planner.plan import PlannedGemm, PrecisionPlan
from fxamp.provenance import module_of
from fxamp.viewer.graph import DTYPE_COLOURS, FLOAT8, runs_in

__all__ = ["Overlay", "GraphIndex", "dtype_overlay", "headroom_overlays", "overflow_overlay",
           "plan_overlays", "float8_scale_overlay", "block_scale_overlay", "RED", "YELLOW",
           "WHITE", "OVERFLOW", "LEGEND"]

# An overlay's colours say how bad, in hues no dtype has (graph.DTYPE_COLOURS): a node coloured
# by an overlay must never pass for one running in some dtype. Nothing to see is white.
RED, YELLOW, WHITE = "#e31a1c", "#ffff33", "#ffffff"
LEGEND = (f"node data providers (right): the one whose eye is open colours the graph, click "
          f"another's to switch; red {RED}: bad, yellow {YELLOW}: close, white: nothing to see")
OVERFLOW = "first inf or NaN"  # overlay names: no "/" (Model Explorer splits its sources on it)
_ANY = 1e300  # the last threshold: every value at or below it (JSON has no infinity)
_PRECISION_COLOURS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


@dataclasses.dataclass(frozen=True)
class Overlay:
    """One node data set: `results[graph_id][node_id]` is `{"value": ..., "bgColor": ...}`;
    `notes` the same nodes' words for their side panel; `info` a line for the graph's."""

    name: str
    results: dict[str, dict[str, dict[str, Any]]]
    thresholds: tuple[tuple[float, str], ...] = ()
    notes: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    info: str = ""

    def node_data(self) -> dict[str, Any]:
        """Model Explorer's node data JSON (a `ModelNodeData`): one entry per graph id."""
        thresholds = [{"value": v, "bgColor": c} for v, c in self.thresholds]
        return {gid: {"results": res, **({"thresholds": thresholds} if thresholds else {})}
                for gid, res in self.results.items()}


class GraphIndex:
    """The nodes of `explain()`'s graphs by (Dynamo graph index, node name), with the id of the
    Model Explorer graph that shows each (a higher-order op's body has a graph of its own)."""

    def __init__(self, forward: list[fx.GraphModule], backward: list[fx.GraphModule] = ()):
        self.nodes: dict[tuple[int, str], tuple[str, fx.Node]] = {}
        self.graphs: list[tuple[str, fx.GraphModule]] = []
        for i, gm in enumerate(forward):
            self._add(i, gm, f"forward {i}")
        for i, gm in enumerate(backward):
            self.graphs.append((f"backward {i}", gm))

    def _add(self, index: int, gm: fx.GraphModule, graph_id: str) -> None:
        self.graphs.append((graph_id, gm))
        for node in gm.graph.nodes:
            self.nodes.setdefault((index, node.name), (graph_id, node))
        for name, body in gm.named_children():
            if isinstance(body, fx.GraphModule) and body in policy_bodies(gm):
                self._add(index, body, f"{graph_id}/{name}")

    def forward_nodes(self) -> Iterator[tuple[int, str, fx.Node]]:
        """(Dynamo graph index, Model Explorer graph id, node) of every forward node."""
        for (index, _), (gid, node) in self.nodes.items():
            yield index, gid, node

    def find(self, index: int, name: str) -> Optional[tuple[str, fx.Node]]:
        return self.nodes.get((index, name)) if name else None


def _put(table: dict, gid: str, node_id: str, value: Any) -> None:
    table.setdefault(gid, {})[node_id] = value


def _num(x: float) -> float:
    return float(f"{x:.3g}")


# ----------------------------------------------------------------------------------- dtypes
def dtype_overlay(index: GraphIndex) -> Overlay:
    """The dtype every node runs in, in its colour (the graph's own fill, as a table)."""
    results: dict = {}
    for gid, gm in index.graphs:
        for node in gm.graph.nodes:
            dtype = runs_in(node)
            if dtype is not None:
                entry = {"value": dtype}
                if dtype in DTYPE_COLOURS:
                    entry["bgColor"] = DTYPE_COLOURS[dtype]
                _put(results, gid, node.name, entry)
    return Overlay("runs in", results)


# ----------------------------------------------------------------------------- range_stats
def _headroom(max_abs: float, nonfinite: bool) -> Optional[float]:
    if nonfinite or math.isinf(max_abs):
        return 0.0
    return None if max_abs == 0 else _num(FP16_MAX / max_abs)


_HEADROOM_THRESHOLDS = ((1.0, RED), (16.0, YELLOW), (_ANY, WHITE))


def _headroom_overlay(name: str, worst: dict, index: GraphIndex, what: str) -> Overlay:
    results, notes = {}, {}
    for (graph, source), (max_abs, nonfinite) in worst.items():
        found = index.find(graph, source)
        value = _headroom(max_abs, nonfinite)
        if found is None or value is None:
            continue
        gid, node = found
        _put(results, gid, node.name, {"value": value})
        _put(notes, gid, node.name, f"{what} max|x| {max_abs:.4g}: 65504 / max|x| = {value:g}"
             + (" (inf/NaN)" if nonfinite else ""))
    return Overlay(name, results, _HEADROOM_THRESHOLDS, notes)


def headroom_overlays(table: RangeTable, index: GraphIndex) -> list[Overlay]:
    """fp16 headroom of each op's output (its last value in the forward) and of the gradients
    its backward computes (the largest): red at or above 65504, yellow within 16x of it, white
    further.

    A float8 GEMM's backward is left out: it scales its operands to the float8 range on
    purpose, which is no fp16 risk."""
    outputs: dict = {}
    grads: dict = {}
    for row in table.rows:
        key = (row.graph, row.source_node)
        bad = row.nonfinite > 0
        if row.phase == "forward":
            outputs[key] = (row.max_abs, bad)  # rows run in order: the op's output is last
        else:
            found = index.find(*key)
            if found is None or is_float8_gemm(found[1]):
                continue
            old = grads.get(key, (0.0, False))
            grads[key] = (max(old[0], row.max_abs), old[1] or bad)
    scale = f" at loss scale {table.loss_scale:g}" if table.loss_scale != 1 else ""
    return [_headroom_overlay("fp16 headroom", outputs, index, "output"),
            _headroom_overlay("fp16 headroom, gradients", grads, index,
                              f"gradients{scale}:")]


# -------------------------------------------------------------------------- locate_overflow
def overflow_overlay(report: OverflowReport, index: GraphIndex) -> Overlay:
    """The op that produced the first inf/NaN (its forward op for a backward culprit), red."""
    if not report.found:
        return Overlay(OVERFLOW, {}, info="none: every value was finite")
    site = report.site
    found = index.find(site.graph, site.source_node)
    info = f"{site.headline}; {site.suggestion}"
    if found is None:
        return Overlay(OVERFLOW, {}, info=info)
    gid, node = found
    value = "its backward" if site.phase == "backward" else "here"
    return Overlay(OVERFLOW, {gid: {node.name: {"value": value, "bgColor": RED}}},
                   notes={gid: {node.name: f"{site.headline}: {site.op} ({site.node}); "
                                           f"{site.suggestion}"}}, info=info)


# ---------------------------------------------------------------------------------- planner
def _gemm_op(node: fx.Node) -> Optional[str]:
    choice = node.meta.get(FLOAT8_META)
    if is_float8_gemm(node):
        return choice.op
    return GEMM_OPS.get(node.target) if node.op == "call_function" else None


def _ranked(keys: Iterator[tuple]) -> Iterator[tuple]:
    seen: dict = {}
    for key in keys:
        seen[key] = seen.get(key, -1) + 1
        yield (*key, seen[key])


def _gemm_nodes(index: GraphIndex) -> dict[tuple, tuple[str, fx.Node]]:
    # (graph, module, op, rank among that module's GEMMs of that op) -> node
    found = [(i, gid, n) for i, gid, n in index.forward_nodes() if _gemm_op(n)]
    keys = ((i, module_of(n.meta.get("nn_module_stack"))[0] or "<root>", _gemm_op(n))
            for i, _, n in found)
    return {key: (gid, n) for key, (_, gid, n) in zip(_ranked(keys), found)}


_OPS_BY_NAME = {str(op): short for op, short in GEMM_OPS.items()}


def _site_keys(plan: PrecisionPlan) -> list[tuple]:
    return list(_ranked((s.graph, s.module, _OPS_BY_NAME.get(s.op, s.op)) for s in plan.sites))


def _plan_note(s: PlannedGemm) -> str:
    errors = ", ".join(f"{c} {e:.3g}" for c, e in s.errors)
    times = ", ".join(f"{p} {t * 1e6:.1f} us" for p, t in s.times)
    reason = s.reason  # the planner's reasons start with the precision they chose
    if not reason.startswith(f"{s.precision}:"):
        reason = f"{s.precision}: {reason}"
    return f"{reason} | errors vs fp32: {errors} | modeled: {times}"


def plan_overlays(plan: PrecisionPlan, index: GraphIndex) -> list[Overlay]:
    """The precision the plan chose per GEMM, the error of its 16-bit dtype (red above the
    budget) and the modeled time of the chosen precision, in microseconds a step."""
    gemms = _gemm_nodes(index)
    chosen, errors, times, notes = {}, {}, {}, {}
    for key, s in zip(_site_keys(plan), plan.sites):
        if key not in gemms:
            continue
        gid, node = gemms[key]
        colour = DTYPE_COLOURS[_PRECISION_COLOURS.get(s.precision, FLOAT8)]
        _put(chosen, gid, node.name, {"value": s.precision, "bgColor": colour})
        error = s.error(plan.dtype)
        _put(errors, gid, node.name, {"value": _num(min(error, _ANY))})
        if s.time(s.precision) is not None:
            _put(times, gid, node.name, {"value": _num(s.time(s.precision) * 1e6)})
        _put(notes, gid, node.name, _plan_note(s))
    budget = ((plan.error_budget, WHITE), (_ANY, RED))
    return [Overlay("plan precision", chosen, notes=notes),
            Overlay(f"plan {plan.dtype} error", errors, budget),
            Overlay("plan modeled us", times)]


# ------------------------------------------------------------------------------- float8
def float8_scale_overlay(table: RangeTable, index: GraphIndex) -> Overlay:
    """Each float8 GEMM's input scale on the example batch: float8 max / max|input| (rounded
    down to a power of two for the rowwise recipes, whose smallest row scale it is)."""
    amax = {(r.graph, r.source_node): r.max_abs for r in table.rows if r.phase == "forward"}
    results, notes = {}, {}
    for graph, gid, node in index.forward_nodes():
        if not is_float8_gemm(node) or RECIPES[node.args[3]].block:  # block_scale_overlay
            continue
        recipe = RECIPES[node.args[3]]
        scales = [_scale(amax.get((graph, a.name)), recipe.input, recipe.pow2_scales)
                  if isinstance(a, fx.Node) else None for a in node.args[:2]]
        words = [f"{role} " + (f"amax {amax[(graph, a.name)]:.4g} -> scale {s:.4g}"
                               if s is not None else "not measured (a graph input)")
                 for role, a, s in zip(("input", "weight"), node.args[:2], scales)]
        _put(notes, gid, node.name, f"{recipe.name}: " + "; ".join(words))
        if scales[0] is not None:
            _put(results, gid, node.name, {"value": _num(scales[0])})
    return Overlay("float8 input scale", results, notes=notes)


def _scale(amax: Optional[float], dtype: torch.dtype, pow2: bool) -> Optional[float]:
    if amax is None or not math.isfinite(amax):
        return None
    return float(amax_to_scale(torch.tensor(amax), dtype, pow2))


def block_scale_overlay(table: RangeTable, index: GraphIndex) -> Overlay:
    """Each block-scaled GEMM's share of blocks whose scale is at the format's floor, the worst
    of its operands (red where any is: values there lose bits or flush), each operand's range
    of block scales in its notes (`RangeTable.block_scales`)."""
    results, notes, worst = {}, {}, {}
    for row in table.block_scales:
        found = index.find(row.graph, row.node)
        if found is None:
            continue
        gid, node = found
        worst[gid, node.name] = max(row.at_floor, worst.get((gid, node.name), 0.0))
        _put(results, gid, node.name, {"value": _num(100 * worst[gid, node.name])})
        words = notes.setdefault(gid, {}).get(node.name)
        _put(notes, gid, node.name,
             (f"{words}; " if words else f"{row.recipe}: ") + row.describe())
    return Overlay("block scales at floor pct", results, ((0.0, WHITE), (_ANY, RED)), notes)

