"""Annotate: decide every node's casts and record them in `node.meta[FXAMP_META]`.

The graph is walked in order while the new dtypes are propagated with fake tensors, so each
decision sees the dtypes its inputs will really have after earlier decisions (a linear lowered
to bf16 hands bf16 to the relu after it). Nothing in the graph changes here: `insert_casts`
materialises the decisions, and `explain()` prints them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fxamp._compat import ENTER_AUTOCAST, EXIT_AUTOCAST, OpOverload, pytree
from fxamp.config import AmpConfig
from fxamp.errors import FxampError
from fxamp.passes.aliasing import Aliasing
from fxamp.passes.hops import body_inputs, hop_spec
from fxamp.passes.propagate import run_with_casts, traced_if_same
from fxamp.policy import LOW_DTYPES, CastPolicy
from fxamp.provenance import is_boundary_cast
from fxamp.policy.rules import ONE_DTYPE_OPS, USER_CAST_OPS, castable_args, choose_policy

__all__ = ["FXAMP_META", "OpDecision", "annotate", "short_dtype"]

FXAMP_META = "fxamp"
BOUNDARY_REASON = "model boundary cast (fxamp.compile)"

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
          torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "b8",
          torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16",
          torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def short_dtype(dtype: Optional[torch.dtype]) -> str:
    return "-" if dtype is None else _SHORT.get(dtype, str(dtype).replace("torch.", ""))


@dataclasses.dataclass
class OpDecision:
    """What the passes do to one node, and why. Read by insert_casts and explain()."""

    policy: CastPolicy
    reason: str
    input_dtypes: tuple[Optional[torch.dtype], ...]
    arg_casts: dict[int, torch.dtype]  # flat (args, kwargs) leaf index -> dtype
    set_dtype_kwarg: bool = False  # fp32_set_opt_dtype: pass dtype=torch.float32
    restore_output: Optional[torch.dtype] = None  # O2/O3 fp32 islands: cast the result back
    val: Any = None  # the node's own fake value after the casts (before any restore)
    autocast_casts: bool = False  # in the user's enabled torch.autocast region: it casts this
    inserted: bool = False  # a cast insert_casts created (policy = its consumer's, reason = why)
    boundary: bool = False  # a model-boundary cast (Note [Boundary casts are tagged when traced])

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        casts = set(self.arg_casts.values())
        if self.set_dtype_kwarg:
            return torch.float32
        return casts.pop() if len(casts) == 1 else None


def _dtype(value: Any) -> Optional[torch.dtype]:
    return value.dtype if isinstance(value, torch.Tensor) else None


def _eligible(value: Any, device_type: str) -> bool:
    return (isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dtype != torch.float64 and value.device.type == device_type)


def _leaf_positions(node: fx.Node) -> list[Optional[int]]:
    """For each flat leaf of (args, kwargs), the top-level positional index it sits in."""
    positions: list[Optional[int]] = []
    for i, arg in enumerate(node.args):
        positions += [i] * len(pytree.tree_leaves(arg))
    positions += [None] * len(pytree.tree_leaves(node.kwargs))
    return positions


def _target_dtype(policy: CastPolicy, eligible: list[torch.dtype], low: torch.dtype):
    if policy is CastPolicy.LOWER:
        return low
    if policy is CastPolicy.FP32:
        return torch.float32
    if policy is CastPolicy.PROMOTE:
        return torch.float32 if torch.float32 in eligible else low
    return None


def _has_dtype_arg(node: fx.Node) -> bool:
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    if "dtype" not in names:
        return False
    i = names.index("dtype")
    return node.kwargs.get("dtype") is None and (len(node.args) <= i or node.args[i] is None)


def _decide(node: fx.Node, vals: list[Any], config: AmpConfig,
            aliasing: Aliasing) -> OpDecision:
    if node.target in USER_CAST_OPS and is_boundary_cast(node):
        return OpDecision(CastPolicy.KEEP, BOUNDARY_REASON, tuple(_dtype(v) for v in vals), {},
                          boundary=True)
    policy, reason = choose_policy(node, config)
    device = config.device_type
    eligible_idx = [i for i, v in enumerate(vals) if _eligible(v, device)]
    decision = OpDecision(policy, reason, tuple(_dtype(v) for v in vals), {})
    if not eligible_idx or policy in (CastPolicy.KEEP, CastPolicy.BANNED):
        _lower_model_inputs(node, vals, eligible_idx, decision, config, aliasing)
        return decision
    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        first = next((v for v in vals if isinstance(v, torch.Tensor)), None)
        decision.set_dtype_kwarg = _eligible(first, device) and _has_dtype_arg(node)
        return decision
    positions = _leaf_positions(node)
    allowed = castable_args(node.target, policy, len(node.args))
    blocked = aliasing.uncastable(node)
    target = _target_dtype(policy, [vals[i].dtype for i in eligible_idx], config.dtype)
    for i in eligible_idx:
        pos = positions[i]
        if pos in blocked or (allowed is not None and pos not in allowed):
            continue
        if vals[i].dtype != target:
            decision.arg_casts[i] = target
    if policy is CastPolicy.FP32 and config.cast_model_type in LOW_DTYPES:
        lows = [vals[i].dtype for i in eligible_idx if vals[i].dtype in LOW_DTYPES]
        decision.restore_output = lows[0] if lows else None
    return decision


def _lower_model_inputs(node, vals, eligible_idx, decision: OpDecision, config: AmpConfig,
                        aliasing: Aliasing):
    # Note [O2 graph inputs]: at O2/O3 the model computes in the low dtype, so fp32 graph inputs
    # (the parameters when the backend is used without fxamp.compile, and data the caller did
    # not cast) are cast at each use, except into fp32 islands, the user's own casts, arguments
    # mutated in place, and graphs of model_boundary="modules" (not the model's inputs). Outputs
    # are not a graph's business (a graph break makes any value one): fxamp.compile casts them
    # (Note [Model-boundary casts] in cast_model.py). An fp32 value that meets low-precision
    # ones in an op that takes one dtype (a matmul after the user's fp32 autocast region)
    # is cast the same way: the op runs in the model dtype, as autocast would run it. No cast
    # detaches a view from storage written later (Note [Casts and in-place updates of views]).
    if config.cast_model_type not in LOW_DTYPES or node.target in USER_CAST_OPS:
        return
    if not isinstance(node.target, OpOverload):
        return
    blocked = aliasing.uncastable(node)
    positions = _leaf_positions(node)
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    castable = [i for i in eligible_idx if isinstance(leaves[i], fx.Node)
                and vals[i].dtype == torch.float32 and positions[i] not in blocked]
    inputs = [i for i in castable if leaves[i].op == "placeholder"
              and config.model_boundary == "call"]
    # Mixed: low-precision values meet fp32 ones, counting the graph inputs cast here.
    mixed = node.target in ONE_DTYPE_OPS and bool(
        inputs or any(vals[i].dtype in LOW_DTYPES for i in eligible_idx))
    cast = castable if mixed else inputs
    decision.arg_casts.update({i: config.dtype for i in cast})
    if len(cast) > len(inputs):
        decision.reason = f"{config.opt_level} fp32 input of a one-dtype op cast to the model dtype"
    elif decision.arg_casts and not decision.reason.startswith("O"):
        decision.reason = f"{config.opt_level} graph input cast to the model dtype"


class _UserAutocast:
    """Tracks the user's own `torch.autocast` regions (pre-dispatch keeps them as markers).

    Note [The user's autocast wins]: inside `with torch.autocast(device, ...)` for fxamp's
    device, the user has said how those ops should run (often `enabled=False` around code
    that must stay fp32, or another dtype), so fxamp leaves every op there as traced and
    AOTAutograd applies the region's autocast to them. Their values are propagated under the
    region's own autocast state, so what follows the region sees the dtypes it produces.
    """

    def __init__(self, device_type: str, inherited: tuple = ()):
        self.device_type = device_type
        self.stack: list[Optional[tuple[torch.dtype, bool]]] = list(inherited)

    def visit(self, node: fx.Node) -> None:
        if node.target is ENTER_AUTOCAST:
            device, dtype, enabled = node.args[:3]
            self.stack.append((dtype, enabled) if device == self.device_type else None)
        elif node.target is EXIT_AUTOCAST and self.stack:
            self.stack.pop()

    @property
    def region(self) -> Optional[tuple[torch.dtype, bool]]:
        """(dtype, enabled) of the innermost region for fxamp's device, or None."""
        return next((r for r in reversed(self.stack) if r is not None), None)

    def describe(self) -> str:
        dtype, enabled = self.region
        state = f"dtype={short_dtype(dtype)}" if enabled else "enabled=False"
        return f"inside the user's torch.autocast({state}) region"

    def context(self):
        dtype, enabled = self.region
        return torch.autocast(self.device_type, dtype=dtype, enabled=enabled)


def annotate(gm: fx.GraphModule, config: AmpConfig, fake_mode) -> int:
    """Record an OpDecision on every call_function node; returns how many get casts.

    The forward bodies of the higher-order ops fxamp keeps (hops.py) are annotated too, each
    seeing the dtypes its inputs have after the decisions around it.
    """
    return _annotate_graph(gm, config, fake_mode, None, ())[0]


def _annotate_graph(gm: fx.GraphModule, config: AmpConfig, fake_mode,
                    inputs: Optional[list[Any]], in_user_autocast: tuple) -> tuple[int, Any]:
    env: dict[fx.Node, Any] = {}
    changed = 0
    user_autocast = _UserAutocast(config.device_type, in_user_autocast)
    aliasing = Aliasing.of(gm.graph)
    placeholders = iter(inputs) if inputs is not None else None
    for node in gm.graph.nodes:
        if node.op == "placeholder" and placeholders is not None:
            env[node] = next(placeholders)  # a body: the values it is really called with
            node.meta[FXAMP_META] = OpDecision(CastPolicy.KEEP, "body input", (), {},
                                               val=env[node])
            continue
        if node.op in ("placeholder", "get_attr"):
            env[node] = node.meta.get("val") if "val" in node.meta else _fetch(gm, node)
            continue
        if node.op == "output":
            return changed, pytree.tree_map(lambda x: env[x] if isinstance(x, fx.Node) else x,
                                            node.args[0])
        leaves, _ = pytree.tree_flatten((node.args, node.kwargs))
        vals = [env[x] if isinstance(x, fx.Node) else x for x in leaves]
        user_autocast.visit(node)
        decision, body_changes = _node_decision(node, vals, config, fake_mode, user_autocast,
                                                aliasing)
        changed += body_changes + bool(decision.arg_casts or decision.set_dtype_kwarg)
        node.meta[FXAMP_META] = decision
        env[node] = decision.val
        if decision.restore_output is not None:
            with fake_mode:
                env[node] = traced_if_same(decision.val.to(decision.restore_output), node)
    return changed, None


def _fetch(gm: fx.GraphModule, node: fx.Node) -> Any:
    return operator.attrgetter(node.target)(gm)


def _node_decision(node, vals, config, fake_mode, user_autocast,
                   aliasing) -> tuple[OpDecision, int]:
    spec = hop_spec(node.target)
    if spec is not None:
        return _hop_decision(node, vals, spec, config, fake_mode, tuple(user_autocast.stack))
    region = user_autocast.region
    if region is not None:
        decision = OpDecision(CastPolicy.KEEP, user_autocast.describe(),
                              tuple(_dtype(v) for v in vals), {}, autocast_casts=region[1])
    else:
        decision = _decide(node, vals, config, aliasing)
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    inputs_changed = any(isinstance(x, fx.Node) and v is not x.meta.get("val")
                         for x, v in zip(leaves, vals))
    if decision.arg_casts or decision.set_dtype_kwarg or decision.restore_output \
            or inputs_changed:
        try:
            with user_autocast.context() if region else contextlib.nullcontext():
                decision.val = run_with_casts(node, vals, decision.arg_casts,
                                              decision.set_dtype_kwarg, fake_mode)
        except Exception as e:
            raise FxampError(f"annotate: {node.format_node()}") from e
        if not decision.restore_output:
            decision.val = traced_if_same(decision.val, node)
    else:
        decision.val = node.meta.get("val")
    return decision, 0


def _hop_decision(node, vals, spec, config, fake_mode, in_user_autocast):
    # Note [Higher-order ops keep their bodies] in hops.py: the op itself is kept; its forward
    # bodies are annotated with the values the op is called with.
    args = pytree.tree_unflatten(vals, pytree.tree_flatten((node.args, node.kwargs))[1])[0]
    inputs = body_inputs(args)
    changed, outputs = 0, None
    for i in spec.policy_bodies:
        body_changed, body_out = _annotate_graph(args[i], config, fake_mode, inputs,
                                                 in_user_autocast)
        changed += body_changed
        outputs = body_out if outputs is None else outputs
    decision = OpDecision(CastPolicy.KEEP, "higher-order op: its forward body follows the policy",
                          tuple(_dtype(v) for v in vals), {})
    decision.val = spec.output(outputs, args)
    return decision, changed
