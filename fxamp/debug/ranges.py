"""Per-op value ranges against the fp16 limits, for activations and gradients.

`range_stats` runs a few batches through the graphs fxamp produces (forward and backward, as
`compiler="aot_eager"` runs them) and records, for the floating output of every op: the largest
|x|, and the fractions of values that fp16 would overflow (|x| > 65504), flush to zero
(0 < |x| < 2**-24) or store as subnormals (0 < |x| < 2**-14). Run it at bf16 (fp32's exponent
range) or O0 to see how values would fit fp16; in fp16 itself an overflow shows as inf and an
underflow as a zero, which cannot be told from a true zero. With a block-scaled float8 recipe
(`mxfp8`, `nvfp4`) the table also has each GEMM operand's block scales
(fxamp/debug/block_scales.py).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import operator
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.fx as fx

from fxamp._compat import OpOverload
from fxamp.config import AmpConfig
from fxamp.debug import instrument
from fxamp.debug.block_scales import BlockScaleRecorder, BlockScaleRow
from fxamp.debug.instrument import (BACKWARD, GraphRecord, InstrumentingCompiler, OpSite, Origin,
                                    call_model, default_loss, describe_config, origin_of,
                                    prepare_private, readable, tensors_of)
from fxamp.passes.annotate import short_dtype

__all__ = ["range_stats", "RangeRecorder", "RangeTable", "RangeRow", "FP16_MAX",
           "FP16_MIN_SUBNORMAL", "FP16_MIN_NORMAL"]

FP16_MAX = 65504.0
FP16_MIN_SUBNORMAL = 2.0**-24  # non-zero |x| below this becomes 0 in fp16
FP16_MIN_NORMAL = 2.0**-14  # below this fp16 keeps fewer than 11 significant bits
NEAR_MAX = FP16_MAX / 16  # within 4 binades of overflow: a loss scale or an outlier away
UNDERFLOW_RISK = 0.01  # a fraction of values flushed to zero worth a look

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class RangeRow(OpSite):
    """Statistics of one op's floating output over all batches.

    `phase` is "forward" (activations) or "backward" (gradients, scaled by the table's
    loss_scale); `op` is the ATen op that ran, `source_op` the op fxamp annotated (for a
    backward op, the forward op it differentiates). Fractions are of `numel`, all batches.
    """

    dtype: str
    numel: int
    max_abs: float  # largest |x|, inf included, NaN ignored
    overflow: float  # fraction with |x| > 65504 (inf included)
    underflow: float  # fraction with 0 < |x| < 2**-24
    subnormal: float  # fraction with 0 < |x| < 2**-14 (underflow included)
    nonfinite: float  # fraction inf or NaN
    source_node: str = ""  # the node of fxamp's graph (explain()'s) it comes from; "" if none

    @property
    def risk(self) -> str:
        """'overflow', 'near max' (|x| > 65504/16), 'underflow' (>1% flushed) or ''."""
        if self.overflow or self.nonfinite:
            return "overflow"
        if self.max_abs > NEAR_MAX:
            return "near max"
        return "underflow" if self.underflow > UNDERFLOW_RISK else ""


class _Accumulator:
    """Running max and counts on the device; read back once, when the table is built."""

    def __init__(self, origin: Origin, dtype: torch.dtype, source_node: str):
        self.origin, self.dtype, self.numel = origin, dtype, 0
        self.source_node = source_node
        self.max: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor) -> None:
        a = readable(t).abs()
        if a.dtype.itemsize < 4:  # compare in fp32: 65504 is not a bf16 number
            a = a.float()
        big = torch.where(torch.isnan(a), 0, a).amax()
        nonzero = a > 0
        counts = torch.stack([(a > FP16_MAX).sum(), (nonzero & (a < FP16_MIN_SUBNORMAL)).sum(),
                              (nonzero & (a < FP16_MIN_NORMAL)).sum(), (~torch.isfinite(a)).sum()])
        self.max = big if self.max is None else torch.maximum(self.max, big.to(self.max.dtype))
        self.counts = counts if self.counts is None else self.counts + counts
        self.numel += t.numel()

    def row(self) -> RangeRow:
        o = self.origin
        fractions = [c / self.numel for c in self.counts.tolist()]
        return RangeRow(o.phase, o.graph, o.node, o.op, o.source_op, o.module,
                        short_dtype(self.dtype), self.numel, float(self.max), *fractions,
                        source_node=self.source_node)


_COPIES = frozenset((aten.clone.default, aten._unsafe_view.default, aten.alias.default))


def _skipped(node: fx.Node) -> bool:
    # Views, copies and getitem repeat values recorded already (a tuple output is recorded per
    # element at the op that returns it).
    if node.op != "call_function" or node.target is operator.getitem or node.target in _COPIES:
        return True
    return isinstance(node.target, OpOverload) and node.target.is_view


class RangeRecorder(InstrumentingCompiler):
    """An inner compiler that records the range of every op's output (see `range_stats`)."""

    def __init__(self) -> None:
        super().__init__(self._record)
        self._stats: dict[tuple[int, str, str], _Accumulator] = {}

    def _record(self, record: GraphRecord, phase: str, node: fx.Node, value: Any,
                env: dict) -> None:
        if _skipped(node):
            return
        for suffix, t in tensors_of(value):
            if t.numel() == 0:
                continue
            key = (record.index, phase, node.name + suffix)
            if key not in self._stats:
                origin = origin_of(node, phase, record)
                source = origin.source_node.name if origin.source_node is not None else ""
                self._stats[key] = _Accumulator(dataclasses.replace(
                    origin, node=key[2], op=origin.op + suffix, source_node=None), t.dtype,
                    source)
            self._stats[key].add(t)

    def table(self, config: AmpConfig, *, loss_scale: float = 1.0,
              batches: int = 0) -> "RangeTable":
        """The statistics so far, forward rows before backward rows, in execution order."""
        order = sorted(self._stats, key=lambda k: (k[0], k[1] == BACKWARD))
        return RangeTable(config, float(loss_scale), batches,
                          tuple(self._stats[k].row() for k in order))


def _pct(fraction: float) -> str:
    return "0" if fraction == 0 else f"{100 * fraction:.3g}%"


def _short(op: str) -> str:
    return op.replace("aten.", "").replace(".default", "")


@dataclasses.dataclass(frozen=True)
class RangeTable:
    """What `range_stats` measured: one RangeRow per op output; print it or export it."""

    config: AmpConfig
    loss_scale: float
    batches: int
    rows: tuple[RangeRow, ...]
    block_scales: tuple[BlockScaleRow, ...] = ()  # a block-scaled float8 recipe's GEMMs

    def select(self, *, phase: Optional[str] = None, module: Optional[str] = None,
               op: Optional[str] = None, source_op: Optional[str] = None) -> list[RangeRow]:
        """Rows matching every given field (op names as printed: 'aten.mm.default')."""
        wanted = dict(phase=phase, module=module, op=op, source_op=source_op)
        return [r for r in self.rows
                if all(v is None or getattr(r, k) == v for k, v in wanted.items())]

    def at_risk(self) -> list[RangeRow]:
        """Rows whose values overflow, come near the fp16 maximum or often underflow."""
        return [r for r in self.rows if r.risk]

    def as_dicts(self) -> list[dict[str, Any]]:
        """One dict per row, `risk` included (for pandas.DataFrame or json)."""
        return [{**dataclasses.asdict(r), "risk": r.risk} for r in self.rows]

    def to_csv(self, path: Optional[str] = None) -> str:
        """The rows as CSV text (fractions as numbers in [0, 1]); also written to `path`."""
        buffer = io.StringIO()
        fields = [f.name for f in dataclasses.fields(RangeRow)] + ["risk"]
        writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.as_dicts())
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(buffer.getvalue())
        return buffer.getvalue()

    def __str__(self) -> str:
        c = self.config
        header = ("phase", "op", "of", "module", "dtype", "max|x|", ">65504", "<2^-24",
                  "<2^-14", "inf/nan", "risk")
        body = [("fw" if r.phase == "forward" else "bw", _short(r.op),
                 _short(r.source_op), r.module or "<root>", r.dtype, f"{r.max_abs:.4g}",
                 _pct(r.overflow), _pct(r.underflow), _pct(r.subnormal), _pct(r.nonfinite),
                 r.risk) for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
        title = (f"value ranges vs fp16: {describe_config(c)} | {self.batches} batch(es) | "
                 f"gradients at loss scale {self.loss_scale:g}")
        blocks = ([f"block scales ({self.block_scales[0].recipe}; factors a block's values are "
                   "multiplied by, over non-zero blocks):"] +
                  [f"  {r}" for r in self.block_scales] if self.block_scales else [])
        return "\n".join([title, fmt(header), *(fmt(r) for r in body), *blocks])


def range_stats(model_or_fn: Callable, batches: Union[Iterable[Any], torch.Tensor],
                loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None, *,
                loss_scale: float = 1.0, backward: bool = True,
                opt_level: Optional[str] = None, config: Optional[AmpConfig] = None,
                **overrides: Any) -> RangeTable:
    """Per-op ranges of activations and gradients over a few batches, against fp16's limits.

    Runs on a private copy of the model (its weights, gradients and statistics are left
    alone), through the graphs `fxamp.compile(..., compiler="aot_eager")` runs.

    Args:
        model_or_fn: an nn.Module (one prepared by `fxamp.compile` keeps its config) or a
            function of tensors.
        batches: an iterable of batches, each as `locate_overflow` takes one: the model's
            inputs, or `(inputs, target)` with `loss_fn`. A single tensor is one batch.
            Rows aggregate the batches each graph ran: a batch that recompiles (another
            shape) gets rows of its own under the next graph index.
        loss_fn: `loss_fn(output, target) -> loss`; None differentiates the sum of outputs.
        loss_scale: multiplies the loss before backward; gradient rows are of scaled values,
            as they are in training.
        backward: False records activations only.
        opt_level, config, **overrides: as for `fxamp.compile` (default O1).

    Returns:
        A RangeTable: print it, `.to_csv()`, `.as_dicts()`, `.at_risk()`, `.select(...)`.
    """
    batches = [batches] if isinstance(batches, torch.Tensor) else list(batches)
    how = dict(config=config, opt_level=opt_level, overrides=overrides)
    recorder = RangeRecorder()
    prepared = _run(recorder, model_or_fn, batches, loss_fn, loss_scale, backward, how)
    table = recorder.table(prepared.config, loss_scale=loss_scale, batches=len(batches))
    f8 = prepared.config.float8
    if f8 is None or not f8.spec.block:
        return table
    blocks = BlockScaleRecorder()  # the block scales: fxamp's graph run eagerly, once more
    _run(blocks, model_or_fn, batches, loss_fn, loss_scale, backward, how)
    return dataclasses.replace(table, block_scales=blocks.rows())


def _run(inner: Callable, model_or_fn: Callable, batches: list, loss_fn: Optional[Callable],
         loss_scale: float, backward: bool, how: dict) -> Any:
    prepared = prepare_private(model_or_fn, inner, **how)
    for batch in batches:
        outputs, target = call_model(prepared, batch, loss_fn is not None)
        loss = loss_fn(outputs, target) if loss_fn is not None else default_loss(outputs)
        if backward:
            instrument.backward(loss, loss_scale)
    return prepared
