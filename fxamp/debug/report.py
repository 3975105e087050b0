"""What the overflow locator reports: the culprit op, the tensors around it, and a fix.

The suggestion is data as well as text: `OverflowSite.fix` holds the `fxamp.compile` keywords
(a module or op override merged into the config's own) that keep the op in fp32, or nothing
when fp32 would not help (the op already ran in fp32; the loss scale is the cause).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from fxamp.config import AmpConfig
from fxamp.debug.instrument import BACKWARD, OpSite, Origin, describe_config, readable
from fxamp.passes.annotate import short_dtype
from fxamp.passes.insert_casts import is_fxamp_cast

__all__ = ["TensorSummary", "OverflowSite", "OverflowReport", "Culprit", "make_site",
           "loss_site", "LOSS"]

LOSS = "loss"
_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default")


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
        a = readable(t).abs()
        finite = torch.isfinite(a)
        max_abs = float(torch.where(finite, a, 0).max()) if a.numel() else 0.0
        return cls(name, short_dtype(t.dtype), tuple(t.shape), max_abs,
                   int((~finite).sum()), t.numel())

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        bad = f", {self.nonfinite}/{self.numel} inf/nan" if self.nonfinite else ""
        return f"{self.name}: {self.dtype}[{shape}] max|x| {self.max_abs:.4g}{bad}"


@dataclasses.dataclass(frozen=True)
class OverflowSite(OpSite):
    """The op that produced a non-finite value, and how to keep it finite.

    `phase` is "forward", "backward" or "loss"; `op` is the ATen op that ran (in AOTAutograd's
    graph; "tangent" for the gradient entering a backward graph) and `source_op` the op fxamp
    annotated (a backward op maps to the forward op it differentiates). `fix` holds
    `fxamp.compile` keywords that would keep the op in fp32 (empty when that would not help).
    """

    module_type: str
    source_line: str
    policy: str
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]
    suggestion: str
    fix: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    source_node: str = ""  # the node of fxamp's graph (explain()'s) it comes from; "" if none

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


@dataclasses.dataclass(frozen=True)
class Culprit:
    """An op whose floating inputs were finite and whose output was not."""

    origin: Origin
    inputs: tuple[TensorSummary, ...]
    outputs: tuple[TensorSummary, ...]


def _override_key(origin: Origin) -> str:
    pre = origin.source_node
    if pre is not None and is_fxamp_cast(pre):  # a cast fxamp inserted: fix its consumer
        pre = next(iter(pre.users), None)
    target = getattr(pre, "target", None)
    return str(target.overloadpacket) if hasattr(target, "overloadpacket") else ""


def _why_fp32_would_not_help(c: Culprit, dtype: str, loss_scale: float) -> Optional[str]:
    o = c.origin
    if o.op == "tangent":
        return (f"the loss gradient, scaled by {loss_scale:g}, overflows {dtype} as it enters "
                "the backward graph: lower the loss scale (a dynamic scaler does this itself)")
    if o.phase == BACKWARD and o.op in _CASTS:
        biggest = max((s.max_abs for s in c.inputs), default=float("nan"))
        return (f"a gradient of up to {biggest:.4g} (scaled by {loss_scale:g}) overflows as it "
                f"is cast to {dtype} for the backward of a {dtype} op: lower the loss scale (a "
                "dynamic scaler does), or keep the op it flows into in fp32")
    if dtype not in ("f16", "bf16"):
        return (f"it ran in {dtype}, so precision is not the cause: check the inputs, the "
                "learning rate and the loss scale")
    return None


def _override(o: Origin, config: AmpConfig) -> tuple[str, dict[str, Any]]:
    if o.module:
        return (f"keep module {o.module!r} in fp32",
                {"module_overrides": {**dict(config.module_overrides), o.module: "fp32"}})
    key = _override_key(o)
    if key:
        return f"keep {key} in fp32", {"op_overrides": {**dict(config.op_overrides), key: "fp32"}}
    return "", {}


def _suggest(c: Culprit, config: AmpConfig, loss_scale: float) -> tuple[str, dict[str, Any]]:
    dtype = c.outputs[0].dtype if c.outputs else "-"
    reason = _why_fp32_would_not_help(c, dtype, loss_scale)
    if reason:
        return reason, {}
    text, fix = _override(c.origin, config)
    if not fix:
        return f"the value overflowed {dtype} outside any op fxamp annotated", {}
    text += f": fxamp.compile(model, ..., {', '.join(f'{k}={v!r}' for k, v in fix.items())})"
    if dtype == "f16":
        text += "; or compute in bfloat16, which has fp32's range: dtype=torch.bfloat16"
    if c.origin.phase == BACKWARD:
        text += (f". This overflow is at loss scale {loss_scale:g}: dynamic loss scaling lowers "
                 "the scale after it, so override only if steps keep being skipped")
    return text, fix


def make_site(c: Culprit, config: AmpConfig, loss_scale: float) -> OverflowSite:
    text, fix = _suggest(c, config, loss_scale)
    fields = {f.name: getattr(c.origin, f.name) for f in dataclasses.fields(Origin)
              if f.name != "source_node"}
    source = c.origin.source_node
    return OverflowSite(**fields, inputs=c.inputs, outputs=c.outputs, suggestion=text, fix=fix,
                        source_node="" if source is None else source.name)


def loss_site(culprit: Culprit) -> OverflowSite:
    return OverflowSite(LOSS, -1, "loss_fn", culprit.origin.op, "", "", "", "", "",
                        culprit.inputs, culprit.outputs,
                        "the model's outputs are finite and loss_fn overflowed: compute the "
                        "loss in fp32, e.g. loss_fn(output.float(), target)")
