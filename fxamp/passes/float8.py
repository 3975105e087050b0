"""Float8: decide for every matmul-family node whether it runs in float8, then rewrite those.

Annotate, then materialise, like the cast passes: `decide_gemms` records a `GemmChoice` on
every GEMM node (`node.meta[FLOAT8_META]`: float8 or not, and why; explain() prints them), and
`rewrite_gemms` replaces the chosen ones by `float8_linear` / `float8_matmul` calls (Note
[Float8 GEMMs are an autograd.Function in the graph] in fxamp/float8/gemm.py). It runs after
insert_casts, so a GEMM's operands are already in the dtype the opt level gave them (bf16 at
O1/O2 on CPU), which is the dtype the float8 GEMMs return.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fxamp._compat import detect_fake_mode
from fxamp.config import AmpConfig
from fxamp.float8.config import Float8Config
from fxamp.float8.delayed import PREFIX, Float8History
from fxamp.float8.gemm import float8_linear, float8_matmul
from fxamp.passes.annotate import short_dtype
from fxamp.provenance import module_of

__all__ = ["FLOAT8_META", "GemmChoice", "GEMM_OPS", "decide_gemms", "rewrite_gemms",
           "is_float8_gemm"]

FLOAT8_META = "fxamp_float8"
aten = torch.ops.aten

# The matmul-family ops pre-dispatch tracing leaves (nn.Linear and F.linear are aten.linear;
# `@` on 2-D operands is aten.mm, on others aten.matmul).
GEMM_OPS: dict[Any, str] = {aten.linear.default: "linear", aten.mm.default: "mm",
                            aten.matmul.default: "matmul", aten.addmm.default: "addmm",
                            aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm"}
_FLOAT8_FNS = (float8_linear, float8_matmul)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """One GEMM: where it is, its M x K x N (None when not a 2-D GEMM), and whether (and why)
    it runs in float8. `flops` counts the forward GEMM (2*M*K*N, times the batch for bmm)."""

    op: str
    module: str
    shape: Optional[tuple[int, int, int]]
    float8: bool
    reason: str
    flops: int = 0


def is_float8_gemm(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _FLOAT8_FNS


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _module(node: fx.Node) -> tuple[str, str]:
    path, type_name = module_of(node.meta.get("nn_module_stack"))
    return path or "<root>", type_name


def _operands(node: fx.Node) -> tuple[Any, Any, Optional[str]]:
    """(left [.., K], right [K, N]) fake values of a GEMM, or a reason it is not 2-D."""
    op = GEMM_OPS[node.target]
    if op in ("bmm", "baddbmm"):
        return None, None, f"{op}: a batched GEMM (torch._scaled_mm multiplies 2-D operands)"
    if op == "addmm" and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return None, None, "addmm with beta or alpha != 1"
    left, right = (node.args[1], node.args[2]) if op == "addmm" else node.args[:2]
    a, b = _val(left), _val(right)
    if op == "linear" and b is not None:
        b = b.t() if b.dim() == 2 else b
    if a is None or b is None or a.dim() < 2 or b.dim() != 2:
        return None, None, f"{op} of a {_dims(a)} and a {_dims(b)} operand (float8 needs " \
                           "[..., K] @ [K, N])"
    return a, b, None


def _flops(node: fx.Node) -> int:
    # 2 * (output elements) * K: batched and broadcast GEMMs included.
    left = node.args[1] if GEMM_OPS[node.target] in ("addmm", "baddbmm") else node.args[0]
    out, a = _val(node), _val(left)
    if not isinstance(out, torch.Tensor) or not isinstance(a, torch.Tensor):
        return 0
    k = a.shape[-1]
    total = 2 * out.numel() * k
    return total if isinstance(total, int) else 0


def _dims(val: Any) -> str:
    return f"{val.dim()}-D" if isinstance(val, torch.Tensor) else "non-tensor"


def _shape_refusal(shape: tuple, f8: Float8Config) -> Optional[str]:
    m, k, n = shape
    if not all(isinstance(d, int) for d in shape):
        return f"dynamic shape M x K x N = {m} x {k} x {n}"
    if any(d % 16 for d in shape):
        return f"M x K x N = {m} x {k} x {n}: not all multiples of 16 (torch._scaled_mm)"
    if min(k, n) < f8.min_dim:
        return f"K x N = {k} x {n}: smaller than min_dim={f8.min_dim}"
    return None


def _skip_pattern(node: fx.Node, f8: Float8Config) -> Optional[str]:
    path, type_name = _module(node)
    for pattern in f8.skip_modules:
        if pattern == type_name or fnmatch.fnmatchcase(path, pattern):
            return pattern
    return None


def decide(node: fx.Node, config: AmpConfig) -> GemmChoice:
    f8 = config.float8
    op, module = GEMM_OPS[node.target], _module(node)[0]
    a, b, refusal = _operands(node)
    shape = None if a is None else (math.prod(a.shape[:-1]), a.shape[-1], b.shape[-1])
    flops = _flops(node)
    if refusal is None and not (a.dtype == b.dtype and a.dtype in _DTYPES
                                and a.device.type == config.device_type):
        refusal = f"operands {short_dtype(a.dtype)}/{short_dtype(b.dtype)} on {a.device.type}"
    pattern = _skip_pattern(node, f8)
    refusal = refusal or (f"skip_modules {pattern!r}" if pattern else None)
    refusal = refusal or _shape_refusal(shape, f8)
    if refusal:
        dtype = short_dtype(_val(node).dtype) if isinstance(_val(node), torch.Tensor) else "-"
        return GemmChoice(op, module, shape, False, f"{refusal}; stays {dtype}", flops)
    r = f8.spec
    why = (f"{r.name}: {short_dtype(r.input)} x {short_dtype(r.weight)}, grad "
           f"{short_dtype(r.grad_output)}, {short_dtype(a.dtype)} out")
    return GemmChoice(op, module, shape, True, why, flops)


def decide_gemms(gm: fx.GraphModule, config: AmpConfig, *, rewritable: bool = True) -> int:
    """Record a GemmChoice on every GEMM node of `gm`; returns how many go to float8."""
    chosen = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in GEMM_OPS:
            continue
        choice = decide(node, config)
        if choice.float8 and not rewritable:
            choice = dataclasses.replace(choice, float8=False, reason="inside a custom "
                                         "autograd.Function or checkpointed body: not rewritten")
        node.meta[FLOAT8_META] = choice
        chosen += choice.float8
    return chosen


def _replacement(node: fx.Node) -> tuple[Callable, tuple]:
    op = GEMM_OPS[node.target]
    if op == "linear":
        x, w, *rest = node.args
        return float8_linear, (x, w, rest[0] if rest else node.kwargs.get("bias"))
    if op == "addmm":
        return float8_matmul, (node.args[1], node.args[2], node.args[0])
    return float8_matmul, (node.args[0], node.args[1], None)


def _history_args(gm: fx.GraphModule, node: fx.Node, history: Float8History,
                  base: str) -> tuple[fx.Node, ...]:
    # Note [Delayed scaling lives in the model]: the graph reads and updates the model's own
    # buffers, registered on the graph module under the same tensor (AOTAutograd lifts a graph
    # module's buffers to inputs of the compiled function and copies mutations back).
    fake_mode = detect_fake_mode([node.meta.get("val")])
    attrs = []
    for operand in ("input", "weight"):
        name = f"{base}_{operand}"
        tensor = history.get(name)
        gm.register_buffer(PREFIX + name, tensor)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(PREFIX + name)
        attr.meta["val"] = fake_mode.from_tensor(tensor) if fake_mode else tensor
        attrs.append(attr)
    return tuple(attrs)


def rewrite_gemms(gm: fx.GraphModule, config: AmpConfig,
                  history: Optional[Float8History] = None) -> int:
    """Replace every GEMM whose GemmChoice says float8; returns how many were rewritten.
    With delayed scaling, `history` holds the amax histories the new nodes read and update."""
    rewritten = 0
    graph_id = 0 if history is None else history.graphs_traced
    for node in list(gm.graph.nodes):
        choice = node.meta.get(FLOAT8_META)
        if choice is None or not choice.float8 or is_float8_gemm(node):
            continue
        fn, args = _replacement(node)
        if history is not None:
            base = re.sub(r"\W", "_", f"g{graph_id}_{choice.module}_{choice.op}{rewritten}")
            args = (*args, config.float8.recipe, *_history_args(gm, node, history, base))
        else:
            args = (*args, config.float8.recipe)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(fn, args)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    if history is not None:
        history.graphs_traced += 1
    return rewritten
