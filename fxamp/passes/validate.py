"""Validate: refuse what the annotations say cannot be done, naming the node and the fix."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxamp._compat import OpOverload
from fxamp.config import AmpConfig
from fxamp.errors import BannedOpError, FxampError
from fxamp.passes.annotate import FXAMP_META, short_dtype
from fxamp.policy import BANNED_ALTERNATIVES, LOW_DTYPES, CastPolicy, preset_table
from fxamp.provenance import innermost_frame, module_of
from fxamp.policy.rules import BATCH_NORM_OPS, ONE_DTYPE_OPS

__all__ = ["validate", "where"]


def where(node: fx.Node) -> str:
    """'aten.linear.default in head (model.py:12)' — enough to find the node in user code."""
    stack = node.meta.get("nn_module_stack")
    module = (module_of(stack)[0] or "<root>") if stack else "<top level>"
    frame = innermost_frame(node.meta.get("stack_trace"))
    line = f'File "{frame[0]}", line {frame[1]}, in {frame[2]}' if frame else ""
    return f"{node.target} in {module}" + (f" ({line})" if line else "")


def _check_banned(node: fx.Node, config: AmpConfig) -> None:
    name = node.target.overloadpacket.__name__
    raise BannedOpError(
        f"{where(node)} is banned under {config.opt_level} with {short_dtype(config.dtype)}: "
        f"{BANNED_ALTERNATIVES.get(name, 'it is unsafe in low precision')}"
    )


def _check_inplace_fp32(node: fx.Node, config: AmpConfig) -> None:
    # Apex refused in-place versions of fp32-list ops on low-precision inputs: the result
    # would be written back in low precision, silently undoing the fp32 policy.
    op = node.target
    name = op.overloadpacket.__name__
    if not name.endswith("_") or config.policy != "apex":
        return
    packet = getattr(torch.ops.aten, name[:-1], None)
    out_of_place = getattr(packet, op._overloadname, None) if packet else None
    if preset_table(config.policy).get(out_of_place) is not CastPolicy.FP32:
        return
    self_dtype = node.meta[FXAMP_META].input_dtypes[0]
    if self_dtype in LOW_DTYPES:
        raise FxampError(
            f"{where(node)}: in-place {name} on a {short_dtype(self_dtype)} tensor cannot run "
            f"in fp32 as the apex table asks; use the out-of-place {name[:-1]}"
        )


def _check_batch_norm_stats(node: fx.Node) -> None:
    decision = node.meta[FXAMP_META]
    stats = decision.input_dtypes[3:5]
    if decision.policy is CastPolicy.FP32 and any(d in LOW_DTYPES for d in stats):
        raise FxampError(
            f"{where(node)} runs in fp32 but its running statistics are "
            f"{short_dtype(stats[0])}; they are updated in place and cannot be cast. Store "
            "the module in fp32: fxamp.compile(..., keep_batchnorm_fp32=True) or "
            "module_overrides={'BatchNorm2d': 'fp32'} (fxamp.compile keeps such modules fp32)"
        )



def _check_one_dtype(node: fx.Node, config: AmpConfig) -> None:
    decision = node.meta[FXAMP_META]
    dtypes = {decision.arg_casts.get(i, d) for i, d in enumerate(decision.input_dtypes)}
    floats = sorted(short_dtype(d) for d in dtypes if d in (torch.float32, *LOW_DTYPES))
    if len(floats) > 1:
        raise FxampError(
            f"{where(node)} would get {' and '.join(floats)} inputs under policy "
            f"'{decision.policy.value}' ({decision.reason}); it needs one dtype: override it "
            "to 'lower' or 'fp32'"
        )


def validate(gm: fx.GraphModule, config: AmpConfig) -> int:
    """Raise BannedOpError / FxampError for the first node that cannot be honoured."""
    checked = 0
    for node in gm.graph.nodes:
        decision = node.meta.get(FXAMP_META)
        if decision is None or node.op != "call_function" or not isinstance(node.target, OpOverload):
            continue
        if decision.policy is CastPolicy.BANNED:
            _check_banned(node, config)
        _check_inplace_fp32(node, config)
        if node.target in BATCH_NORM_OPS:
            _check_batch_norm_stats(node)
        if node.target in ONE_DTYPE_OPS and not decision.autocast_casts:
            _check_one_dtype(node, config)
        checked += 1
    return checked
