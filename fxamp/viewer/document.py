"""`GraphView`: an explanation's graphs and overlays as one JSON document, saved and loaded.

The file is Model Explorer's graph collection JSON (`{"label": ..., "graphs": [...]}`, which
Model Explorer's own JSON loader opens) with fxamp's overlays under the extra key "fxamp",
which `python -m fxamp view FILE` hands to Model Explorer as node data. Plain JSON: writing
and reading it needs neither Model Explorer nor the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Optional

from fxamp.debug.report import OverflowReport
from fxamp.errors import ConfigError
from fxamp.planner.plan import PrecisionPlan
from fxamp.viewer.graph import graph_json, legend
from fxamp.viewer.overlays import (LEGEND, GraphIndex, Overlay, block_scale_overlay,
                                   dtype_overlay, float8_scale_overlay, headroom_overlays,
                                   overflow_overlay, plan_overlays)
from fxamp.viewer.saved import FORMAT_VERSION, check_writable, read_view

from fxamp.viewer.server import Viewer, show

if TYPE_CHECKING:
    from fxamp.explain import Explanation

__all__ = ["GraphView", "graph_view", "FORMAT_VERSION"]


@dataclasses.dataclass(frozen=True)
class GraphView:
    """Model Explorer graphs (`graphs`, its JSON) and node data overlays (`overlays`: name and
    Model Explorer node data JSON), titled `label`. `save()` writes it, `load()` reads it,
    `view()` shows it."""

    label: str
    graphs: tuple[dict[str, Any], ...]
    overlays: tuple[dict[str, Any], ...] = ()

    def overlay(self, name: str) -> dict[str, Any]:
        """The node data of the overlay called `name`."""
        for o in self.overlays:
            if o["name"] == name:
                return o["nodeData"]
        raise KeyError(f"no overlay {name!r}; there are {[o['name'] for o in self.overlays]}")

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps({"label": self.label, "graphs": list(self.graphs),
                           "fxamp": {"version": FORMAT_VERSION, "overlays": list(self.overlays)}},
                          indent=indent)

    def save(self, path: str) -> str:
        """Write the view to `path` (JSON); returns the absolute path."""
        path = check_writable(path)
        with open(path, "w") as f:
            f.write(self.to_json())
        return path

    @classmethod
    def load(cls, path: str) -> "GraphView":
        """A view `save()` wrote (ConfigError, naming the problem, for any other file)."""
        data = read_view(path)
        return cls(data["label"], tuple(data["graphs"]), tuple(data["fxamp"]["overlays"]))

    def view(self, **options: Any) -> Viewer:
        """Show it in Model Explorer (`fxamp.viewer.show`, which takes the options)."""
        return show(self, **options)


def _add_notes(graphs: list[dict], overlays: list[Overlay]) -> None:
    # An overlay's words for a node go into that node's attributes (the side panel).
    nodes = {(g["id"], n["id"]): n for g in graphs for n in g["nodes"]}
    for overlay in overlays:
        for gid, by_node in overlay.notes.items():
            for node_id, text in by_node.items():
                if (gid, node_id) in nodes:
                    nodes[gid, node_id]["attrs"].append({"key": overlay.name, "value": text})


def _overlays(report: "Explanation", index: GraphIndex, overflow: Optional[OverflowReport],
              plan: Optional[PrecisionPlan]) -> list[Overlay]:
    # Model Explorer colours the graph by the last overlay shown: the dtypes, which the graph
    # is about, unless a locate_overflow report asks for its culprit.
    overlays = []
    if plan is not None:
        overlays += plan_overlays(plan, index)
    if report.ranges is not None:
        if report.config.float8 is not None:
            overlays.append(block_scale_overlay(report.ranges, index)
                            if report.config.float8.spec.block
                            else float8_scale_overlay(report.ranges, index))
        overlays += headroom_overlays(report.ranges, index)[::-1]
    overlays.append(dtype_overlay(index))
    if overflow is not None:
        overlays.append(overflow_overlay(overflow, index))
    return overlays


def graph_view(report: "Explanation", *, overflow: Optional[OverflowReport] = None,
               plan: Optional[PrecisionPlan] = None) -> GraphView:
    """The graphs of `report` (an `fxamp.explain` result) and the overlays of what was measured:
    its `ranges` (with `explain(..., ranges=True)`), a `locate_overflow` report and a
    `fxamp.plan` PrecisionPlan of the same model."""
    if overflow is not None and not isinstance(overflow, OverflowReport):
        raise ConfigError(f"overflow= takes what fxamp.locate_overflow returns, not "
                          f"{type(overflow).__name__}")
    if plan is not None and not isinstance(plan, PrecisionPlan):
        raise ConfigError(f"plan= takes a fxamp.plan(...) PrecisionPlan, not "
                          f"{type(plan).__name__}")
    index = GraphIndex([g.graph_module for g in report.graphs], report.backward_graphs)
    overlays = _overlays(report, index, overflow, plan)
    info = {"fxamp": report.headline.replace("\n", " | "), "colours": legend(),
            "overlays": LEGEND,
            **{o.name: o.info for o in overlays if o.info}}
    graphs = [g for i, cg in enumerate(report.graphs)
              for g in graph_json(cg.graph_module, f"forward {i}", info)]
    graphs += [g for i, gm in enumerate(report.backward_graphs)
               for g in graph_json(gm, f"backward {i}")]
    _add_notes(graphs, overlays)
    return GraphView(report.headline.splitlines()[0], tuple(graphs),
                     tuple({"name": o.name, "nodeData": o.node_data()} for o in overlays
                           if o.results))
