"""`fxamp.plan`: measure, model, choose (docs/planner.md).

Each GEMM gets the cheapest precision, by the modeled time of a training step on the target,
whose measured error stays within the budget: float8 only where float8 can run the GEMM, stays
within the budget and beats the 16-bit dtype casts included; the 16-bit dtype where its error
is within the budget; fp32 otherwise. Then the choices are made per module, because the
configuration applies them per module (Note [A plan is applied per module]).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from fxamp import validation
from fxamp._compat import pytree
from fxamp.errors import ConfigError
from fxamp.float8.config import recipe_refusal
from fxamp.planner.cost import (BLOCK_SCALED, GemmShape, PRECISIONS, Target, as_target, cast_time,
                                gemm_time)
from fxamp.planner.measure import GemmMeasure, measure
from fxamp.planner.plan import FLOAT8_RECIPES, RECIPES, ROOT, PlannedGemm, PrecisionPlan
from fxamp.planner.report import duration
from fxamp.model.prepare import backend_of

__all__ = ["plan", "DEFAULT_ERROR_BUDGET"]

log = logging.getLogger(__name__)

DEFAULT_ERROR_BUDGET = 0.1  # relative error 10 %, SQNR 20 dB (docs/planner.md says why)
_LOW = {"bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16",
        "fp16": "fp16", "float16": "fp16", torch.float16: "fp16"}


def _worst(m: GemmMeasure, candidate: str) -> tuple[float, str]:
    errors = m.errors.get(candidate, {})
    if not errors:
        return (0.0, "") if candidate == "fp32" else (float("inf"), "")
    tensor = max(errors, key=errors.get)
    return errors[tensor], tensor


def _cost_shape(m: GemmMeasure, scale: float) -> GemmShape:
    rows, k, n = m.shape
    batch = max(1, round(m.batch * scale)) if m.batch else 1
    rows = rows if m.batch else max(1, round(rows * scale))
    return GemmShape(rows, k, n, batch, m.grad_input, m.grad_weight)


# Note [Block-scaled recipes on the roofline]: mxfp8 and nvfp4 run on block-scaled tensor cores
# (compute capability 10.0+); a target without them (H100, H200, the CPU: `Target.supports`)
# has no time for them, so a GEMM they could run stays in the 16-bit dtype and its reason
# names the target. Their errors are measured all the same: a plan for a B200 can be made on
# any machine the emulated lowering runs on.
def _decide(m: GemmMeasure, recipe: Optional[str], low: str, budget: float,
            times: dict[str, float], casts: float, target: Target) -> tuple[str, str]:
    # Each reason is "<precision>: <sentences>" (golden texts in tests/test_planner.py).
    # recipe None: no recipe can run here, so every GEMM has a float8 refusal (_without).
    (e16, where16), t16 = _worst(m, low), times.get(low)
    if e16 > budget:
        if e16 == float("inf"):
            return "fp32", (f"fp32: {low} overflows in its {where16} (its largest |x| is "
                            f"{max(m.max_abs.values()):.3g}).")
        return "fp32", (f"fp32: the {low} error of its {where16}, {e16:.3g}, exceeds the "
                        f"budget {budget:g}.")
    if m.refusal(recipe) is not None:
        return low, (f"{low}: float8 cannot run it ({m.refusal(recipe)}); the {low} error is "
                     f"{e16:.3g}.")
    if recipe not in times:  # Note [Block-scaled recipes on the roofline]
        return low, (f"{low}: the target {target.name} has no {recipe} tensor cores, so float8 "
                     f"{recipe} is not modeled; the {low} error is {e16:.3g}.")
    (e8, where8), t8 = _worst(m, recipe), times[recipe]
    if e8 > budget:
        return low, (f"{low}: the float8 {recipe} error of its {where8}, {_num(e8)}, exceeds "
                     f"the budget {budget:g}; the {low} error is {e16:.3g}.")
    if t8 >= t16:
        return low, (f"{low}: float8 {recipe} would take {duration(t8)} a step against "
                     f"{duration(t16)} in {low} (its casts alone take "
                     f"{duration(casts)}); its error {e8:.3g} is within the budget {budget:g}.")
    return recipe, (f"float8 {recipe}: {duration(t8)} a step against {duration(t16)} in {low} "
                    f"({t16 / t8:.2f}x faster, casts included); its error {e8:.3g} is within "
                    f"the budget {budget:g}.")


def _num(x: float) -> str:
    return "inf (an overflow)" if x == float("inf") else f"{x:.3g}"


def _planned(m: GemmMeasure, recipe: Optional[str], low: str, budget: float, target: Target,
             scale: float, unmeasured: str = "") -> PlannedGemm:
    times: dict[str, float] = {}
    casts = 0.0
    if m.shape is not None:  # a shape float8 can take: the cost model times it
        shape = _cost_shape(m, scale)
        times = {p: gemm_time(shape, p, target) for p in PRECISIONS if target.supports(p) and (
            p not in RECIPES or (m.float8_refusal is None and (
                p in FLOAT8_RECIPES or (p == recipe and m.refusal(p) is None))))}
        casts = cast_time(shape, target, recipe if recipe in BLOCK_SCALED else "tensorwise")
    if m.errors:
        precision, reason = _decide(m, recipe, low, budget, times, casts, target)
        reason += unmeasured if m.float8_refusal is None else ""
    else:
        precision, reason = low, (f"{low}: its result is not floating point, so no precision "
                                  "was measured.")
    errors = tuple((c, _worst(m, c)[0]) for c in m.errors)
    grads = tuple(g for g, on in (("grad_input", m.grad_input), ("grad_weight", m.grad_weight))
                  if on)
    return PlannedGemm(**dataclasses.asdict(m.site), module_type=m.module_type,
                       source_line=m.source_line, shape=m.shape, batch=m.batch, grads=grads,
                       float8_refusal=m.refusal(recipe), errors=errors,
                       times=tuple(times.items()), max_abs=max(m.max_abs.values(), default=0.0),
                       precision=precision, reason=reason)


# Note [A plan is applied per module]: fp32 reaches a GEMM through a module override, which
# covers every compute op of its module, and float8 is kept off through the float8
# `skip_modules` filter, which covers every GEMM of its module. So a module with one GEMM that
# needs fp32 runs all its GEMMs in fp32, and one with a GEMM that stays in the 16-bit dtype
# though float8 could run it keeps all its GEMMs out of float8; each changed record says so.
# A GEMM at the top level has no module to override: it stays in the 16-bit dtype, and says so.
def _per_module(sites: list[PlannedGemm], recipe: Optional[str],
                low: str) -> list[PlannedGemm]:
    out = []
    for s in sites:
        mates = [t for t in sites if t.module == s.module and t is not s]
        if s.precision == "fp32" and s.module == ROOT:
            s = dataclasses.replace(s, precision=low, reason=s.reason + " No module override "
                                    f"can reach a GEMM at the top level, so it stays {low}.")
        elif s.precision != "fp32" and s.module != ROOT and any(
                t.precision == "fp32" for t in mates):
            s = dataclasses.replace(s, precision="fp32", reason=s.reason + " It runs in fp32 "
                                    "with the rest of its module: a module override covers all "
                                    "its ops.")
        elif s.precision == recipe and any(t.precision == low and t.float8_refusal is None
                                           for t in mates):
            s = dataclasses.replace(s, precision=low, reason=s.reason + f" It stays {low} with "
                                    "another GEMM of its module: skip_modules is per module.")
        out.append(s)
    return out


# Note [A recipe this device cannot run is not measured]: the planner asks of each recipe
# the question the float8 pass asks before it compiles (`recipe_refusal`: can this torch run
# its `torch._scaled_mm` on the model's device?). A recipe it cannot run is not measured and
# not chosen, so every plan can be applied where it was made (torch 2.11 on CPU runs only
# tensor scales: its plans are tensorwise). The plan says why: where float8 could run a GEMM,
# its reason adds "float8 rowwise was not measured: ..."; where no recipe asked for can run,
# that is the GEMM's float8 refusal. (Measuring such a recipe by an emulation was the other
# choice; docs/planner.md says why not.)
def _without(refused: dict[str, str], runnable: tuple[str, ...], measures: list[GemmMeasure],
             device: str) -> tuple[list[GemmMeasure], str]:
    # (the measures, each with float8's refusal when no recipe can run; the sentence that
    # the reasons of GEMMs float8 could run add when some recipe cannot)
    here = f"torch {torch.__version__} cannot run"
    if not runnable:
        why = "; ".join(f"{here} float8 {r} on {device}; {w}" for r, w in refused.items())
        return [m if m.float8_refusal else dataclasses.replace(m, float8_refusal=why)
                for m in measures], ""
    return measures, "".join(f" float8 {r} was not measured: {here} it on {device}; {w}."
                             for r, w in refused.items())


def _check(model: Any, error_budget: Any, dtype: Any, recipes: Any) -> tuple[float, str, tuple]:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxamp.plan takes an nn.Module, not {type(model).__name__}")
    if backend_of(model) is not None:
        raise ConfigError("fxamp.plan needs the model before fxamp.compile: plan the "
                          "uncompiled model, then fxamp.compile(model, plan=plan)")
    budget = validation.real(error_budget, "error_budget", "a relative error in (0, 1), e.g. "
                             f"{DEFAULT_ERROR_BUDGET} (SQNR 20 dB)")
    if not 0 < budget < 1:
        raise ConfigError(f"error_budget={error_budget!r} must be a relative error in (0, 1), "
                          f"e.g. {DEFAULT_ERROR_BUDGET} (SQNR 20 dB)")
    if _LOW.get(dtype) is None:
        raise ConfigError(f"dtype={dtype!r} is not one of 'bf16', 'fp16' (torch.bfloat16, "
                          "torch.float16): the 16-bit dtype of the plan")
    recipes = (recipes,) if isinstance(recipes, str) else tuple(recipes)
    if not recipes or any(r not in RECIPES for r in recipes):
        raise ConfigError(f"recipes={recipes!r} must name float8 recipes among "
                          f"{', '.join(map(repr, RECIPES))}")
    return budget, _LOW[dtype], recipes


def _batch_scale(example_batch: Any, with_target: bool, batch_size: Optional[int]) -> float:
    if batch_size is None:
        return 1.0
    validation.positive_int(batch_size, "batch_size")
    inputs = example_batch[0] if with_target and isinstance(example_batch, (tuple, list)) \
        else example_batch
    first = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)
                  and t.dim() > 0), None)
    if first is None:
        raise ConfigError("batch_size= scales the calibration batch, but its inputs hold no "
                          "tensor with a batch dimension; leave batch_size out")
    return batch_size / first.shape[0]


def plan(model: torch.nn.Module, example_batch: Any,
         loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
         target: Union[str, Target] = "h100", error_budget: float = DEFAULT_ERROR_BUDGET,
         dtype: Any = "bf16", recipes: Sequence[str] = FLOAT8_RECIPES,
         batches: Iterable[Any] = (), batch_size: Optional[int] = None) -> PrecisionPlan:
    """Choose a precision for every GEMM of `model` from measurements and a cost model.

    Args:
        model: an nn.Module not yet prepared by `fxamp.compile` (it is left untouched: a
            private fp32 copy is measured).
        example_batch: a calibration batch: the model's inputs, or `(inputs, target)` with
            `loss_fn`, as `fxamp.locate_overflow` takes it.
        loss_fn: `loss_fn(output, target) -> loss`; None differentiates the sum of outputs.
        target: "h100", "h200", "b200", "cpu" or a `fxamp.planner.Target`.
        error_budget: the largest relative error (||x - x_fp32|| / ||x_fp32||) a GEMM's
            output, grad_input or grad_weight may have in its chosen precision.
        dtype: the 16-bit dtype, "bf16" (default) or "fp16".
        recipes: the float8 recipes to consider (default tensorwise and rowwise; the
            block-scaled "mxfp8" and "nvfp4" by name); the plan uses the one whose plan models
            fastest (one recipe per model: Float8Config has one). A recipe this torch cannot
            run on the model's device is not considered, and the reasons say so; a
            block-scaled one is timed only on a target with its tensor cores ("b200").
        batches: more calibration batches (errors and ranges are the worst over all).
        batch_size: the training batch size the costs are modeled at, when larger than the
            calibration batch: GEMM rows (batch entries of batched GEMMs) scale with it.

    Returns:
        A PrecisionPlan; apply it with `fxamp.compile(model, plan=plan)`.
    """
    start = time.perf_counter()
    budget, low, recipes = _check(model, error_budget, dtype, recipes)
    target = as_target(target)
    scale = _batch_scale(example_batch, loss_fn is not None, batch_size)
    device = next(t for t in (*model.parameters(), *model.buffers())).device.type
    dtype16 = torch.bfloat16 if low == "bf16" else torch.float16
    refused = {r: why for r in recipes if (why := recipe_refusal(r, device, dtype16))}
    runnable = tuple(r for r in recipes if r not in refused)
    measures, count = measure(model, [example_batch, *batches], loss_fn, dtype=dtype16,
                              device_type=device, recipes=runnable)
    measures, unmeasured = _without(refused, runnable, measures, device)
    options = []
    for recipe in runnable or (None,):
        sites = _per_module([_planned(m, recipe, low, budget, target, scale, unmeasured)
                             for m in measures], recipe, low)
        options.append(PrecisionPlan(target, budget, low, recipe, tuple(sites), count, scale))
    # the fastest; between equally fast recipes (same bytes, same peak), the more accurate
    best = min(options, key=lambda p: (p.step_time(), sum(s.error(s.precision) for s in p.sites)))
    if not best.modules(best.recipe):
        best = dataclasses.replace(best, recipe=None)
    best = dataclasses.replace(best, planning_seconds=time.perf_counter() - start)
    log.info("fxamp.plan: %d GEMMs, float8 %s: %s; fp32: %s", len(best.sites), best.recipe,
             best.modules(best.recipe or ""), best.modules("fp32"))
    return best
