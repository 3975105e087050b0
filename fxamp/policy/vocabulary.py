"""The words of fxamp's op policy: what a policy does to an op (`CastPolicy`), which of them a
user may ask for, the low-precision dtypes, and the shape of a user's own policy object."""

from __future__ import annotations

import enum
from typing import Optional, Protocol, Union, runtime_checkable

import torch
import torch.fx as fx

__all__ = ["CastPolicy", "OVERRIDE_CHOICES", "LOW_DTYPES", "NodePolicy"]

LOW_DTYPES = (torch.float16, torch.bfloat16)


class CastPolicy(str, enum.Enum):
    """What a policy does to an op's eligible inputs (floating, on the compute device, not fp64)."""

    LOWER = "lower"  # cast to the low dtype (autocast's lower_precision_fp)
    FP32 = "fp32"  # cast to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 when the op has a dtype arg
    PROMOTE = "promote"  # cast to the widest eligible input type
    BANNED = "banned"  # refuse under low precision, naming the safe alternative
    KEEP = "keep"  # leave the op exactly as traced


# What a user may ask for one op, one module or from a NodePolicy: run it in the low dtype, in
# fp32, in the widest input type, or leave it exactly as traced.
OVERRIDE_CHOICES = (CastPolicy.LOWER, CastPolicy.FP32, CastPolicy.PROMOTE, CastPolicy.KEEP)


@runtime_checkable
class NodePolicy(Protocol):
    """A policy of your own, given as `policy=` (docs/op_policy.md, "A policy of your own").

    fxamp asks it about every call_function node of the pre-dispatch ATen graph where it would
    read the preset table (at O1), after module and op overrides. It sees the node (its
    `target`, `args`, `meta["val"]`, `meta["nn_module_stack"]`) and answers with one of
    `OVERRIDE_CHOICES` ("lower", "fp32", "promote", "keep", or the CastPolicy members), or None
    to leave the node to the device's preset table. Custom ops (`torch.library.custom_op`) are
    nodes like any other, so this is how they, or whole families of ops, get a policy.
    """

    def policy_for(self, node: fx.Node) -> Optional[Union[CastPolicy, str]]:
        ...
