"""Measure every GEMM of a model on calibration batches: its shape, value ranges, and the error
of each candidate precision against fp32 (docs/planner.md, "Measuring").

The model runs at O0 (fp32) through fxamp's own backend with the debug tools' instrumenting
compiler in its pre-dispatch mode: the graph the passes annotate runs eagerly under autograd,
so each GEMM node (the node the float8 pass decides on, with its module path and source
line) is seen with its live operands, and a hook on its output catches the gradient that
flows into it. Each candidate then recomputes the three GEMMs of a training step -- output,
grad_input, grad_weight -- from those fp32 tensors: 16-bit dtypes by rounding the operands
and the result (a tensor-core GEMM multiplies exactly and accumulates in fp32), float8 with
fxamp's own float8 GEMM (`Float8MM`, the code a float8 plan runs) on the 16-bit operands.
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
from fxamp.float8.gemm import Float8MM
from fxamp.passes.float8 import GEMM_OPS, decide
from fxamp.passes.float8_operands import GemmOperands, gemm_operands
from fxamp.provenance import module_of, source_line

__all__ = ["GemmMeasure", "GemmProbe", "measure", "candidate_errors", "relative_error",
           "CANDIDATES", "TENSORS"]

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


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _gemms(a, b, g, grad_input: bool, grad_weight: bool, round_: Callable) -> dict:
    a, b = round_(a), round_(b)
    out = {"output": round_(a @ b)}
    if g is not None:
        g = round_(g)
        if grad_input:
            out["grad_input"] = round_(g @ _t(b))
        if grad_weight:
            out["grad_weight"] = round_(_t(a) @ g)
    return out


def _float8(a, b, g, grad_input: bool, grad_weight: bool, recipe: str,
            dtype: torch.dtype) -> dict:
    a16, b16 = (t.to(dtype).requires_grad_(g is not None) for t in (a, b))
    with torch.enable_grad():
        out = Float8MM.apply(a16, b16, recipe)
    result = {"output": out}
    if g is not None:
        grad_a, grad_b = torch.autograd.grad(out, (a16, b16), g.to(dtype))
        result.update({"grad_input": grad_a} if grad_input else {})
        result.update({"grad_weight": grad_b} if grad_weight else {})
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


def _sample(a: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor]) -> tuple:
    if a.dim() != 2:
        return a, b, g
    gabs = None if g is None else g.abs()
    rows = _keep(a.shape[0], MAX_ROWS, a.abs().amax(1).argmax(),
                 *(() if gabs is None else (gabs.amax(1).argmax(),)))
    cols = _keep(b.shape[1], MAX_COLS, b.abs().amax(0).argmax(),
                 *(() if gabs is None else (gabs.amax(0).argmax(),)))
    if rows is not None:
        a, g = a[rows], None if g is None else g[rows]
    if cols is not None:
        b, g = b[:, cols], None if g is None else g[:, cols]
    return a, b, g


def candidate_errors(a: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor], *,
                     grad_input: bool, grad_weight: bool, dtype: torch.dtype,
                     float8: bool) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """(errors, max_abs) of the GEMM a [.., M, K] @ b [.., K, N] with output gradient `g`
    (None: forward only), for each candidate (float8 ones only with `float8`); the float8
    operands are in `dtype`, the 16-bit dtype of the plan. Large GEMMs are measured on a
    sample (Note [Measuring a sample of a large GEMM])."""
    a, b = a.detach().float(), b.detach().float()
    a, b, g = _sample(a, b, None if g is None else g.detach().float())
    ref = _gemms(a, b, g, grad_input, grad_weight, lambda t: t)
    errors = {}
    for cand in CANDIDATES:
        if cand in _DTYPES:
            low = _DTYPES[cand]
            got = _gemms(a, b, g, grad_input, grad_weight, lambda t: t.to(low).float())
        elif float8:
            got = _float8(a, b, g, grad_input, grad_weight, cand, dtype)
        else:
            continue
        errors[cand] = {k: relative_error(v, ref[k]) for k, v in got.items()}
    named = {"input": a, "weight": b, **ref, **({"grad_output": g} if g is not None else {})}
    return errors, {k: float(v.abs().max()) if v.numel() else 0.0 for k, v in named.items()}


def _operands(ops: GemmOperands, node: fx.Node, env: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # Canonical [M, K] @ [K, N], or [B, M, K] @ [B, K, N] for a GEMM done per batch entry.
    a, b = env[ops.left], env[ops.right]
    b = b.t() if GEMM_OPS[node.target] == "linear" else b
    _, k, n = ops.mkn
    if ops.batch:
        return a.reshape(-1, *a.shape[-2:]), b.reshape(-1, k, n)
    return a.reshape(-1, k), b.reshape(k, n)


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
        self._pending: list[tuple[GemmMeasure, Any, Any, Any]] = []

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
        ops = gemm_operands(record.pre, node)
        if ops.a is None or not isinstance(value, torch.Tensor):
            return  # not a [.., K] @ [K, N] GEMM: no candidate to compare
        a, b = _operands(ops, node, env)
        measure_.grad_input, measure_.grad_weight = a.requires_grad, b.requires_grad
        entry = [measure_, a.detach(), b.detach(), None]
        self._pending.append(entry)
        if value.requires_grad:
            shape = (-1, *value.shape[-2:]) if ops.batch else (-1, value.shape[-1])
            value.register_hook(lambda g: entry.__setitem__(3, g.detach().reshape(shape)))

    def flush(self) -> None:
        """Measure every GEMM captured since the last flush, then let go of its tensors."""
        for m, a, b, g in self._pending:
            m.add(*candidate_errors(a, b, g, grad_input=m.grad_input and g is not None,
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
