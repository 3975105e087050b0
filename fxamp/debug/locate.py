"""Find the op that produced the first inf/NaN of a step, forward or backward.

`locate_overflow` runs one forward, loss and backward of a model through fxamp's own passes and
the graphs `compiler="aot_eager"` would run, checking every value as it is produced. The op
reported is the first whose floating inputs were all finite and whose output was not: a value
that only carries an earlier inf along is not a culprit, and neither is a mask built from an
explicit `-inf` argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxamp.config import AmpConfig
from fxamp.debug.instrument import (BACKWARD, FORWARD, GraphRecord, InstrumentingCompiler,
                                    Origin, backward, call_model, default_loss, describe_config,
                                    display_name,
                                    origin_of, prepare, tensors_of)
from fxamp.passes.annotate import short_dtype
from fxamp.passes.insert_casts import is_fxamp_cast

__all__ = ["locate_overflow", "OverflowLocator", "OverflowReport", "OverflowSite",
           "TensorSummary"]

LOSS = "loss"


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """One tensor next to an overflow: dtype, shape, largest finite |x|, inf/NaN count."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    nonfinite: int
    numel: int

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorSummary":
        a = t.detach().abs()
        finite = torch.isfinite(a)
        max_abs = float(torch.where(finite, a, 0).max()) if a.numel() else 0.0
        return cls(name, short_dtype(t.dtype), tuple(t.shape), max_abs,
                   int((~finite).sum()), t.numel())

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        bad = f", {self.nonfinite}/{self.numel} inf/nan" if self.nonfinite else ""
        return f"{self.name}: {self.dtype}[{shape}] max|x| {self.max_abs:.4g}{bad}"


@dataclasses.dataclass(frozen=True)
class OverflowSite:
    """The op that produced a non-finite value, and how to keep it finite.

    `phase` is "forward", "backward" or "loss"; `op` is the ATen op that ran (in AOTAutograd's
    graph; "tangent" for the gradient entering a backward graph) and `source_op` the op fxamp
    annotated (a backward op maps to the forward op it differentiates). `fix` holds
    `fxamp.compile` keywords that would keep the op in fp32 (empty when that would not help).
    """

    phase: str
    graph: int
    node: str
    op: str
    source_op: str
    module: str
    module_type: str
    source_line: str
    policy: str
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    suggestion: str
    fix: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def headline(self) -> str:
        what = self.source_op or self.op
        of = "backward of " if self.phase == BACKWARD and self.source_op else ""
        where = f" in {self.module} ({self.module_type})" if self.module else " at the top level"
        return f"{self.phase}: {of}{what}{where}, graph {self.graph}"

    def __str__(self) -> str:
        lines = [self.headline, f"  ran     {self.op} ({self.node})"]
        lines += [f"  source  {self.source_line}"] if self.source_line else []
        lines += [f"  policy  {self.policy}"] if self.policy else []
        for label, values in (("inputs", self.inputs), ("output", self.outputs)):
            for i, summary in enumerate(values):
                lines.append(f"  {label if i == 0 else '':7} {summary}")
        lines.append(f"  fix     {self.suggestion}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """What `locate_overflow` found. `site` is the first culprit (None when all finite)."""

    config: AmpConfig
    loss_scale: float
    sites: tuple[OverflowSite, ...]
    nonfinite_inputs: tuple[str, ...]
    values_checked: Mapping[str, int] = dataclasses.field(hash=False)
    loss: Optional[float] = None

    @property
    def site(self) -> Optional[OverflowSite]:
        return self.sites[0] if self.sites else None

    @property
    def found(self) -> bool:
        return bool(self.sites)

    def __str__(self) -> str:
        checked = ", ".join(f"{n} {phase}" for phase, n in self.values_checked.items())
        loss = "" if self.loss is None else f" | loss {self.loss:.6g}"
        out = [f"fxamp locate_overflow: {describe_config(self.config)} | "
               f"loss scale {self.loss_scale:g}{loss}"]
        if self.nonfinite_inputs:
            out.append("non-finite graph inputs: " + ", ".join(self.nonfinite_inputs))
        if not self.sites:
            out.append(f"no op produced an inf or NaN (values checked: {checked})")
            return "\n".join(out)
        out += ["first op to produce an inf or NaN:", str(self.sites[0])]
        out += [f"also, independently: {s.headline}" for s in self.sites[1:]]
        out.append(f"values checked: {checked}")
        return "\n".join(out)


def _all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for _, t in tensors)


def _nonfinite_literal(node: fx.Node) -> bool:
    # torch.full(..., -inf) and masked_fill(mask, -inf) build attention masks on purpose.
    return any(isinstance(a, float) and not math.isfinite(a)
               for a in pytree.tree_leaves((node.args, node.kwargs)))


@dataclasses.dataclass(frozen=True)
class _Culprit:
    origin: Origin
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]


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
        self.culprits: list[_Culprit] = []
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
        self.culprits.append(_Culprit(
            origin_of(node, phase, record),
            tuple(TensorSummary.of(n, t) for n, t in inputs),
            tuple(TensorSummary.of(node.name + sfx, t) for sfx, t in outputs)))

    def report(self, config: AmpConfig, *, loss_scale: float = 1.0,
               loss: Optional[float] = None) -> OverflowReport:
        """The culprits found since `reset()` as an OverflowReport."""
        sites = tuple(_site(c, config, loss_scale) for c in self.culprits)
        return OverflowReport(config, float(loss_scale), sites, tuple(self.nonfinite_inputs),
                              dict(self.values_checked), loss)


def _override_key(origin: Origin) -> str:
    pre = origin.source_node
    if pre is not None and is_fxamp_cast(pre):  # a cast fxamp inserted: fix its consumer
        pre = next(iter(pre.users), None)
    target = getattr(pre, "target", None)
    return str(target.overloadpacket) if hasattr(target, "overloadpacket") else ""


def _suggest(c: _Culprit, config: AmpConfig, loss_scale: float) -> tuple[str, dict[str, Any]]:
    o, dtype = c.origin, c.outputs[0].dtype if c.outputs else "-"
    if o.op == "tangent":
        return (f"the loss gradient, scaled by {loss_scale:g}, overflows {dtype} as it enters "
                "the backward graph: lower the loss scale (a dynamic scaler does this itself)"), {}
    if dtype not in ("f16", "bf16"):
        return (f"it ran in {dtype}, so precision is not the cause: check the inputs, the "
                "learning rate and the loss scale"), {}
    key = _override_key(o)
    if o.module:
        fix = {"module_overrides": {**dict(config.module_overrides), o.module: "fp32"}}
        text = f"keep module {o.module!r} in fp32"
    elif key:
        fix = {"op_overrides": {**dict(config.op_overrides), key: "fp32"}}
        text = f"keep {key} in fp32"
    else:
        return f"the value overflowed {dtype} outside any op fxamp annotated", {}
    text += f": fxamp.compile(model, ..., {', '.join(f'{k}={v!r}' for k, v in fix.items())})"
    if dtype == "f16":
        text += "; or compute in bfloat16, which has fp32's range: dtype=torch.bfloat16"
    if o.phase == BACKWARD:
        text += (f". This overflow is at loss scale {loss_scale:g}: dynamic loss scaling lowers "
                 "the scale after it, so override only if steps keep being skipped")
    return text, fix


def _site(c: _Culprit, config: AmpConfig, loss_scale: float) -> OverflowSite:
    text, fix = _suggest(c, config, loss_scale)
    fields = {f.name: getattr(c.origin, f.name) for f in dataclasses.fields(Origin)
              if f.name != "source_node"}
    return OverflowSite(**fields, inputs=c.inputs, outputs=c.outputs, suggestion=text, fix=fix)


class _WatchLoss(TorchDispatchMode):
    """The first op of an eager loss_fn with finite inputs and a non-finite output."""

    def __init__(self) -> None:
        super().__init__()
        self.culprit: Optional[_Culprit] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.culprit is None:
            ins = [(f"arg{i}", t) for i, t in enumerate(pytree.tree_leaves((args, kwargs)))
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
            outs = [("loss" + s, t) for s, t in tensors_of(out)]
            if not _all_finite(outs) and _all_finite(ins):
                origin = Origin(LOSS, -1, "loss_fn", str(func), "", "", "", "", "")
                self.culprit = _Culprit(origin, tuple(TensorSummary.of(n, t) for n, t in ins),
                                        tuple(TensorSummary.of(n, t) for n, t in outs))
        return out


def _loss_site(culprit: _Culprit) -> OverflowSite:
    return OverflowSite(LOSS, -1, "loss_fn", culprit.origin.op, "", "", "", "", "",
                        culprit.inputs, culprit.outputs,
                        "the model's outputs are finite and loss_fn overflowed: compute the "
                        "loss in fp32, e.g. loss_fn(output.float(), target)")


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
    fn, fxamp_backend = prepare(model_or_fn, locator, config=config, opt_level=opt_level,
                                overrides=overrides)
    outputs, target = call_model(fn, batch, loss_fn is not None)
    graphs = fxamp_backend.compiled_graphs
    config = graphs[0].config if graphs else fxamp_backend.config
    watch = _WatchLoss()
    with watch:
        loss = loss_fn(outputs, target) if loss_fn is not None else default_loss(outputs)
    loss_value = None if loss is None else float(loss.detach().float().sum())
    report = locator.report(config, loss_scale=loss_scale, loss=loss_value)
    if report.found or (loss_value is not None and not math.isfinite(loss_value)):
        if not report.found and watch.culprit is not None:
            report = dataclasses.replace(report, sites=(_loss_site(watch.culprit),))
        return report  # no backward: its gradients would all be inf/NaN
    backward(loss, loss_scale)
    return locator.report(config, loss_scale=loss_scale, loss=loss_value)
