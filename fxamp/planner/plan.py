"""`PrecisionPlan`: what the planner chose for every GEMM, and why, as plain frozen data.

A plan is applied through the existing configuration (docs/planner.md, "Applying a plan"):
modules whose GEMMs need fp32 get a module override, modules whose GEMMs stay in the 16-bit
dtype although float8 could run them go into the float8 `skip_modules` filter, and every
planned module's reason rides along in `plan_reasons`, so `explain()` prints it next to the
decision it explains. Nothing here measures or imports the planner's measuring code.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.float8.config import Float8Config
from fxamp.planner import plan_json
from fxamp.planner.cost import Target
from fxamp.planner.report import format_plan
from fxamp.provenance import OpSite

__all__ = ["PlannedGemm", "PrecisionPlan", "FLOAT8_RECIPES", "BLOCK_RECIPES", "RECIPES", "ROOT"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")  # what fxamp.plan considers by default
BLOCK_RECIPES = ("mxfp8", "nvfp4")  # asked for by name: recipes=("mxfp8", "nvfp4")
RECIPES = FLOAT8_RECIPES + BLOCK_RECIPES
ROOT = "<root>"  # the module path of a GEMM at the model's top level, as the float8 pass says
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PlannedGemm(OpSite):
    """One GEMM node: where it is, what was measured and modeled, what runs and why.

    `precision` is "fp32", the plan's 16-bit dtype ("bf16" / "fp16") or its float8 recipe.
    `errors` are (candidate, worst relative error of output/grad_input/grad_weight against
    fp32) pairs; `times` (precision, modeled seconds of a training step) pairs; `max_abs` the
    largest |x| of its operands, output and gradients (fp16 overflows above 65504).
    """

    module_type: str
    source_line: str
    shape: Optional[tuple[int, int, int]]
    batch: int
    grads: tuple[str, ...]
    float8_refusal: Optional[str]
    errors: tuple[tuple[str, float], ...]
    times: tuple[tuple[str, float], ...]
    max_abs: float
    precision: str
    reason: str

    def error(self, precision: str) -> float:
        return 0.0 if precision == "fp32" else dict(self.errors).get(precision, float("inf"))

    def time(self, precision: str) -> Optional[float]:
        return dict(self.times).get(precision)


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """What `fxamp.plan` chose. `str(plan)` / `plan.explain()` is the table; apply it with
    `fxamp.compile(model, plan=plan)`; save it with `to_json()`, load with `from_json()`."""

    target: Target
    error_budget: float
    dtype: str
    recipe: Optional[str]
    sites: tuple[PlannedGemm, ...]
    batches: int = 1
    batch_scale: float = 1.0
    planning_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp16"):
            raise ConfigError(f"plan dtype={self.dtype!r} is not one of 'bf16', 'fp16'")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(f"plan recipe={self.recipe!r} is not one of "
                              f"{', '.join(map(repr, RECIPES))} or None")
        if not (isinstance(self.error_budget, float) and 0 < self.error_budget < 1):
            raise ConfigError(f"plan error_budget={self.error_budget!r} must be a float in "
                              "(0, 1)")
        valid = ("fp32", self.dtype, *((self.recipe,) if self.recipe else ()))
        for s in self.sites:
            if s.precision not in valid:
                raise ConfigError(f"plan site {s.module!r} ({s.node}): precision "
                                  f"{s.precision!r} is not one of {', '.join(map(repr, valid))}")

    def with_precision(self, module: str, precision: str, reason: str) -> "PrecisionPlan":
        """A copy with every GEMM of `module` in `precision` for `reason` (how a promotion to
        fp32, by hand or by healing, becomes a new plan)."""
        if module not in {s.module for s in self.sites}:
            raise ConfigError(f"module {module!r} has no GEMM in this plan; planned modules: "
                              f"{sorted({s.module for s in self.sites})[:6]}")
        sites = tuple(dataclasses.replace(s, precision=precision, reason=reason)
                      if s.module == module else s for s in self.sites)
        return dataclasses.replace(self, sites=sites)

    # ------------------------------------------------------------------ what it amounts to
    def modules(self, precision: str) -> list[str]:
        """Module paths with a GEMM that runs in `precision`."""
        return sorted({s.module for s in self.sites if s.precision == precision})

    def step_time(self, precision: Optional[str] = None) -> float:
        """Modeled seconds of the GEMMs of one training step: as planned, or all in one
        precision (float8 only where float8 can run the GEMM, the 16-bit dtype elsewhere)."""
        total = 0.0
        for s in self.sites:
            want = precision or s.precision
            t = s.time(want) if s.time(want) is not None else s.time(self.dtype)
            total += t or 0.0
        return total

    def float8_config(self) -> Optional[Float8Config]:
        if self.recipe is None or not self.modules(self.recipe):
            return None
        skip = sorted({s.module for s in self.sites
                       if s.float8_refusal is None and s.precision != self.recipe})
        return Float8Config(recipe=self.recipe, skip_modules=tuple(skip), min_dim=1)

    def module_overrides(self) -> dict[str, str]:
        return {m: "fp32" for m in self.modules("fp32") if m != ROOT}

    def reasons(self) -> tuple[tuple[str, str], ...]:
        """(module path, why) for every planned module, as `plan_reasons` carries them."""
        by_module: dict[str, list[str]] = {}
        for s in self.sites:
            by_module.setdefault(s.module, []).append(s.reason)
        return tuple((m, " | ".join(dict.fromkeys(r))) for m, r in sorted(by_module.items()))

    def to_config(self, *, opt_level: str = "O1", **overrides: Any) -> AmpConfig:
        """The AmpConfig that applies this plan (at `opt_level`, O1 unless given; O2 works
        too) with any other `AmpConfig.from_opt_level` keywords."""
        taken = sorted(set(overrides) & {"dtype", "float8", "module_overrides", "plan_reasons"})
        if taken:
            raise ConfigError(f"{', '.join(k + '=' for k in taken)} conflicts with plan=: the "
                              f"plan sets {', '.join(taken)} itself; edit the plan (or pass "
                              "config=plan.to_config(...) and change that) instead")
        return AmpConfig.from_opt_level(
            opt_level, dtype=self.dtype, module_overrides=self.module_overrides() or None,
            float8=self.float8_config(), plan_reasons=self.reasons(), **overrides)

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model that lacks a module the plan names (a plan made for another model)."""
        paths = {path for path, _ in model.named_modules()}
        missing = sorted({s.module for s in self.sites} - paths - {ROOT})
        if missing:
            raise ConfigError(f"the plan names modules {missing[:4]} that "
                              f"{type(model).__name__} does not have: it was made for another "
                              "model; plan this one with fxamp.plan(model, batch, loss_fn)")

    # ----------------------------------------------------------------------- reporting
    def explain(self) -> str:
        """The table: each GEMM, its shape, errors, modeled times, choice and reason."""
        return format_plan(self)

    __str__ = explain

    # ------------------------------------------------------------------------- JSON
    def to_json(self, path: Optional[str] = None) -> str:
        """The plan as strict JSON text (also written to `path`): no `Infinity` or `NaN`, a
        non-finite float is the string "inf", "-inf" or "nan"."""
        text = plan_json.dumps(self, {"fxamp_plan": _VERSION})
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str) -> "PrecisionPlan":
        """A plan from `to_json()`'s text or a file holding it: every field, no other, each of
        its type, or a ConfigError naming the field."""
        text = text_or_path
        if not text.lstrip().startswith("{"):
            with open(text_or_path) as f:
                text = f.read()
        data = plan_json.loads(text)
        if not isinstance(data, dict) or data.pop("fxamp_plan", None) != _VERSION:
            raise ConfigError(f"not an fxamp plan (version {_VERSION}): the JSON has no "
                              f"'fxamp_plan': {_VERSION} key; write it with plan.to_json()")
        return plan_json.read(data, cls, "")
