"""Run the graphs fxamp produced node by node, and say where each node came from.

`InstrumentingCompiler` is an inner compiler for `FxampBackend`: it hands the transformed
pre-dispatch graph to AOTAutograd exactly as `compiler="aot_eager"` does (same partitioner, so
the same forward and backward graphs, casts and dtypes) and then runs both graphs under an
`fx.Interpreter` that shows every value to `visit`. Nothing here changes a graph.

Note [Mapping backward nodes to the forward]: AOTAutograd copies the forward node's `seq_nr`
and `stack_trace` onto the backward nodes it derives from it (`fwd_nn_module_stack` too), and
records on each forward node the pre-dispatch node it was traced from (`from_node`). So a
backward `mm` maps, through `seq_nr`, to the forward `addmm` and, through `from_node`, to the
`aten.linear` in `fc2` that fxamp annotated. Values a backward graph receives are either saved
forward values (same names as the forward nodes) or `tangents_i`, the gradients of outputs.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from fxamp import _compat
from fxamp._compat import make_boxed_func, pytree
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.passes.annotate import FXAMP_META, short_dtype
from fxamp.passes.insert_casts import is_fxamp_cast
from fxamp.model.prepare import CompileSettings, Prepared, prepare, requested_config
from fxamp.provenance import OpSite, module_of, source_line

__all__ = ["GraphRecord", "OpSite", "Origin", "InstrumentingCompiler", "origin_of", "readable",
           "tensors_of",
           "display_name", "describe_config",
           "prepare_private", "call_model", "default_loss", "backward"]

FORWARD, BACKWARD = "forward", "backward"


@dataclasses.dataclass
class GraphRecord:
    """One Dynamo graph: fxamp's pre-dispatch graph and what AOTAutograd derived from it."""

    index: int
    pre: fx.GraphModule
    forward: Optional[fx.GraphModule] = None
    backward: Optional[fx.GraphModule] = None
    by_seq_nr: dict[int, fx.Node] = dataclasses.field(default_factory=dict)
    pre_by_name: dict[str, fx.Node] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pre_by_name = {n.name: n for n in self.pre.graph.nodes}

    def set_graph(self, phase: str, gm: fx.GraphModule) -> None:
        setattr(self, phase, gm)
        if phase == FORWARD:
            for node in (n for n in gm.graph.nodes if n.op == "call_function"):
                self.by_seq_nr.setdefault(node.meta.get(_compat.SEQ_NR, -1), node)

    def input_name(self, node: fx.Node) -> str:
        """'fc1_weight' for the forward placeholder `primals_2` (fxamp's readable names)."""
        placeholders = list(self.pre.graph.find_nodes(op="placeholder"))
        ours = list(self.forward.graph.find_nodes(op="placeholder")) if self.forward else []
        if node in ours and len(ours) == len(placeholders):
            return placeholders[ours.index(node)].name
        return node.name


@dataclasses.dataclass(frozen=True)
class Origin(OpSite):
    """Where a node of a graph that ran comes from, in the user's terms."""

    module_type: str
    source_line: str  # "path/models.py:28 in forward: return self.fc2(...)"
    policy: str  # fxamp's policy for source_op, and why
    source_node: Optional[fx.Node] = dataclasses.field(default=None, repr=False, compare=False)


def _pre_node(node: fx.Node, record: GraphRecord) -> Optional[fx.Node]:
    for name in _compat.from_node_names(node):
        if name in record.pre_by_name:
            return record.pre_by_name[name]
    return None


def _policy(pre: Optional[fx.Node]) -> str:
    decision = pre.meta.get(FXAMP_META) if pre is not None else None
    return "" if decision is None else f"{decision.policy.value} ({decision.reason})"


def _target_name(target: Any) -> str:
    # An ATen op as torch prints it ("aten.linear.default"); a Python function that fxamp's
    # passes call (float8_linear) by its name, not its repr with an address
    return target.__name__ if isinstance(target, types.FunctionType) else str(target)


def origin_of(node: fx.Node, phase: str, record: GraphRecord) -> Origin:
    """The Origin of `node`, a node of `record`'s forward or backward graph."""
    forward = node
    if phase == BACKWARD and node.meta.get(_compat.PARTITIONER_TAG) != "is_forward":
        # Note [Mapping backward nodes to the forward]
        forward = record.by_seq_nr.get(node.meta.get(_compat.SEQ_NR, -2), node)
    pre = _pre_node(forward, record)
    stack = forward.meta.get("nn_module_stack") or node.meta.get(_compat.FWD_NN_MODULE_STACK)
    module, module_type = module_of(stack)
    op = str(node.target) if node.op == "call_function" else node.op
    if node.op == "placeholder":
        op = "input" if phase == FORWARD else \
            "tangent" if node.name.startswith("tangents") else "saved"
    return Origin(phase, record.index, node.name, op,
                  _target_name(pre.target) if pre is not None and pre.op == "call_function"
                  else "",
                  module, module_type,
                  source_line(node.meta.get("stack_trace") or forward.meta.get("stack_trace")),
                  _policy(pre), pre)


def display_name(node: fx.Node, phase: str, record: GraphRecord) -> str:
    """A node's name, with fxamp's name for graph inputs and the casts it inserted."""
    if node.op == "placeholder" and phase == FORWARD:
        name = record.input_name(node)
        return node.name if name == node.name else f"{node.name} ({name})"
    pre = _pre_node(node, record) if phase == FORWARD else None
    if pre is not None and pre.name != node.name and is_fxamp_cast(pre):
        return f"{node.name} ({pre.name})"
    return node.name


def describe_config(config: AmpConfig) -> str:
    """'O1 | dtype f16' ('O0 | fp32': O0 never uses the low dtype)."""
    if config.opt_level == "O0":
        return "O0 | fp32"
    return f"{config.opt_level} | dtype {short_dtype(config.dtype)}"


def readable(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, as the checks can read it: a float8 tensor (e4m3, e5m2, e8m0: a float8
    GEMM's quantized operands and scales, which have no isfinite, abs or comparison) as float32,
    the values it holds; any other tensor as it is."""
    t = t.detach()
    return t.float() if t.is_floating_point() and t.dtype.itemsize == 1 else t


def tensors_of(value: Any) -> list[tuple[str, torch.Tensor]]:
    """The floating tensors in a node's value, with a suffix for tuple elements ('', '[1]')."""
    if isinstance(value, torch.Tensor):
        return [("", value)] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [(f"[{i}]", v) for i, v in enumerate(value)
                if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return []


Visit = Callable[[GraphRecord, str, fx.Node, Any, dict], None]


class _Visiting(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, record: GraphRecord, phase: str, visit: Visit):
        super().__init__(gm)
        self.record, self.phase, self.visit = record, phase, visit

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.op != "output":
            self.visit(self.record, self.phase, n, value, self.env)
        return value


class InstrumentingCompiler:
    """An inner compiler for `FxampBackend`: AOTAutograd as `aot_eager`, then interpret.

    `visit(record, phase, node, value, env)` sees every placeholder and op of every forward and
    backward graph, in execution order, after it ran; `env` holds the values of its inputs.
    `graphs` lists what each Dynamo graph became.

    With `pre_dispatch=True` it runs fxamp's pre-dispatch graph itself instead, eagerly and
    under autograd (no AOTAutograd): `visit` sees every node of the graph the passes annotated
    (phase "forward"), with live values a hook can follow into the backward (the planner's
    measurements, fxamp/planner/measure.py).
    """

    def __init__(self, visit: Visit, *, pre_dispatch: bool = False):
        self.visit, self.pre_dispatch = visit, pre_dispatch
        self.graphs: list[GraphRecord] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        record = GraphRecord(len(self.graphs), gm)
        self.graphs.append(record)
        if self.pre_dispatch:
            return lambda *args: _Visiting(gm, record, FORWARD, self.visit).run(*args)
        return _compat.aot_eager(gm, example_inputs,
                         fw_compiler=lambda g, _: self._interpret(record, FORWARD, g),
                         bw_compiler=lambda g, _: self._interpret(record, BACKWARD, g))

    def _interpret(self, record: GraphRecord, phase: str, gm: fx.GraphModule) -> Callable:
        record.set_graph(phase, gm)
        return make_boxed_func(lambda *args: _Visiting(gm, record, phase, self.visit).run(*args))


# --------------------------------------------------------------------- running a model under it
def prepare_private(model_or_fn: Callable, inner: Callable, *, config: Optional[AmpConfig],
                    opt_level: Optional[str], overrides: dict[str, Any]) -> Prepared:
    """`model_or_fn` prepared with the inner compiler `inner` on a private copy of a module
    (a module `fxamp.compile` prepared keeps its config), as `fxamp.model.prepare` does it."""
    return prepare(model_or_fn, requested_config(config, opt_level, overrides, "fxamp.debug"),
                   settings=CompileSettings(compiler=inner), in_place=False)


def call_model(fn: Callable, batch: Any, with_target: bool) -> tuple[Any, Any]:
    """(outputs, target): `batch` is the model's inputs, or `(inputs, target)` with a loss_fn."""
    if with_target and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        what = (f"a Tensor of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor)
                else f"a {type(batch).__name__}" + (f" of {len(batch)}" if
                                                    isinstance(batch, (tuple, list)) else ""))
        raise ConfigError(f"with a loss_fn, batch is the pair (inputs, target) a DataLoader "
                          f"yields, not {what}; pass (x, y), or no loss_fn to differentiate "
                          "the sum of the outputs")
    inputs, target = batch if with_target else (batch, None)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return fn(*args), target


def default_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The fp32 sum of the floating outputs (what explain(backward=True) differentiates)."""
    floats = [o for o in pytree.tree_leaves(outputs)
              if isinstance(o, torch.Tensor) and o.is_floating_point()]
    if not floats:
        return None
    return sum(o.float().sum() for o in floats)


def backward(loss: Optional[torch.Tensor], loss_scale: float) -> bool:
    """`(loss * loss_scale).backward()` in fp32, as a loss scaler would; False without a graph."""
    if loss is None or not loss.requires_grad:
        return False
    (loss.float() * loss_scale).backward()
    return True
