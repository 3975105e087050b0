"""Measure every GEMM of a model on calibration batches: its shape, value ranges, and the error
of each candidate precision against fp32 (docs/planner.md, "Measuring").

The model runs at O0 (fp32) through fxamp's own backend with the debug tools' instrumenting
compiler in its pre-dispatch mode: the graph the passes annotate runs eagerly under autograd,
so each GEMM node (the node the float8 pass decides on, with its module path and source
line) is seen with its live operands, and a hook on its output catches the gradient that
flows into it. Each node's whole op (Note [The whole op is measured]) is then recomputed by
every candidate from those fp32 tensors (candidates.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx

from fxamp.float8.block_gemm import block_shape_refusal
from fxamp.float8.blocks import FORMATS
from fxamp.config import AmpConfig
from fxamp.debug import instrument
from fxamp.debug.instrument import (FORWARD, GraphRecord, InstrumentingCompiler, OpSite,
                                    call_model, default_loss, prepare_private)
from fxamp.float8.config import Float8Config
from fxamp.passes.float8 import GEMM_OPS, decide
from fxamp.passes.float8_operands import GemmOperands, gemm_operands
from fxamp.planner.candidates import GemmCall, candidate_errors
from fxamp.provenance import module_of, source_line

__all__ = ["GemmMeasure", "GemmProbe", "measure"]


@dataclasses.dataclass
class GemmMeasure:
    """What was measured of one GEMM node, over all calibration batches (the worst of each).

    `errors[candidate][tensor]` is the relative error ||x - ref|| / ||ref|| of the output,
    grad_input or grad_weight computed in `candidate` against fp32 (inf for an overflow);
    `max_abs[tensor]` the largest |x| of input, weight, output and the three gradients.
    `float8_refusal` says why float8 cannot run this GEMM at all (None: it can), its shape
    or kind, or this device and torch for every recipe asked (choose.py);
    `recipe_refusals[recipe]` why a block-scaled recipe cannot, where float8 can (its blocks
    do not divide a reduction dim).
    """

    site: OpSite
    module_type: str
    source_line: str
    shape: Optional[tuple[int, int, int]]
    batch: int
    float8_refusal: Optional[str]
    grad_input: bool = False
    grad_weight: bool = False
    errors: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    max_abs: dict[str, float] = dataclasses.field(default_factory=dict)
    recipe_refusals: dict[str, str] = dataclasses.field(default_factory=dict)

    def refusal(self, recipe: Optional[str]) -> Optional[str]:
        """Why `recipe` cannot run this GEMM, or None."""
        return self.float8_refusal or (self.recipe_refusals.get(recipe) if recipe else None)

    def add(self, errors: dict[str, dict[str, float]], max_abs: dict[str, float]) -> None:
        for cand, by_tensor in errors.items():
            mine = self.errors.setdefault(cand, {})
            for tensor, err in by_tensor.items():
                mine[tensor] = max(mine.get(tensor, 0.0), err)
        for tensor, value in max_abs.items():
            self.max_abs[tensor] = max(self.max_abs.get(tensor, 0.0), value)


def _value(node: Any, env: dict) -> Any:
    return env[node] if isinstance(node, fx.Node) else node


def _as_written(node: fx.Node, env: dict) -> GemmCall:
    # A GEMM the float8 pass cannot take (batch dims broadcast, a 1-D operand): its operands
    # as the op takes them, a 1-D one made a matrix as torch.matmul does.
    op, args = GEMM_OPS[node.target], [_value(x, env) for x in node.args]
    scalars = {k: node.kwargs.get(k, 1) for k in ("alpha", "beta")}
    if op == "linear":
        x, w, bias = (*args, node.kwargs.get("bias"))[:3]
        a, b, c, scalars = x, _t(w) if w.dim() == 2 else w, _value(bias, env), {}
    elif op in ("addmm", "baddbmm"):
        c, a, b = args[:3]
    else:
        (a, b), c = args[:2], None
    a, b = a.unsqueeze(0) if a.dim() == 1 else a, b.unsqueeze(-1) if b.dim() == 1 else b
    return GemmCall(a, b, c, **scalars)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1)


def _call(ops: GemmOperands, node: fx.Node, env: dict, value: torch.Tensor) -> GemmCall:
    # Canonical [M, K] @ [K, N], or [B, M, K] @ [B, K, N] for a GEMM done per batch entry, as
    # the float8 pass takes it; c broadcast to the result, in that form.
    if ops.refusal is not None:
        call = _as_written(node, env)
    else:
        a, b = env[ops.left], env[ops.right]
        b = b.t() if GEMM_OPS[node.target] == "linear" else b
        _, k, n = ops.mkn
        a, b = (a.reshape(-1, *a.shape[-2:]), b.reshape(-1, k, n)) if ops.batch else \
            (a.reshape(-1, k), b.reshape(k, n))
        call = GemmCall(a, b, _value(ops.bias, env), ops.alpha, ops.beta)
    if call.c is None or call.beta == 0:
        return dataclasses.replace(call, c=None)
    return dataclasses.replace(call, c=call.c.expand(value.shape).reshape(call.shape))


class GemmProbe(InstrumentingCompiler):
    """An inner compiler that finds every GEMM node and captures its operands and output
    gradient; `flush()` measures what was captured (after each batch's backward) in bf16,
    fp16 and the float8 `recipes`."""

    def __init__(self, device_type: str, dtype: torch.dtype, recipes: Sequence[str]) -> None:
        super().__init__(self._visit, pre_dispatch=True)
        self.dtype, self.recipes = dtype, tuple(recipes)
        # float8's own refusals (shapes, attention-style GEMMs), sizes left to the cost model
        self.float8_config = AmpConfig.from_opt_level(
            "O1", float8=Float8Config(min_dim=1)).resolve(device_type)
        self.sites: dict[tuple[int, str], GemmMeasure] = {}
        self._pending: list[list[Any]] = []

    def _site(self, record: GraphRecord, node: fx.Node) -> GemmMeasure:
        key = (record.index, node.name)
        if key not in self.sites:
            choice = decide(record.pre, node, self.float8_config)
            site = OpSite(FORWARD, record.index, node.name, str(node.target), str(node.target),
                          choice.module)
            self.sites[key] = GemmMeasure(
                site, module_of(node.meta.get("nn_module_stack"))[1] or "-",
                source_line(node.meta.get("stack_trace")), choice.shape, choice.batch,
                None if choice.float8 else choice.reason.rsplit("; stays", 1)[0])
            if choice.float8 and choice.shape is not None:
                self.sites[key].recipe_refusals = {
                    r: why for r in self.recipes if r in FORMATS
                    and (why := block_shape_refusal(choice.shape, r)) is not None}
        return self.sites[key]

    def _visit(self, record: GraphRecord, phase: str, node: fx.Node, value: Any,
               env: dict) -> None:
        if node.op != "call_function" or node.target not in GEMM_OPS:
            return
        measure_ = self._site(record, node)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return  # no candidate precision to compare
        call = _call(gemm_operands(record.pre, node), node, env, value)
        measure_.grad_input, measure_.grad_weight = call.a.requires_grad, call.b.requires_grad
        entry = [measure_, call.detach(), None]
        self._pending.append(entry)
        if value.requires_grad:
            value.register_hook(lambda g: entry.__setitem__(2, g.detach()))

    def flush(self) -> None:
        """Measure every GEMM captured since the last flush, then let go of its tensors."""
        for m, call, g in self._pending:
            m.add(*candidate_errors(call.a, call.b, g, c=call.c, alpha=call.alpha,
                                    beta=call.beta, grad_input=m.grad_input and g is not None,
                                    grad_weight=m.grad_weight and g is not None,
                                    dtype=self.dtype,
                                    recipes=[r for r in self.recipes if m.refusal(r) is None]))
        self._pending.clear()


def measure(model: torch.nn.Module, batches: Iterable[Any],
            loss_fn: Optional[Callable[[Any, Any], torch.Tensor]], *,
            dtype: torch.dtype, device_type: str,
            recipes: Sequence[str]) -> tuple[list[GemmMeasure], int]:
    """Every GEMM of `model` measured over `batches` (each as `range_stats` takes one), on a
    private fp32 copy, in bf16, fp16 and the float8 `recipes` (those this device can run);
    returns the measurements and the number of batches."""
    probe = GemmProbe(device_type, dtype, recipes)
    prepared = prepare_private(model, probe, config=AmpConfig.from_opt_level("O0"),
                               opt_level=None, overrides={})
    count = 0
    for batch in batches:
        outputs, target = call_model(prepared, batch, loss_fn is not None)
        loss = loss_fn(outputs, target) if loss_fn is not None else default_loss(outputs)
        instrument.backward(loss, 1.0)
        probe.flush()
        count += 1
    return list(probe.sites.values()), count
