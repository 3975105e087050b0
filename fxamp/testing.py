"""Helpers for tests of the passes and for users checking graphs: fxamp's passes on a traced
function without Dynamo or a compiler, and the readable graph format.

This module imports the package and is imported by tests only; fxamp itself never imports it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.fx as fx

from fxamp._compat import FakeTensorMode, make_fx
from fxamp.passes import run_passes
from fxamp.passes.capture import MixedOperandsMode
from fxamp.passes.printing import format_graph, node_dtypes

__all__ = ["Float8Gemm", "float8_gemms", "format_graph", "node_dtypes", "transform"]


def transform(fn, *example_inputs, config) -> fx.GraphModule:
    """Trace `fn` to the pre-dispatch ATen graph on fake tensors and run fxamp's passes on it.

    The same capture and pipeline the backend uses, without Dynamo or a compiler: for tests
    of the passes on tiny graphs (milliseconds) and for checking single ops. `config` must be
    resolved (`AmpConfig.from_opt_level(...).resolve("cpu")`).
    """
    @functools.wraps(fn)  # make_fx names the placeholders after fn's parameters
    def traced(*args):
        with MixedOperandsMode():  # per call, as the backend's capture (capture.py)
            return fn(*args)

    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        gm = make_fx(traced, pre_dispatch=True)(*fakes)
    run_passes(gm, config, fake_mode)
    return gm


class Float8Gemm(NamedTuple):
    """A float8 GEMM of an ATen graph: its operands' float8 dtypes, its output dtype (before
    any epilogue) and the GEMM node."""

    operands: tuple[torch.dtype, torch.dtype]
    out: torch.dtype
    node: fx.Node


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_VIEWS = (torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.clone.default,
          torch.ops.aten.view.default, torch.ops.aten.expand.default,
          torch.ops.aten.permute.default)


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(val, "dtype", None)


def _dequantized(node) -> torch.dtype | None:
    # the float8 dtype of an emulated GEMM's operand, `float8_value.to(float32) * scale`
    # (Note [The emulated float8 lowering]); None for any other operand
    if not (isinstance(node, fx.Node) and node.target is torch.ops.aten.mul.Tensor):
        return None
    source = node.args[0]
    if not (isinstance(source, fx.Node) and source.target in (
            torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)):
        return None
    inner = source.args[0]
    while isinstance(inner, fx.Node) and inner.target in _VIEWS and _dtype(inner) in _FLOAT8:
        inner = inner.args[0]
    return _dtype(inner) if _dtype(inner) in _FLOAT8 else None


def float8_gemms(gm: fx.GraphModule) -> list[Float8Gemm]:
    """Every float8 GEMM of a forward or backward ATen graph, in either lowering: a
    `torch._scaled_mm` (CUDA) or the emulated GEMM, a float32 `mm` of two dequantized float8
    operands rounded once to its output dtype (elsewhere; Note [The emulated float8
    lowering] in fxamp/float8/emulated.py)."""
    found = []
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten._scaled_mm.default:
            found.append(Float8Gemm((_dtype(n.args[0]), _dtype(n.args[1])), _dtype(n), n))
        elif n.target is torch.ops.aten.mm.default:
            operands = (_dequantized(n.args[0]), _dequantized(n.args[1]))
            if None not in operands and len(n.users) == 1:
                found.append(Float8Gemm(operands, _dtype(next(iter(n.users))), n))
    return found
