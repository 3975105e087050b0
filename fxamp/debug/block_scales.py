"""The block scales of every block-scaled float8 GEMM's operands (recipes `mxfp8`, `nvfp4`).

A tensorwise or rowwise GEMM has one scale per tensor or row, which the amax `range_stats`
records gives. A block-scaled one has a scale per block of 32 (MXFP8) or 16 (NVFP4) values
along the reduction dim, and what matters is their spread: how far below the largest the
smallest non-zero block sits, and how many blocks are pushed to the format's floor (e8m0's
2**-127, NVFP4's e4m3 2**-6 times the per-tensor scale), where small values lose bits or flush.

`BlockScaleRecorder` runs fxamp's pre-dispatch graph eagerly (the instrumenting compiler's
pre-dispatch mode, as the planner measures) and, at each block-scaled GEMM node, quantizes its
operands as that GEMM's forward does (`block_scales`: the left operand along K in blocks, the
weight along K, NVFP4's in 16x16 tiles); with a backward, the output gradient too, along N as
the grad_input GEMM takes it. `range_stats` adds its rows to the RangeTable for a block-scaled
recipe: explain(ranges=True) prints them, the viewer shows them per GEMM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from fxamp.debug.instrument import GraphRecord, InstrumentingCompiler
from fxamp.float8.block_gemm import block_formats
from fxamp.float8.blockscaled import block_scales
from fxamp.float8.config import RECIPES
from fxamp.float8.gemm import float8_bmm, float8_linear
from fxamp.passes.float8 import is_float8_gemm
from fxamp.provenance import module_of

__all__ = ["BlockScaleRow", "BlockScaleRecorder"]


@dataclasses.dataclass(frozen=True)
class BlockScaleRow:
    """One operand of one block-scaled GEMM, over all batches. Scales are the factors a
    block's values are multiplied by, over its non-zero blocks (nan: none); `at_floor` and
    `zero` are fractions of `blocks`."""

    graph: int
    node: str  # the GEMM's node in fxamp's graph (the one explain() shows)
    module: str
    recipe: str
    operand: str  # "input", "weight" or "grad_output"
    blocks: int
    min_scale: float
    max_scale: float
    at_floor: float
    zero: float

    def describe(self) -> str:
        """'input: 64 blocks, scales 3.81e-06..0.00781, 0% at the floor, 0% zero'."""
        span = (f"{self.min_scale:.3g}..{self.max_scale:.3g}" if self.zero < 1
                else "all blocks zero")
        return (f"{self.operand}: {self.blocks} blocks, scales {span}, "
                f"{100 * self.at_floor:.3g}% at the floor, {100 * self.zero:.3g}% zero")

    def __str__(self) -> str:
        return f"{self.module or '<root>'} {self.node} {self.describe()}"


def _operands(node: fx.Node, env: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    # [M, K] and [K, N] (or [B, M, K] and [B, K, N]) as the float8 GEMM functions hand them to
    # the block-scaled GEMM (fxamp/float8/gemm.py), and the batch dims
    a, b = (env[x] if isinstance(x, fx.Node) else x for x in node.args[:2])
    if node.target is float8_linear:
        return a.reshape(-1, a.shape[-1]), b.t(), 0
    if node.target is float8_bmm and b.shape[:-2].numel() != 1:
        return a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), 1
    return a.reshape(-1, a.shape[-1]), b.reshape(b.shape[-2:]), 0


class _Accumulator:
    """Running smallest and largest scale and counts, kept on the device until read."""

    def __init__(self, node: fx.Node):
        self.node, self.blocks = node, 0
        self.small = self.big = self.floor = self.zero = None

    def add(self, scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        scale, floor, zero = scales
        live = torch.where(zero, float("nan"), scale)
        now = (live.nan_to_num(float("inf")).amin(), live.nan_to_num(0.0).amax(),
               (floor & ~zero).sum(), zero.sum())
        if self.small is not None:
            now = (torch.minimum(self.small, now[0]), torch.maximum(self.big, now[1]),
                   self.floor + now[2], self.zero + now[3])
        self.small, self.big, self.floor, self.zero = now
        self.blocks += scale.numel()

    def row(self, graph: int, recipe: str, operand: str) -> BlockScaleRow:
        module = module_of(self.node.meta.get("nn_module_stack"))[0]
        none = int(self.zero) == self.blocks
        return BlockScaleRow(graph, self.node.name, module, recipe, operand, self.blocks,
                             float("nan") if none else float(self.small),
                             float("nan") if none else float(self.big),
                             int(self.floor) / self.blocks, int(self.zero) / self.blocks)


class BlockScaleRecorder(InstrumentingCompiler):
    """An inner compiler that records the block scales of every block-scaled GEMM's operands
    (see the module's docstring); `rows()` reads them back."""

    def __init__(self) -> None:
        super().__init__(self._visit, pre_dispatch=True)
        self._stats: dict[tuple[int, str, str, str], _Accumulator] = {}

    def _visit(self, record: GraphRecord, phase: str, node: fx.Node, value: Any,
               env: dict) -> None:
        if not is_float8_gemm(node) or not RECIPES[node.args[3]].block:
            return
        recipe = node.args[3]
        act, weight = block_formats(recipe, node.kwargs.get("mx_scale_mode", "rceil"))
        a, b, batch = _operands(node, env)
        add = lambda operand, scales: self._stats.setdefault(
            (record.index, node.name, recipe, operand), _Accumulator(node)).add(scales)
        add("input", block_scales(a.detach(), act, dim=-1, batch_dims=batch))
        add("weight", block_scales(b.detach(), weight, dim=-2, other_dim=-1, batch_dims=batch))
        if isinstance(value, torch.Tensor) and value.requires_grad:
            # the output gradient as the grad_input GEMM quantizes it: along N
            flat = (lambda g: g.reshape(-1, *g.shape[-2:])) if batch else \
                (lambda g: g.reshape(-1, g.shape[-1]))
            value.register_hook(lambda g: add("grad_output", block_scales(
                flat(g), act, dim=-1, batch_dims=batch)))

    def rows(self) -> tuple[BlockScaleRow, ...]:
        """One row per (GEMM, operand): the forward's operands in execution order, then the
        output gradients."""
        rows = [acc.row(graph, recipe, operand)
                for (graph, _, recipe, operand), acc in self._stats.items()]
        return tuple(sorted(rows, key=lambda r: (r.operand == "grad_output", r.graph)))
