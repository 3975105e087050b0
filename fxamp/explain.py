"""explain(): what fxamp did to a model, built from the passes' own annotations."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fxamp._compat import aot_autograd, dynamo_counters, make_boxed_func, pytree
from fxamp.backend import CompiledGraph
from fxamp.config import AmpConfig
from fxamp.model.eager_regions import eager_policy, untraced_modules
from fxamp.debug.ranges import range_stats
from fxamp.debug.report import OverflowReport
from fxamp.passes.annotate import FXAMP_META, short_dtype
from fxamp.passes.float8 import FLOAT8_META, GemmChoice, is_float8_gemm
from fxamp.passes.hops import policy_bodies
from fxamp.passes.printing import format_graph
from fxamp.provenance import module_of
from fxamp.model.prepare import CompileSettings, prepare, requested_config
from fxamp.policy import CastPolicy
from fxamp.planner.plan import PrecisionPlan
from fxamp.policy.rules import is_compute_op
from fxamp.viewer import GraphView, Viewer, graph_view, show

__all__ = ["explain", "Explanation", "OpRow"]

_FP32 = (CastPolicy.FP32, CastPolicy.FP32_SET_OPT_DTYPE)  # OpRow.policy is the value string


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One compute op: where it is, the policy applied and why, and its dtypes."""

    graph: int
    op: str
    module: str
    policy: str
    reason: str
    inputs: str
    output: str


@dataclasses.dataclass
class Explanation:
    """The report `fxamp.explain` returns; `str()` prints it, the fields are for code."""

    config: AmpConfig
    graphs: list[CompiledGraph]
    backward_graphs: list[fx.GraphModule]
    rows: list[OpRow]
    graph_breaks: int
    break_reasons: list[str]
    ranges: Optional[Any] = None  # a fxamp.debug.RangeTable, with explain(ranges=True)
    eager_modules: list[str] = dataclasses.field(default_factory=list)  # not traced (RNNs)
    gemms: list[GemmChoice] = dataclasses.field(default_factory=list)  # with float8=...

    @property
    def float8_flop_share(self) -> float:
        """The share of the GEMM FLOPs (forward, 2*M*K*N each) that run in float8."""
        total = sum(g.flops for g in self.gemms)
        return sum(g.flops for g in self.gemms if g.float8) / total if total else 0.0

    @property
    def casts_inserted(self) -> int:
        return sum(g.stats.casts_inserted for g in self.graphs)

    @property
    def boundary_casts(self) -> int:
        """Casts of the model's inputs and outputs (fxamp.compile, O0/O2/O3)."""
        return sum(n.meta.get(FXAMP_META) is not None and n.meta[FXAMP_META].boundary
                   for g in self.graphs for n in g.graph_module.graph.nodes)

    @property
    def ops_in_fp32(self) -> int:
        return sum(r.output == "f32" and r.policy in _FP32
                   for r in self.rows)

    def gemm_report(self) -> str:
        """Every GEMM, whether it runs in float8 and why, and the float8 share of GEMM FLOPs."""
        f8 = self.config.float8
        title = "no float8" if f8 is None else f"float8 {f8.recipe}, {f8.scaling} scaling"
        return "\n".join([f"== GEMMs ({title}) ==", _gemm_table(self.gemms),
                          f"float8: {sum(g.float8 for g in self.gemms)} of {len(self.gemms)} "
                          f"GEMMs, {100 * self.float8_flop_share:.1f} % of GEMM FLOPs"])

    @property
    def headline(self) -> str:
        """The report's first two lines: the resolved config, then the totals."""
        c = self.config
        return (f"fxamp {c.opt_level} | dtype {short_dtype(c.dtype)} | policy {c.policy} | "
                f"device {c.device_type}\n"
                f"graphs: {len(self.graphs)} | graph breaks: {self.graph_breaks} | "
                f"casts inserted: {self.casts_inserted} (+{self.boundary_casts} at the model "
                f"boundary) | ops kept in fp32: {self.ops_in_fp32}")

    def graph_view(self, *, overflow: Optional[OverflowReport] = None,
                   plan: Optional[PrecisionPlan] = None) -> GraphView:
        """The graphs and overlays Model Explorer shows (`fxamp.viewer.graph_view`): the
        dtypes, the value ranges with `ranges=True`, and a `locate_overflow` report or a
        `fxamp.plan` plan of the same model, if given."""
        return graph_view(self, overflow=overflow, plan=plan)

    def save(self, path: str, *, overflow: Optional[OverflowReport] = None,
             plan: Optional[PrecisionPlan] = None) -> str:
        """Write the graph view to `path` (JSON, no viewer needed), for `python -m fxamp view
        PATH` later or elsewhere; returns the absolute path."""
        return self.graph_view(overflow=overflow, plan=plan).save(path)

    def view(self, *, overflow: Optional[OverflowReport] = None,
             plan: Optional[PrecisionPlan] = None, **options: Any) -> Viewer:
        """Show the graphs after fxamp in Google's Model Explorer, on a server on 127.0.0.1:
        grouped by module, every node in the colour of the dtype it runs in, fxamp's casts
        outlined, each node's policy and why in its side panel, and the overlays of
        `graph_view`. Needs `pip install "fxamp[viewer]"` (ImportError saying so otherwise).

        Args:
            overflow, plan: as for `graph_view`.
            **options: `port`, `open_browser` (True), `wait` (True: until Ctrl+C; False
                returns the running Viewer, stopped by `.stop()` or a `with` block),
                `timeout`; see `fxamp.viewer.show`.
        """
        return show(self.graph_view(overflow=overflow, plan=plan), **options)

    def __str__(self) -> str:
        c = self.config
        out = self.headline.splitlines()
        out += [f"  break: {r.splitlines()[0]}" for r in self.break_reasons]
        if self.eager_modules:
            out += [f"!! run eagerly, not traced by Dynamo: {', '.join(self.eager_modules)}; "
                    f"they get {eager_policy(c)}"]
        for i, g in enumerate(self.graphs):
            out += ["", f"== forward graph {i} (after fxamp) ==", format_graph(g.graph_module)]
        for i, g in enumerate(self.backward_graphs):
            out += ["", f"== backward graph {i} ==", format_graph(g, marks=False)]
        out += ["", "== compute ops ==", _table(self.rows)]
        if c.float8 is not None:
            out += ["", self.gemm_report()]
        if self.ranges is not None:
            out += ["", "== value ranges ==", str(self.ranges)]
        return "\n".join(out)


def _table(rows: list[OpRow]) -> str:
    header = ("op", "module", "policy", "inputs -> output", "why")
    body = [(r.op, r.module, r.policy, f"{r.inputs} -> {r.output}", r.reason) for r in rows]
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(4)]
    fmt = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + row[4]
    return "\n".join([fmt(header), *(fmt(r) for r in body)])


def _gemm_table(gemms: list[GemmChoice]) -> str:
    header = ("op", "module", "[B*]M x K x N", "runs in", "why")
    body = [(g.op, g.module, _gemm_shape(g),
             "float8" if g.float8 else "-", g.reason) for g in gemms]
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(4)]
    fmt = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + row[4]
    return "\n".join([fmt(header), *(fmt(r) for r in body)])


def _gemm_shape(g: GemmChoice) -> str:
    if g.shape is None:
        return "-"
    return (f"{g.batch}*" if g.batch else "") + "x".join(map(str, g.shape))


def _gemms(gm: fx.GraphModule) -> list[GemmChoice]:
    return [n.meta[FLOAT8_META] for n in gm.graph.nodes if FLOAT8_META in n.meta]


def _op_name(node: fx.Node) -> str:
    if is_float8_gemm(node):
        return f"{node.meta[FLOAT8_META].op} (float8)"
    return str(node.target).replace("aten.", "")


def _rows(index: int, gm: fx.GraphModule) -> list[OpRow]:
    rows = []
    for node in gm.graph.nodes:
        decision = node.meta.get(FXAMP_META)
        if node.op != "call_function" or decision is None or decision.inserted:
            continue
        compute = is_compute_op(node.target) or is_float8_gemm(node)
        if not compute or not any(d is not None and d.is_floating_point
                                                     for d in decision.input_dtypes):
            continue
        module = module_of(node.meta.get("nn_module_stack"))[0]
        val = node.meta.get("val")
        inputs = ",".join(short_dtype(d) for d in decision.input_dtypes if d is not None)
        output = short_dtype(val.dtype) if isinstance(val, torch.Tensor) else "-"
        rows.append(OpRow(index, _op_name(node), module or "<root>",
                          decision.policy.value, decision.reason, inputs, output))
    return rows


class _Recorder:
    def __init__(self):
        self.backward: list[fx.GraphModule] = []

    def forward(self, gm, example_inputs):
        return make_boxed_func(gm.forward)

    def record_backward(self, gm, example_inputs):
        self.backward.append(gm)
        return make_boxed_func(gm.forward)


def explain(model_or_fn: Callable, *example_inputs: Any, opt_level: Optional[str] = None,
            backward: bool = False, config: Optional[AmpConfig] = None,
            ranges: bool = False, **overrides: Any) -> Explanation:
    """Run `model_or_fn(*example_inputs)` under fxamp (eagerly, no Inductor) and report.

    A module is deep-copied first, so the caller's model is never cast or compiled; one that
    `fxamp.compile` prepared is explained with its own config (then pass none).

    Args:
        model_or_fn: an nn.Module or a function of tensors.
        *example_inputs: inputs to run it on once.
        opt_level, config, **overrides: as for `fxamp.compile` (O1 unless given; config and
            opt_level/overrides together are refused).
        backward: also run backward on the sum of the floating outputs and record the
            backward graphs AOTAutograd derived from the transformed forward.
        ranges: also measure every op's values on `example_inputs` against the fp16 limits
            (`fxamp.debug.range_stats`; gradients too with `backward`), in `.ranges`.

    Returns:
        An Explanation: print it, or read `.rows`, `.casts_inserted`, `.graph_breaks`.
    """
    recorder = _Recorder()
    inner = aot_autograd(fw_compiler=recorder.forward, bw_compiler=recorder.record_backward)
    prepared = prepare(model_or_fn, requested_config(config, opt_level, overrides,
                                                     "fxamp.explain"),
                       settings=CompileSettings(compiler=inner), in_place=False)
    # Note [Counting graph breaks without a reset]: torch._dynamo.explain resets Dynamo, which
    # throws away every compiled graph in the process (a training loop would recompile after
    # each explain()). Dynamo also counts every break it takes, by reason, in a process-wide
    # counter; the difference across this one run is this run's breaks. The copy and the
    # fresh backend compile afresh, so nothing is served from a cache.
    breaks_before = collections.Counter(dynamo_counters["graph_break"])
    outputs = prepared(*example_inputs)
    if backward:
        floats = [o for o in pytree.tree_leaves(outputs)
                  if isinstance(o, torch.Tensor) and o.is_floating_point() and o.requires_grad]
        sum(o.float().sum() for o in floats).backward()
    breaks = collections.Counter(dynamo_counters["graph_break"]) - breaks_before
    reasons = [reason for reason, n in breaks.items() for _ in range(n)]
    graphs = prepared.graphs
    rows = [row for i, g in enumerate(graphs)
            for gm in (g.graph_module, *policy_bodies(g.graph_module)) for row in _rows(i, gm)]
    table = None
    if ranges:
        table = range_stats(model_or_fn, [example_inputs], backward=backward, config=config,
                            opt_level=opt_level, **overrides)
    eager = untraced_modules(model_or_fn) if isinstance(model_or_fn, torch.nn.Module) else []
    gemms = [g for cg in graphs for gm in (cg.graph_module, *policy_bodies(cg.graph_module))
             for g in _gemms(gm)]
    return Explanation(prepared.config, graphs, recorder.backward, rows,
                       len(reasons), reasons, table, eager, gemms)
