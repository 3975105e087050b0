"""Find the op that produced the first inf/NaN of a step, forward or backward.

`locate_overflow` runs one forward, loss and backward of a model through fxamp's own passes and
the graphs `compiler="aot_eager"` would run, checking every value as it is produced. The op
reported is the first whose floating inputs were all finite and whose output was not: a value
that only carries an earlier inf along is not a culprit, and neither is a mask built from an
explicit `-inf` argument.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fxamp._compat import TorchDispatchMode, pytree
from fxamp.config import AmpConfig
from fxamp.debug.instrument import (BACKWARD, FORWARD, GraphRecord, InstrumentingCompiler,
                                    Origin, backward, call_model, default_loss, display_name,
                                    origin_of, prepare_private, readable,
                                    tensors_of)
from fxamp.debug.report import (LOSS, Culprit, OverflowReport, OverflowSite, TensorSummary,
                                loss_site, make_site)

__all__ = ["locate_overflow", "OverflowLocator", "OverflowReport", "OverflowSite",
           "TensorSummary"]

log = logging.getLogger(__name__)


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(readable(t)).all()) for _, t in tensors)


def _nonfinite_literal(node: fx.Node) -> bool:
    # torch.full(..., -inf) and masked_fill(mask, -inf) build attention masks on purpose.
    return any(isinstance(a, float) and not math.isfinite(a)
               for a in pytree.tree_leaves((node.args, node.kwargs)))


class OverflowLocator(InstrumentingCompiler):
    """An inner compiler that checks every value of every forward and backward graph.

    `locate_overflow` uses it for one step; it also works as a debug mode for a training loop:
    `fxamp.compile(model, compiler=locator)` runs the aot_eager graphs node by node (slowly)
    and `locator.report(config_of(model))` says which op first overflowed since `reset()`.
    """

    def __init__(self) -> None:
        super().__init__(self._check)
        self.reset()

    def reset(self) -> None:
        self.culprits: list[Culprit] = []
        self.nonfinite_inputs: list[str] = []
        self.values_checked = {FORWARD: 0, BACKWARD: 0}

    def _check(self, record: GraphRecord, phase: str, node: fx.Node, value: Any,
               env: dict) -> None:
        self.values_checked[phase] += 1
        outputs = tensors_of(value)
        if _all_finite(outputs):
            return
        if node.op == "placeholder" and phase == FORWARD:
            self.nonfinite_inputs.append(f"{record.input_name(node)} (graph {record.index})")
            return
        inputs = [(display_name(x, phase, record) + sfx, t) for x in node.all_input_nodes
                  for sfx, t in tensors_of(env[x])]
        if not _all_finite(inputs) or _nonfinite_literal(node):
            return  # an earlier inf carried along, or one the user wrote
        if node.op == "placeholder" and not node.name.startswith("tangents"):
            return  # a saved forward value: already checked in the forward
        self.culprits.append(Culprit(
            origin_of(node, phase, record),
            tuple(TensorSummary.of(n, t) for n, t in inputs),
            tuple(TensorSummary.of(node.name + sfx, t) for sfx, t in outputs)))

    def report(self, config: AmpConfig, *, loss_scale: float = 1.0,
               loss: Optional[float] = None) -> OverflowReport:
        """The culprits found since `reset()` as an OverflowReport."""
        sites = tuple(make_site(c, config, loss_scale) for c in self.culprits)
        return OverflowReport(config, float(loss_scale), sites, tuple(self.nonfinite_inputs),
                              dict(self.values_checked), loss)


class _WatchLoss(TorchDispatchMode):
    """The first op of an eager loss_fn with finite inputs and a non-finite output."""

    def __init__(self) -> None:
        super().__init__()
        self.culprit: Optional[Culprit] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.culprit is None:
            ins = [(f"arg{i}", t) for i, t in enumerate(pytree.tree_leaves((args, kwargs)))
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
            outs = [("loss" + s, t) for s, t in tensors_of(out)]
            if not _all_finite(outs) and _all_finite(ins):
                origin = Origin(LOSS, -1, "loss_fn", str(func), "", "", "", "", "")
                self.culprit = Culprit(origin, tuple(TensorSummary.of(n, t) for n, t in ins),
                                        tuple(TensorSummary.of(n, t) for n, t in outs))
        return out


def locate_overflow(model_or_fn: Callable, batch: Any,
                    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
                    loss_scale: float = 1.0, opt_level: Optional[str] = None,
                    config: Optional[AmpConfig] = None, **overrides: Any) -> OverflowReport:
    """Run one step under fxamp, checking every op, and report the first to overflow.

    The forward and backward graphs are the ones `fxamp.compile(..., compiler="aot_eager")`
    runs (same casts and dtypes), executed node by node on a private copy of the model, so
    the caller's model, its gradients and its BatchNorm statistics are left alone. Opt-in:
    nothing of this runs unless it is called.

    Args:
        model_or_fn: an nn.Module (one already prepared by `fxamp.compile` keeps its config)
            or a function of tensors.
        batch: the model's inputs (a tensor or a tuple of them); with `loss_fn`, a pair
            `(inputs, target)` as a DataLoader yields it.
        loss_fn: `loss_fn(output, target) -> loss`, run eagerly like a training loop does;
            None differentiates the fp32 sum of the outputs.
        loss_scale: multiplies the loss before backward, as a loss scaler does: pass your
            scaler's current scale (`scaler.get_scale()`) to reproduce a skipped step.
        opt_level, config, **overrides: as for `fxamp.compile` (default O1).

    Returns:
        An OverflowReport: `report.site` is the first op that produced an inf/NaN (phase,
        ATen op, module path, source line, input/output ranges, a suggested `fix`), or None.
        The backward runs only when the forward and the loss are finite.
    """
    locator = OverflowLocator()
    prepared = prepare_private(model_or_fn, locator, config=config, opt_level=opt_level,
                               overrides=overrides)
    outputs, target = call_model(prepared, batch, loss_fn is not None)
    config = prepared.config
    watch = _WatchLoss()
    with watch:
        loss = loss_fn(outputs, target) if loss_fn is not None else default_loss(outputs)
    loss_value = None if loss is None else float(loss.detach().float().sum())
    report = locator.report(config, loss_scale=loss_scale, loss=loss_value)
    if report.found or (loss_value is not None and not math.isfinite(loss_value)):
        if not report.found and watch.culprit is not None:
            report = dataclasses.replace(report, sites=(loss_site(watch.culprit),))
    elif backward(loss, loss_scale):  # only after a finite forward: else all grads are inf/NaN
        report = locator.report(config, loss_scale=loss_scale, loss=loss_value)
    log.info("locate_overflow: %s", report.site.headline if report.found else "all finite")
    return report
