"""Healing during training: promote the op that keeps overflowing to fp32, recompile, go on.

# Note [Healing]
A `Healer` watches a LossScaler at the loop's logging cadence. Every `every` observed steps it
reads the scaler's skipped-step counter and scale (one host read of two numbers; nothing
between reads, so no read is added to the step). When at least `skips` steps were skipped
since the last read, or a step was skipped with the scale at its floor, it runs
`locate_overflow` on the last batch it observed, at the scaler's floor scale (a dynamic scaler)
or its static scale. What overflows there is not the loss scale's doing: a forward overflow
does not depend on the scale, and a backward one that survives the floor is one loss scaling
cannot fix. If the locator names an op that ran in 16 bits, the healer promotes it to fp32
through the config's own overrides (the innermost module that ran it: `module_overrides`
{path: "fp32"}; an op outside every module: `op_overrides` {op: "fp32"}), recompiles the model
in place (fxamp/model/recompile.py) and logs the promotion with op, module and source line. On
a float8 model the promoted module (and its submodules) also joins float8's `skip_modules`, as
a plan's fp32 modules do: the override alone would leave its GEMMs in float8, with an fp32
output. An overflow that fp32 would not fix (the loss scale entering the backward, the loss
function, an op already in fp32) is logged and left alone. After `max_promotions` promotions it
stops and warns. Promotions are state: `state_dict()` holds them and `load_state_dict`
re-applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Mapping, Optional

import torch

from fxamp.config import AmpConfig
from fxamp.debug.locate import locate_overflow
from fxamp.errors import ConfigError
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.model.prepare import config_of
from fxamp.model.recompile import recompile

__all__ = ["Healer", "Promotion"]

log = logging.getLogger(__name__)

_KINDS = ("module_overrides", "op_overrides")


@dataclasses.dataclass(frozen=True)
class Promotion:
    """One op or module the healer moved to fp32, and why.

    `kind` is "module_overrides" or "op_overrides" and `key` the module path or op name added
    to it with "fp32"; the rest describes the overflow that caused it.
    """

    step: int
    kind: str
    key: str
    op: str
    module: str
    module_type: str
    phase: str
    source_line: str
    loss_scale: float

    def __str__(self) -> str:
        where = f"module {self.module!r} ({self.module_type})" if self.module else "top level"
        return (f"promoted {self.kind[:-len('_overrides')]} {self.key!r} to fp32 at step "
                f"{self.step}: {self.phase} {self.op} in {where} overflowed at loss scale "
                f"{self.loss_scale:g}; source {self.source_line or '?'}")


def _promotion(site: Any, config: AmpConfig, step: int,
               loss_scale: float) -> Optional[Promotion]:
    kind = next((k for k in _KINDS if k in site.fix), None)
    if kind is None:
        return None
    had = dict(getattr(config, kind))  # the fix is these overrides plus the new fp32 key
    key = next(k for k, v in dict(site.fix[kind]).items() if v == "fp32" and had.get(k) != v)
    return Promotion(step, kind, key, site.source_op or site.op, site.module, site.module_type,
                     site.phase, site.source_line, float(loss_scale))


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int")
    return value


class Healer:
    """Promote to fp32 the op that keeps a loss scaler skipping steps (Note [Healing]).

    Example:
        >>> healer = fxamp.Healer(model, scaler, F.cross_entropy, every=10)
        >>> for batch in loader:
        ...     x, y = batch
        ...     scaler.scale(F.cross_entropy(model(x), y)).backward()
        ...     scaler.step(opt); scaler.update(); opt.zero_grad()
        ...     healer.observe(batch)

    Args:
        model: a model prepared by `fxamp.compile` at a level that keeps its weights' dtypes
            when a module is promoted (O1; O2/O3 are refused: a promoted module's weights would
            change dtype under the optimizer).
        scaler: the enabled LossScaler the loop steps with.
        loss_fn: `loss_fn(output, target)`, as for `locate_overflow` (batches are then
            `(inputs, target)` pairs); None differentiates the sum of the outputs. The loss
            the loop computes, casts included: the locator reruns the step with it.
        every: read the scaler every `every` observed steps (one host read each time).
        skips: heal when at least this many steps were skipped since the last read (or one
            was, with the scale at its floor).
        max_promotions: stop healing, with a warning, after this many promotions.

    Raises:
        ConfigError: for a model not prepared by fxamp.compile, an O2/O3 model, a disabled or
            non-fxamp scaler, a non-callable loss_fn or a bad count.
    """

    def __init__(self, model: torch.nn.Module, scaler: LossScaler,
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
                 every: int = 10, skips: int = 3, max_promotions: int = 4) -> None:
        config = config_of(model) if isinstance(model, torch.nn.Module) else None
        if config is None:
            raise ConfigError(f"Healer takes a model prepared by fxamp.compile, not an "
                              f"unprepared {type(model).__name__}: call fxamp.compile(model, "
                              "opt_level='O1', ...) first")
        if config.model_dtype is not None:
            raise ConfigError(f"Healer needs O1 (weights kept in fp32), not {config.opt_level}: "
                              "promoting a module would change its weights' dtype under the "
                              "optimizer")
        if not isinstance(scaler, LossScaler) or not scaler.is_enabled():
            raise ConfigError(f"Healer takes the enabled fxamp.LossScaler the loop steps with, "
                              f"not {scaler!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable or None, not {type(loss_fn).__name__}")
        self.every, self.skips = _positive_int(every, "every"), _positive_int(skips, "skips")
        self.max_promotions = _positive_int(max_promotions, "max_promotions")
        self.model, self.scaler, self.loss_fn = model, scaler, loss_fn
        self._base = config  # the config before any promotion
        self.promotions: list[Promotion] = []
        self.reports: list[Any] = []
        """The locator's reports, oldest first."""
        self.steps = 0
        self._skipped_at_read = 0  # the scaler's count at the last read
        self._batch: Any = None

    @property
    def exhausted(self) -> bool:
        """Whether `max_promotions` were made: the healer no longer heals."""
        return len(self.promotions) >= self.max_promotions

    def observe(self, batch: Any) -> Optional[Promotion]:
        """Note one training step on `batch` (call it after the step); every `every` calls,
        read the scaler and heal if it keeps skipping. Returns the promotion made, or None."""
        self.steps += 1
        self._batch = batch  # a reference, not a copy: the locator reruns the latest batch
        if self.steps % self.every or self.exhausted:
            return None
        skipped, scale = self._read()
        new = int(skipped) - self._skipped_at_read
        self._skipped_at_read = int(skipped)
        at_floor = self.scaler.dynamic and scale <= self.scaler.rule.min_scale
        if new < self.skips and not (new and at_floor):
            return None
        return self._heal(new, scale)

    def _read(self) -> tuple[float, float]:
        # The one host read, every `every` steps: the skip counter and the scale together.
        return tuple(torch.stack([self.scaler.skipped_steps.double(),
                                  self.scaler.scale_tensor.double()]).tolist())

    def _locate_scale(self, scale: float) -> float:
        return self.scaler.rule.min_scale if self.scaler.dynamic else scale

    def _heal(self, new: int, scale: float) -> Optional[Promotion]:
        at = self._locate_scale(scale)
        report = locate_overflow(self.model, self._batch, self.loss_fn, loss_scale=at)
        self.reports.append(report)
        site = report.site
        promotion = None if site is None else _promotion(site, report.config, self.steps, at)
        if promotion is None:
            why = "no op overflows at that scale: the loss scale's own backoff" \
                if site is None else site.suggestion
            log.info("fxamp heal: %d steps skipped by step %d (loss scale %g); locator at "
                     "loss scale %g: %s; nothing promoted", new, self.steps, scale, at, why)
            return None
        self._apply([*self.promotions, promotion])
        log.warning("fxamp heal: %d steps skipped by step %d (loss scale %g); %s", new,
                    self.steps, scale, promotion)
        if self.exhausted:
            message = (f"fxamp heal: {len(self.promotions)} promotions made (max_promotions="
                       f"{self.max_promotions}); healing stops here. Promoted: "
                       f"{', '.join(p.key for p in self.promotions)}. If steps keep being "
                       "skipped, see docs/debugging_overflow.md (bf16, or fix the model)")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return promotion

    def config(self, promotions: Optional[list[Promotion]] = None) -> AmpConfig:
        """The model's config with `promotions` (default: the healer's) put first in its
        overrides, so that they win over a broader pattern of the user's. On a float8 model a
        promoted module (and its submodules) also joins `skip_modules`: fp32, not float8
        with an fp32 output."""
        promotions = self.promotions if promotions is None else promotions
        graph = self._base.graph
        fields = {}
        for kind in _KINDS:
            mine = tuple((p.key, "fp32") for p in promotions if p.kind == kind)
            keys = {k for k, _ in mine}
            theirs = tuple(pair for pair in getattr(graph, kind) if pair[0] not in keys)
            fields[kind] = mine + theirs
        if graph.float8 is not None:  # Note [Healing]: fp32 means out of float8 too
            keys = [k for p in promotions if p.kind == _KINDS[0] for k in (p.key, p.key + ".*")]
            skip = (*keys, *(k for k in graph.float8.skip_modules if k not in keys))
            fields["float8"] = dataclasses.replace(graph.float8, skip_modules=skip)
        return dataclasses.replace(self._base, graph=dataclasses.replace(graph, **fields))

    def _apply(self, promotions: list[Promotion]) -> None:
        recompile(self.model, self.config(promotions))  # refuses before changing anything
        self.promotions = list(promotions)

    def state_dict(self) -> dict[str, Any]:
        """The promotions (as dicts) and the counters; no host read."""
        return {"promotions": [dataclasses.asdict(p) for p in self.promotions],
                "steps": self.steps, "skipped_at_read": self._skipped_at_read}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-apply the promotions of a `state_dict()` to the model (recompiling it) and restore
        the counters. Promotions beyond `max_promotions` are applied all the same.

        Raises:
            ConfigError: a malformed state or a promotion naming no module of this model; the
                model and the healer are then unchanged.
        """
        try:
            promotions = [Promotion(**p) for p in state["promotions"]]
            steps, skipped = int(state["steps"]), int(state["skipped_at_read"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"Healer.load_state_dict: not a Healer.state_dict() ({e!r}); "
                              "expected keys 'promotions', 'steps', 'skipped_at_read'") from e
        bad = [p.kind for p in promotions if p.kind not in _KINDS]
        if bad:
            raise ConfigError(f"Healer.load_state_dict: promotion kind {bad[0]!r} is not one of "
                              f"{_KINDS}")
        self._apply(promotions)
        self.steps, self._skipped_at_read = steps, skipped

    def __repr__(self) -> str:
        keys = ", ".join(p.key for p in self.promotions) or "none"
        return f"Healer(every={self.every}, skips={self.skips}, promoted: {keys})"
