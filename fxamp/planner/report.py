"""The printed form of a PrecisionPlan: one row per GEMM, then the modeled step times."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxamp.planner.plan import PrecisionPlan

__all__ = ["format_plan", "us"]

_ERRORS = ("bf16", "fp16", "tensorwise", "rowwise")


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def _err(value: float) -> str:
    return "-" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.3g}"


def _shape(shape, batch: int) -> str:
    return "-" if shape is None else (f"{batch}*" if batch else "") + "x".join(map(str, shape))


def format_plan(plan: "PrecisionPlan") -> str:
    budget, recipe = plan.error_budget, plan.recipe
    f8 = recipe or "tensorwise"
    title = (f"fxamp precision plan | target {plan.target.name} | error budget {budget:g} "
             f"(relative error, SQNR >= {20 * math.log10(1 / budget):.0f} dB) | dtype "
             f"{plan.dtype} | float8 {recipe or 'none'} | {plan.batches} calibration "
             f"batch(es), costs at {plan.batch_scale:g}x their size")
    header = ("module", "op", "[B*]MxKxN", "err bf16", "fp16", "f8 tw", "f8 rw",
              "us fp32", plan.dtype, "float8", "runs in", "why")
    body = []
    for s in plan.sites:
        errs = [_err(dict(s.errors).get(c, math.nan)) for c in _ERRORS]
        times = [s.time(p) for p in ("fp32", plan.dtype, f8)]
        body.append((s.module, s.op.replace("aten.", "").replace(".default", ""),
                     _shape(s.shape, s.batch), *errs,
                     *("-" if t is None else f"{t * 1e6:.1f}" for t in times),
                     s.precision, s.reason))
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header) - 1)]
    fmt = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + row[-1]
    n8 = sum(s.precision == recipe for s in plan.sites)
    times = [f"plan {us(plan.step_time())}", f"all {plan.dtype} {us(plan.step_time(plan.dtype))}",
             f"all float8 {f8} {us(plan.step_time(f8))}", f"all fp32 {us(plan.step_time('fp32'))}"]
    return "\n".join([title, fmt(header), *(fmt(r) for r in body),
                      f"float8: {n8} of {len(plan.sites)} GEMMs | modeled GEMM time of a "
                      f"training step on {plan.target.name}: " + ", ".join(times),
                      f"planning took {plan.planning_seconds:.1f} s"])
