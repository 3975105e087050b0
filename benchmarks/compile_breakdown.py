"""Where a recipe's cold compile goes: Dynamo capture, fxamp's re-trace and passes, AOTAutograd,
Inductor, and the optimizer's graphs.

bench_e2e takes a `snapshot()` of torch's compile-time counters before a recipe's first step,
between its model part (forward, loss, backward) and its optimizer part, and after; `breakdown`
turns the differences into the parts below. torch keeps these counters for every function it
times with `dynamo_timed` (`fxamp._compat.compile_time_metrics()`, seconds per call);
the names used here exist on torch 2.11 to 2.14 and nest like this:

    _compile.compile_inner                     Dynamo: bytecode capture + the backend call
      OutputGraph.call_user_compiler           the backend (fxamp's, or Inductor's compile_fx)
        [fxamp: re-trace to ATen + passes]     CompiledGraph.trace_s / passes_s
        create_aot_dispatcher_function         AOTAutograd: joint trace, partition ...
          compile_fx_inner                     ... and Inductor on the forward graph
    compile_fx.<locals>.bw_compiler            at the first backward: AOTAutograd's backward ...
      compile_fx_inner                         ... and Inductor on it

So: Dynamo capture = compile_inner - call_user_compiler; AOTAutograd = create_aot_dispatcher_
function + bw_compiler - compile_fx_inner; Inductor = compile_fx_inner; optimizer graphs = the
wall time of the first optimizer step (fxamp compiles its step there; torch's fused AdamW runs
eagerly); "other" = the recipe's compile time (first step minus a steady one) minus all of them
(guards, cache look-ups, the backend's own work outside AOTAutograd, first-call overheads).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from fxamp import _compat

DYNAMO, BACKEND = "_compile.compile_inner", "OutputGraph.call_user_compiler"
AOT, AOT_BACKWARD, INDUCTOR = ("create_aot_dispatcher_function", "compile_fx.<locals>.bw_compiler",
                               "compile_fx_inner")
PARTS = ("dynamo_s", "fxamp_s", "aot_s", "inductor_s", "optimizer_s", "other_s")
LABELS = ("Dynamo capture", "fxamp re-trace + passes", "AOTAutograd", "Inductor",
          "optimizer graphs", "other")


def snapshot() -> dict[str, float]:
    """Seconds spent so far in each function torch times while compiling."""
    return {name: sum(times) for name, times in _compat.compile_time_metrics().items()}


@dataclasses.dataclass
class Breakdown:
    dynamo_s: float
    fxamp_s: float
    aot_s: float
    inductor_s: float
    optimizer_s: float
    other_s: float
    total_s: float


def breakdown(before: dict[str, float], after_model: dict[str, float], fxamp_s: float,
              optimizer_s: float, total_s: float) -> Breakdown:
    """The parts of `total_s` (a recipe's compile time) from snapshots taken before its first
    step and after the first step's model part; `fxamp_s` from its CompiledGraphs."""
    def spent(name: str) -> float:
        return after_model.get(name, math.nan) - before.get(name, 0.0)

    dynamo = spent(DYNAMO) - spent(BACKEND)
    inductor = spent(INDUCTOR)
    aot = spent(AOT) + (spent(AOT_BACKWARD) if AOT_BACKWARD in after_model else 0.0) - inductor
    parts = [dynamo, fxamp_s, aot, inductor, optimizer_s]
    return Breakdown(*parts, total_s - sum(p for p in parts if not math.isnan(p)), total_s)


def rows(named: list[tuple[str, str, Optional[Breakdown]]]) -> list[str]:
    """A markdown table: seconds per part, and each part's share of the compile time, per
    (model, recipe, breakdown)."""
    out = ["| model | recipe | compile (s) | " + " | ".join(LABELS) + " |",
           "|---|---|---:|" + "---:|" * len(LABELS)]
    for model, recipe, b in named:
        if b is not None:
            cells = [_cell(getattr(b, part), b.total_s) for part in PARTS]
            out.append(f"| {model} | {recipe} | {b.total_s:.1f} | " + " | ".join(cells) + " |")
    return out


def _cell(seconds: float, total: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    share = f" ({100 * seconds / total:.0f}%)" if total > 0 else ""
    return f"{seconds:.2f}{share}"
