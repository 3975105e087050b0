"""Float8: decide for every matmul-family node whether it runs in float8, then rewrite those.

Annotate, then materialise, like the cast passes: `decide_gemms` records a `GemmChoice` on
every GEMM node (`node.meta[FLOAT8_META]`: float8 or not, and why; explain() prints them), and
`rewrite_gemms` replaces the chosen ones by `float8_linear` / `float8_matmul` / `float8_bmm`
calls (Note [Float8 GEMMs are an autograd.Function in the graph] and Note [Batched float8
GEMMs] in docs/design.md; what each GEMM multiplies is read by float8_operands.py). It runs after
insert_casts, so a GEMM's operands are already in the dtype the opt level gave them (bf16 at
O1/O2 on CPU), which is the dtype the float8 GEMMs return.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fxamp._compat import SET_GRAD_ENABLED, detect_fake_mode, size_hint, size_rule_holds
from fxamp.config import AmpConfig
from fxamp.float8.block_gemm import block_kwargs, block_reason, block_shape_refusal
from fxamp.float8.config import Float8Config
from fxamp.float8.delayed import PREFIX, SEED, Float8History, history_name, is_delayed
from fxamp.float8.gemm import float8_bmm, float8_linear, float8_matmul
from fxamp.passes.annotate import short_dtype
from fxamp.passes.float8_operands import GEMM_OPS, GemmOperands, gemm_operands
from fxamp.provenance import module_of, source_line

__all__ = ["FLOAT8_META", "GemmChoice", "GEMM_OPS", "decide_gemms", "rewrite_gemms",
           "is_float8_gemm"]

FLOAT8_META = "fxamp_float8"
aten = torch.ops.aten

_FLOAT8_FNS = (float8_linear, float8_matmul, float8_bmm)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """One GEMM: where it is, its M x K x N (None when its operands are not a GEMM's), and
    whether (and why) it runs in float8. `flops` counts the forward GEMM (2*M*K*N, times the
    batch for bmm). `batch`: the entries of a batched GEMM, each its own GEMM of M x K x N
    (0: one GEMM; Note [Batched float8 GEMMs])."""

    op: str
    module: str
    shape: Optional[tuple[int, int, int]]
    float8: bool
    reason: str
    flops: int = 0
    batch: int = 0


def is_float8_gemm(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _FLOAT8_FNS


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _module(node: fx.Node) -> tuple[str, str]:
    path, type_name = module_of(node.meta.get("nn_module_stack"))
    return path or "<root>", type_name


def _flops(node: fx.Node) -> int:
    # 2 * (output elements) * K: batched and broadcast GEMMs included; at symbolic sizes, at
    # the sizes of the example traced (0 where a size depends on data).
    left = node.args[1] if GEMM_OPS[node.target] in ("addmm", "baddbmm") else node.args[0]
    out, a = _val(node), _val(left)
    if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor):
        return 0
    return size_hint(2 * out.numel() * a.shape[-1]) or 0


# Note [Float8 GEMMs at symbolic shapes]: after Dynamo recompiles for a new batch size or
# sequence length, M (and, for attention-style GEMMs, K or N) is a SymInt. The float8 GEMM
# itself is shape-agnostic (amax, scale, cast and `_scaled_mm` trace at any M), so only the
# shape rules need care: each is evaluated on the symbolic size (`size_rule_holds`), which
# makes its answer a guard of the graph, not a specialisation to the traced value. A later
# batch that breaks a rule (M = 2 * 17) fails the guard and recompiles, and in that graph the
# GEMM stays in the model dtype, named; every batch that keeps the rules reuses the float8
# graph. Sizes that depend on data (unbacked) cannot be guarded on: their GEMMs stay. The
# number of batch entries of a per-entry batched GEMM must stay static (the GEMMs are
# unrolled at trace time: float8_operands.py refuses it before any comparison adds a guard).


def _shape_refusal(shape: tuple, f8: Float8Config) -> Optional[str]:
    m, k, n = shape
    symbolic = "" if all(isinstance(d, int) for d in shape) else " (or data-dependent)"
    if block := f8.spec.block and block_shape_refusal(shape, f8.spec.block):
        return block
    if not f8.spec.block and not all(size_rule_holds(d % 16 == 0) for d in shape):
        return (f"M x K x N = {m} x {k} x {n}: not all multiples of 16{symbolic} "
                "(torch._scaled_mm)")
    if not all(size_rule_holds(d >= f8.min_dim) for d in (k, n)):
        return f"K x N = {k} x {n}: smaller than min_dim={f8.min_dim}{symbolic}"
    return None


def _skip_pattern(node: fx.Node, f8: Float8Config) -> Optional[str]:
    path, type_name = _module(node)
    for pattern in f8.skip_modules:
        if pattern == type_name or fnmatch.fnmatchcase(path, pattern):
            return pattern
    return None


_ATTENTION = ("attention-style batched GEMM (no parameter operand): off by default, "
              "batched_activations=True includes it (Note [Attention-style batched GEMMs stay "
              "by default])")


def _refusal(node: fx.Node, ops: GemmOperands, config: AmpConfig,
             rewritable: bool) -> Optional[str]:
    f8, a, b = config.float8, ops.a, ops.b
    if ops.refusal:
        return ops.refusal
    if not (a.dtype == b.dtype and a.dtype in _DTYPES and a.device.type == config.device_type):
        return f"operands {short_dtype(a.dtype)}/{short_dtype(b.dtype)} on {a.device.type}"
    pattern = _skip_pattern(node, f8)
    if pattern:
        return f"skip_modules {pattern!r}"
    # a body's inputs carry no parameter tag: what stays there is said by decide_gemms
    if ops.activations and not f8.batched_activations and rewritable:
        return _ATTENTION
    if ops.batch > f8.max_batch:
        return f"{ops.batch} batch entries > max_batch={f8.max_batch} (one _scaled_mm each)"
    return _shape_refusal(ops.mkn, f8)


def _why(ops: GemmOperands, config: AmpConfig) -> str:
    r = config.float8.spec
    if r.block:
        why = f"{block_reason(config.float8, config.device_type)}; {short_dtype(ops.a.dtype)} out"
    else:
        why = (f"{r.name}: {short_dtype(r.input)} x {short_dtype(r.weight)}, grad "
               f"{short_dtype(r.grad_output)}"
               f"{', grad_weight ' + short_dtype(ops.a.dtype) if r.grad_weight_hp else ''}, "
               f"{short_dtype(ops.a.dtype)} out")
    if ops.batch:
        why += f"; {ops.batch} GEMMs, one per batch entry"
        why += "" if r.block else ", scaled per entry"
    elif ops.flattened:
        why += "; one flattened GEMM (the right operand has one batch entry)"
    return why


def decide(gm: fx.GraphModule, node: fx.Node, config: AmpConfig,
           rewritable: bool = True) -> GemmChoice:
    op, module, ops = GEMM_OPS[node.target], _module(node)[0], gemm_operands(gm, node)
    shape = None if ops.a is None else ops.mkn
    refusal = _refusal(node, ops, config, rewritable)
    planned = config.graph.plan_reason(module)
    plan = "" if planned is None else f"; plan: {planned}"
    if refusal:
        dtype = short_dtype(_val(node).dtype) if isinstance(_val(node), torch.Tensor) else "-"
        return GemmChoice(op, module, shape, False, f"{refusal}; stays {dtype}{plan}",
                          _flops(node), ops.batch)
    return GemmChoice(op, module, shape, True, _why(ops, config) + plan, _flops(node), ops.batch)


def decide_gemms(gm: fx.GraphModule, config: AmpConfig, *, rewritable: bool = True) -> int:
    """Record a GemmChoice on every GEMM node of `gm`; returns how many go to float8."""
    chosen = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in GEMM_OPS:
            continue
        choice = decide(gm, node, config, rewritable)
        if choice.float8 and not rewritable:
            choice = dataclasses.replace(choice, float8=False, reason="inside a custom "
                                         "autograd.Function or checkpointed body: not rewritten")
        node.meta[FLOAT8_META] = choice
        chosen += choice.float8
    return chosen


def _replacement(gm: fx.GraphModule, node: fx.Node) -> tuple[Callable, tuple, dict]:
    op, ops = GEMM_OPS[node.target], gemm_operands(gm, node)
    if op == "linear":
        return float8_linear, (ops.left, ops.right, ops.bias), {}
    scalars = {k: v for k, v in (("alpha", ops.alpha), ("beta", ops.beta)) if v != 1}
    if ops.batch or ops.flattened:
        return float8_bmm, (ops.left, ops.right, ops.bias), scalars
    return float8_matmul, (ops.left, ops.right, ops.bias), scalars


def _erase_unused(node: Any) -> None:
    # The expand (and casts) a flattened bmm no longer reads.
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        source = node.args[0]
        node.graph.erase_node(node)
        node = source


def _history_args(gm: fx.GraphModule, node: fx.Node, history: Float8History,
                  name: str, entries: int) -> tuple[fx.Node, ...]:
    return tuple(_buffer_attr(gm, node, f"{name}_{role}", history.get(f"{name}_{role}", entries))
                 for role in ("input", "weight"))


def _buffer_attr(gm: fx.GraphModule, node: fx.Node, name: str, tensor: torch.Tensor) -> fx.Node:
    # Note [Delayed scaling lives in the model]: the graph reads and updates the model's own
    # buffers, registered on the graph module under the same tensor (AOTAutograd lifts a graph
    # module's buffers to inputs of the compiled function and copies mutations back).
    fake_mode = detect_fake_mode([node.meta.get("val")])
    gm.register_buffer(PREFIX + name, tensor)
    with gm.graph.inserting_before(node):
        attr = gm.graph.get_attr(PREFIX + name)
    attr.meta["val"] = fake_mode.from_tensor(tensor) if fake_mode else tensor
    return attr


def _ranks(gm: fx.GraphModule) -> dict[fx.Node, int]:
    # Each GEMM's rank among its module's GEMMs of its op, float8 or not (so that a GEMM
    # that stays at one shape does not rename the others; Note [Amax histories are named by
    # what they measure]).
    ranks, seen = {}, {}
    for node in gm.graph.nodes:
        choice = node.meta.get(FLOAT8_META)
        if choice is not None:
            key = (choice.module, choice.op)
            ranks[node] = seen[key] = seen.get(key, -1) + 1
    return ranks


def _grad_modes(gm: fx.GraphModule, grad_enabled: bool) -> dict[fx.Node, bool]:
    # Whether each node runs with gradients enabled: the mode the graph was traced in,
    # switched by the no_grad regions of the forward (Note [Eval forwards leave the
    # histories alone]).
    modes = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SET_GRAD_ENABLED:
            grad_enabled = bool(node.args[0])
        modes[node] = grad_enabled
    return modes


def _history_names(gm: fx.GraphModule, history: Float8History) -> dict[fx.Node, str]:
    # Every float8 GEMM's history name, claimed for all of them before any buffer is made.
    names, uses, ranks = {}, [], _ranks(gm)
    for node, rank in ranks.items():
        choice = node.meta[FLOAT8_META]
        if choice.float8 and not is_float8_gemm(node):
            names[node] = history_name(choice.module, choice.op, rank, choice.batch)
            uses.append((names[node], (choice.module, choice.op, rank),
                         source_line(node.meta.get("stack_trace")), _stored_source(node.args[1])))
    history.claim(uses)
    return names


def _stored_source(value: object, hops: int = 8) -> Optional[str]:
    # The graph input (parameter, buffer, argument) a GEMM operand is read from, through casts
    # and views (ops with one tensor input); None for a value computed from several.
    while isinstance(value, fx.Node) and hops:
        if value.op in ("placeholder", "get_attr"):
            return str(value.target)
        inputs = value.all_input_nodes
        if value.op != "call_function" or len(inputs) != 1:
            return None
        value, hops = inputs[0], hops - 1
    return None


def rewrite_gemms(gm: fx.GraphModule, config: AmpConfig,
                  history: Optional[Float8History] = None, *, grad_enabled: bool = True) -> int:
    """Replace every GEMM whose GemmChoice says float8; returns how many were rewritten.
    `history` holds the model's float8 state the new nodes read, and update where gradients are
    enabled (`grad_enabled`: the traced mode): amax histories, the stochastic-rounding seed."""
    rewritten = 0
    delayed = history is not None and is_delayed(config.float8)
    stochastic = history is not None and config.float8.nvfp4_stochastic_rounding
    names = _history_names(gm, history) if delayed else {}
    modes = _grad_modes(gm, grad_enabled)
    for node in list(gm.graph.nodes):
        choice = node.meta.get(FLOAT8_META)
        if choice is None or not choice.float8 or is_float8_gemm(node):
            continue
        fn, args, kwargs = _replacement(gm, node)
        args = (*args, config.float8.recipe)
        kwargs = {**kwargs, **block_kwargs(config.float8)}
        if delayed:
            args = (*args, *_history_args(gm, node, history, names[node], choice.batch))
            kwargs = kwargs if modes[node] else {**kwargs, "update_history": False}
        if stochastic and modes[node]:  # Note [The seed of NVFP4's stochastic rounding]
            kwargs = {**kwargs, "sr_seed": _buffer_attr(gm, node, SEED, history.seed())}
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, args, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        old_right = node.args[2] if GEMM_OPS[node.target] in ("addmm", "baddbmm") else node.args[1]
        gm.graph.erase_node(node)
        if old_right is not args[1]:
            _erase_unused(old_right)
        rewritten += 1
    return rewritten
