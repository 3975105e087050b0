"""Measure every GEMM of a model on calibration batches: its shape, value ranges, and the error
of each candidate precision against fp32 (docs/planner.md, "Measuring").

The model runs at O0 (fp32) through fxamp's own backend with the debug tools' instrumenting
compiler in its pre-dispatch mode: the graph the passes annotate runs eagerly under autograd,
so each GEMM node (the node the float8 pass decides on, with its module path and source
line) is seen with its live operands, and a hook on its output catches the gradient that
flows into it. Each candidate then recomputes the whole op -- its product and whatever else it
adds or scales (Note [The whole op is measured]) -- and the two gradient GEMMs of a training
step from those fp32 tensors: 16-bit dtypes by rounding the operands and the result (a
tensor-core GEMM multiplies exactly and accumulates in fp32), float8 with the code a float8
plan runs (`float8_matmul` / `float8_bmm`: `Float8MM` and its epilogue) on the 16-bit operands.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx as fx

from fxamp.config import AmpConfig
from fxamp.debug import instrument
from fxamp.debug.instrument import (FORWARD, GraphRecord, InstrumentingCompiler, OpSite,
                                    call_model, default_loss, prepare_private)
from fxamp.float8.config import Float8Config
from fxamp.float8.gemm import float8_bmm, float8_matmul
from fxamp.passes.float8 import GEMM_OPS, decide
from fxamp.passes.float8_operands import GemmOperands, gemm_operands
from fxamp.provenance import module_of, source_line

__all__ = ["GemmMeasure", "GemmProbe", "GemmCall", "measure", "candidate_errors",
           "relative_error", "CANDIDATES", "TENSORS"]

CANDIDATES = ("bf16", "fp16", "tensorwise", "rowwise")  # fp32 is the reference itself
TENSORS = ("output", "grad_input", "grad_weight")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class GemmMeasure:
    """What was measured of one GEMM node, over all calibration batches (the worst of each).

    `errors[candidate][tensor]` is the relative error ||x - ref|| / ||ref|| of the output,
    grad_input or grad_weight computed in `candidate` against fp32 (inf for an overflow);
    `max_abs[tensor]` the largest |x| of input, weight, output and the three gradients.
    `float8_refusal` says why float8 cannot run this GEMM at all (None: it can).
    """

    site: OpSite
    module_type: str
    source_line: str
    shape: Optional[tuple[int, int, int]]
    batch: int
    float8_refusal: Optional[str]
    grad_input: bool = False
    grad_weight: bool = False
    errors: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    max_abs: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, errors: dict[str, dict[str, float]], max_abs: dict[str, float]) -> None:
        for cand, by_tensor in errors.items():
            mine = self.errors.setdefault(cand, {})
            for tensor, err in by_tensor.items():
                mine[tensor] = max(mine.get(tensor, 0.0), err)
        for tensor, value in max_abs.items():
            self.max_abs[tensor] = max(self.max_abs.get(tensor, 0.0), value)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||; inf when x has an inf or NaN (an overflow)."""
    x, ref = x.detach().float(), ref.detach().float()
    diff, base = float((x - ref).norm()), float(ref.norm())
    if math.isnan(diff) or math.isinf(diff):
        return math.inf
    return diff / base if base > 0 else (0.0 if diff == 0 else math.inf)


# Note [The whole op is measured]: a GEMM node computes `beta * c + alpha * (a @ b)`: a
# Linear adds its bias, addmm / baddbmm their input, scaled by alpha and beta (beta = 0 ignores
# c, its inf and NaN included), matmul broadcasts batch dims and takes 1-D operands. Each
# candidate computes all of it, and the error is relative to the op's fp32 result: a bias
# that cancels the product (a folded normalisation, bias = -W @ mean) leaves a small output
# that the rounding of the large product swamps, which the product alone would never show.
# The gradients are those of a and b (a bias's gradient is a sum, not a GEMM).
@dataclasses.dataclass(frozen=True)
class GemmCall:
    """What one GEMM node computed: `beta * c + alpha * (a @ b)`, a [.., M, K] and b
    [.., K, N] (batch dims broadcast as torch.matmul does), c None or broadcast to the
    result, with `shape` the result's shape in that form."""

    a: torch.Tensor
    b: torch.Tensor
    c: Optional[torch.Tensor] = None
    alpha: float = 1
    beta: float = 1

    @property
    def shape(self) -> tuple[int, ...]:
        batch = torch.broadcast_shapes(self.a.shape[:-2], self.b.shape[:-2])
        return (*batch, self.a.shape[-2], self.b.shape[-1])

    def detach(self) -> "GemmCall":
        c = None if self.c is None else self.c.detach()
        return dataclasses.replace(self, a=self.a.detach(), b=self.b.detach(), c=c)


def _whole(call: GemmCall, g: Optional[torch.Tensor], grads: tuple[bool, bool],
           round_: Callable) -> dict:
    """The op, and with `g` the gradients of a and b, in fp32 on operands rounded by
    `round_`, each result rounded."""
    a, b = (round_(t).detach().requires_grad_(g is not None) for t in (call.a, call.b))
    with torch.enable_grad():
        out = torch.matmul(a, b)
        out = out if call.alpha == 1 else call.alpha * out
        if call.c is not None:
            out = out + (round_(call.c) if call.beta == 1 else call.beta * round_(call.c))
    result = {"output": round_(out.detach())}
    if g is not None and any(grads):
        wanted = [t for t, on in zip((a, b), grads) if on]
        got = iter(torch.autograd.grad(out, wanted, round_(g)))
        result.update({name: round_(next(got)) for name, on in
                       zip(("grad_input", "grad_weight"), grads) if on})
    return result


def _float8(call: GemmCall, g: Optional[torch.Tensor], grads: tuple[bool, bool], recipe: str,
            dtype: torch.dtype) -> dict:
    a16, b16 = (t.to(dtype).requires_grad_(g is not None) for t in (call.a, call.b))
    c16 = None if call.c is None else call.c.to(dtype)
    gemm = float8_bmm if a16.dim() == 3 else float8_matmul
    with torch.enable_grad():
        out = gemm(a16, b16, c16, recipe, alpha=call.alpha, beta=call.beta)
    result = {"output": out.detach()}
    if g is not None and any(grads):
        grad_a, grad_b = torch.autograd.grad(out, (a16, b16), g.to(dtype))
        result.update({"grad_input": grad_a} if grads[0] else {})
        result.update({"grad_weight": grad_b} if grads[1] else {})
    return result


# Note [Measuring a sample of a large GEMM]: a GEMM with more than MAX_ROWS rows or MAX_COLS
# output columns is measured on that many of them (evenly spaced), always with the rows and
# columns that hold the largest |input|, |weight| and |gradient|: the output and grad_weight
# entries measured are exact entries of the full GEMM, grad_input sums over the kept columns
# only, and the tensorwise float8 scales are those of the full tensors (their amax is kept).
# Planning a large model then costs a bounded amount per GEMM.
MAX_ROWS = MAX_COLS = 1024


def _keep(size: int, limit: int, *extremes: torch.Tensor) -> Optional[torch.Tensor]:
    if size <= limit:
        return None
    spaced = torch.linspace(0, size - 1, limit - len(extremes)).long()
    return torch.unique(torch.cat([spaced, *(e.reshape(1) for e in extremes)]))


def _sample(call: GemmCall, g: Optional[torch.Tensor]) -> tuple[GemmCall, Any]:
    a, b, c = call.a, call.b, call.c
    if a.dim() != 2 or b.dim() != 2:
        return call, g
    gabs = None if g is None else g.abs()
    rows = _keep(a.shape[0], MAX_ROWS, a.abs().amax(1).argmax(),
                 *(() if gabs is None else (gabs.amax(1).argmax(),)))
    cols = _keep(b.shape[1], MAX_COLS, b.abs().amax(0).argmax(),
                 *(() if gabs is None else (gabs.amax(0).argmax(),)))
    if rows is not None:
        a, g, c = a[rows], None if g is None else g[rows], None if c is None else c[rows]
    if cols is not None:
        b, g = b[:, cols], None if g is None else g[:, cols]
        c = None if c is None else c[:, cols]
    return dataclasses.replace(call, a=a, b=b, c=c), g


def candidate_errors(a: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor], *,
                     c: Optional[torch.Tensor] = None, alpha: float = 1, beta: float = 1,
                     grad_input: bool, grad_weight: bool, dtype: torch.dtype,
                     float8: bool) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """(errors, max_abs) of the op `beta * c + alpha * (a [.., M, K] @ b [.., K, N])` with
    output gradient `g` (None: forward only), for each candidate (float8 ones only with
    `float8`); the float8 operands are in `dtype`, the 16-bit dtype of the plan (Note [The
    whole op is measured]). Large GEMMs are measured on a sample (Note [Measuring a sample of
    a large GEMM])."""
    c = None if c is None or beta == 0 else c.detach().float()
    call = GemmCall(a.detach().float(), b.detach().float(), None, alpha, beta)
    if c is not None:
        call = dataclasses.replace(call, c=c.expand(call.shape))
    call, g = _sample(call, None if g is None else g.detach().float().reshape(call.shape))
    grads = (grad_input, grad_weight)
    ref = _whole(call, g, grads, lambda t: t)
    errors = {}
    for cand in CANDIDATES:
        if cand in _DTYPES:
            low = _DTYPES[cand]
            got = _whole(call, g, grads, lambda t: t.to(low).float())
        elif float8:
            got = _float8(call, g, grads, cand, dtype)
        else:
            continue
        errors[cand] = {k: relative_error(v, ref[k]) for k, v in got.items()}
    named = {"input": call.a, "weight": call.b, **({"bias": call.c} if call.c is not None
                                                   else {}),
             **ref, **({"grad_output": g} if g is not None else {})}
    return errors, {k: float(v.abs().max()) if v.numel() else 0.0 for k, v in named.items()}


def _value(node: Any, env: dict) -> Any:
    return env[node] if isinstance(node, fx.Node) else node


def _as_written(node: fx.Node, env: dict) -> GemmCall:
    # A GEMM the float8 pass cannot take (batch dims broadcast, a 1-D operand): its operands
    # as the op takes them, a 1-D one made a matrix as torch.matmul does.
    op, args = GEMM_OPS[node.target], [_value(x, env) for x in node.args]
    scalars = {k: node.kwargs.get(k, 1) for k in ("alpha", "beta")}
    if op == "linear":
        x, w, bias = (*args, node.kwargs.get("bias"))[:3]
        a, b, c, scalars = x, _t(w) if w.dim() == 2 else w, _value(bias, env), {}
    elif op in ("addmm", "baddbmm"):
        c, a, b = args[:3]
    else:
        (a, b), c = args[:2], None
    a, b = a.unsqueeze(0) if a.dim() == 1 else a, b.unsqueeze(-1) if b.dim() == 1 else b
    return GemmCall(a, b, c, **scalars)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _call(ops: GemmOperands, node: fx.Node, env: dict, value: torch.Tensor) -> GemmCall:
    # Canonical [M, K] @ [K, N], or [B, M, K] @ [B, K, N] for a GEMM done per batch entry, as
    # the float8 pass takes it; c broadcast to the result, in that form.
    if ops.refusal is not None:
        call = _as_written(node, env)
    else:
        a, b = env[ops.left], env[ops.right]
        b = b.t() if GEMM_OPS[node.target] == "linear" else b
        _, k, n = ops.mkn
        a, b = (a.reshape(-1, *a.shape[-2:]), b.reshape(-1, k, n)) if ops.batch else \
            (a.reshape(-1, k), b.reshape(k, n))
        call = GemmCall(a, b, _value(ops.bias, env), ops.alpha, ops.beta)
    if call.c is None or call.beta == 0:
        return dataclasses.replace(call, c=None)
    return dataclasses.replace(call, c=call.c.expand(value.shape).reshape(call.shape))


class GemmProbe(InstrumentingCompiler):
    """An inner compiler that finds every GEMM node and captures its operands and output
    gradient; `flush()` measures what was captured (after each batch's backward)."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__(self._visit, pre_dispatch=True)
        self.dtype = dtype
        # float8's own refusals (shapes, attention-style GEMMs), sizes left to the cost model
        self.float8_config = AmpConfig.from_opt_level(
            "O1", float8=Float8Config(min_dim=1)).resolve(device_type)
        self.sites: dict[tuple[int, str], GemmMeasure] = {}
        self._pending: list[list[Any]] = []

    def _site(self, record: GraphRecord, node: fx.Node) -> GemmMeasure:
        key = (record.index, node.name)
        if key not in self.sites:
            choice = decide(record.pre, node, self.float8_config)
            site = OpSite(FORWARD, record.index, node.name, str(node.target), str(node.target),
                          choice.module)
            self.sites[key] = GemmMeasure(
                site, module_of(node.meta.get("nn_module_stack"))[1] or "-",
                source_line(node.meta.get("stack_trace")), choice.shape, choice.batch,
                None if choice.float8 else choice.reason.rsplit("; stays", 1)[0])
        return self.sites[key]

    def _visit(self, record: GraphRecord, phase: str, node: fx.Node, value: Any,
               env: dict) -> None:
        if node.op != "call_function" or node.target not in GEMM_OPS:
            return
        measure_ = self._site(record, node)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return  # no candidate precision to compare
        call = _call(gemm_operands(record.pre, node), node, env, value)
        measure_.grad_input, measure_.grad_weight = call.a.requires_grad, call.b.requires_grad
        entry = [measure_, call.detach(), None]
        self._pending.append(entry)
        if value.requires_grad:
            value.register_hook(lambda g: entry.__setitem__(2, g.detach()))

    def flush(self) -> None:
        """Measure every GEMM captured since the last flush, then let go of its tensors."""
        for m, call, g in self._pending:
            m.add(*candidate_errors(call.a, call.b, g, c=call.c, alpha=call.alpha,
                                    beta=call.beta, grad_input=m.grad_input and g is not None,
                                    grad_weight=m.grad_weight and g is not None,
                                    dtype=self.dtype, float8=m.float8_refusal is None))
        self._pending.clear()


def measure(model: torch.nn.Module, batches: Iterable[Any],
            loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], *,
            dtype: torch.dtype, device_type: str) -> tuple[list[GemmMeasure], int]:
    """Every GEMM of `model` measured over `batches` (each as `range_stats` takes one), on a
    private fp32 copy; returns the measurements and the number of batches."""
    probe = GemmProbe(device_type, dtype)
    prepared = prepare_private(model, probe, config=AmpConfig.from_opt_level("O0"),
                               opt_level=None, overrides={})
    count = 0
    for batch in batches:
        outputs, target = call_model(prepared, batch, loss_fn is not None)
        loss = loss_fn(outputs, target) if loss_fn is not None else default_loss(outputs)
        instrument.backward(loss, 1.0)
        probe.flush()
        count += 1
    return list(probe.sites.values()), count
