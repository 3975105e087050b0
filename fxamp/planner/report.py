"""The printed form of a PrecisionPlan: one row per GEMM, then the modeled step times."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxamp.planner.plan import PrecisionPlan

__all__ = ["format_plan", "duration"]

_ERRORS = ("bf16", "fp16", "tensorwise", "rowwise")


_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))


def duration(seconds: float) -> str:
    """Seconds in the unit that reads best, to 3 significant digits: "850 ns", "12.3 us",
    "4.57 ms", "1.5 s"."""
    if seconds == 0:
        return "0 s"
    # 0.9995 of a unit rounds to "1" of it; below 1 ns, fractions of a ns
    scale, unit = next(((s, u) for s, u in _UNITS if abs(seconds) >= 0.9995 * s), _UNITS[-1])
    value = seconds / scale
    return f"{value:.0f} {unit}" if abs(value) >= 999.5 else f"{value:.3g} {unit}"


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
              "t fp32", plan.dtype, "float8", "runs in", "why")
    body = []
    for s in plan.sites:
        errs = [_err(dict(s.errors).get(c, math.nan)) for c in _ERRORS]
        times = [s.time(p) for p in ("fp32", plan.dtype, f8)]
        body.append((s.module, s.op.replace("aten.", "").replace(".default", ""),
                     _shape(s.shape, s.batch), *errs,
                     *("-" if t is None else duration(t) for t in times),
                     s.precision, s.reason))
    widths = [max(len(str(r[i])) for r in [header, *body]) for i in range(len(header) - 1)]
    fmt = lambda row: "  ".join(str(v).ljust(w) for v, w in zip(row, widths)) + "  " + row[-1]
    n8 = sum(s.precision == recipe for s in plan.sites)
    times = [f"plan {duration(plan.step_time())}",
             f"all {plan.dtype} {duration(plan.step_time(plan.dtype))}",
             f"all float8 {f8} {duration(plan.step_time(f8))}",
             f"all fp32 {duration(plan.step_time('fp32'))}"]
    return "\n".join([title, fmt(header), *(fmt(r) for r in body),
                      f"float8: {n8} of {len(plan.sites)} GEMMs | modeled GEMM time of a "
                      f"training step on {plan.target.name}: " + ", ".join(times),
                      f"planning took {plan.planning_seconds:.1f} s"])
