"""torch's own autocast test lists (torch.testing._internal.autocast_test_lists) as pytest
cases, and the check that fxamp O1 gives the dtypes torch.autocast gives for one of them.

# Note [Autocast lists without expecttest]
torch's lists module imports torch.testing._internal.common_utils, which imports expecttest only
to derive its TestCase from expecttest.TestCase. The GPU machines have torch but not expecttest
(and no network to install it), and the CUDA list is what they must check. So where expecttest
is not importable, `torch_lists` registers a stand-in module with the two names common_utils
reads (`TestCase`, `ACCEPT`) while importing the lists, and removes it again, so that tests which
need the real expecttest still skip.
"""

from __future__ import annotations

import sys
import types
import unittest

import pytest
import torch
from torch.utils import _pytree as pytree

from fxamp import AmpConfig
from fxamp.testing import transform

__all__ = ["torch_lists", "cases", "check"]

LISTS = ("torch_expect_builtin_promote", "methods_expect_builtin_promote", "torch_16",
         "torch_fp16", "torch_fp32", "nn_16", "nn_fp16", "nn_fp32", "linalg_fp16",
         "methods_fp16", "methods_fp32", "torch_need_autocast_promote")


def torch_lists(device: str):
    """torch's AutocastCPUTestLists or (CUDA) AutocastTestLists for `device`."""
    try:
        import expecttest  # noqa: F401
    except ImportError:  # Note [Autocast lists without expecttest]
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase, stand_in.ACCEPT = unittest.TestCase, False
        sys.modules["expecttest"] = stand_in
        try:
            from torch.testing._internal import autocast_test_lists as lists
        finally:  # common_utils keeps its reference; no one else may find the stand-in
            del sys.modules["expecttest"]
    from torch.testing._internal import autocast_test_lists as lists

    factory = lists.AutocastCPUTestLists if device == "cpu" else lists.AutocastTestLists
    return factory(torch.device(device))


def _function(list_name: str, op_name: str):
    if list_name.startswith("methods"):
        return lambda self, *rest, **kw: getattr(self, op_name)(*rest, **kw)
    namespace = {"nn": torch._C._nn, "linalg": torch._C._linalg}.get(
        list_name.split("_")[0], torch)
    return getattr(namespace, op_name)


def cases(lists) -> list:
    """One pytest.param(list_name, op_name, args, kwargs) per entry of torch's lists."""
    found = []
    for list_name in LISTS:
        for i, entry in enumerate(getattr(lists, list_name, [])):
            op_name, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            found.append(pytest.param(list_name, op_name, args, kwargs,
                                      id=f"{list_name}-{op_name}-{i}"))
    return found


def _dtypes(out):
    return [t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _fxamp_dtypes(fn, args, kwargs, config):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def traced(*tensors):
        filled = list(leaves)
        for i, t in zip(tensor_idx, tensors):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        return fn(*a, **k)

    tensors = [leaves[i] for i in tensor_idx]
    gm = transform(traced, *tensors, config=config)
    return _dtypes(gm(*tensors))


def check(device, preset, list_name, op_name, args, kwargs, dtype) -> None:
    """Assert fxamp O1 with `preset` gives torch.autocast's output dtypes for one list entry."""
    fn = _function(list_name, op_name)
    with torch.autocast(device, dtype=dtype):
        expected = _dtypes(fn(*args, **kwargs))
    config = AmpConfig.from_opt_level("O1", dtype=dtype, policy=preset).resolve(device)
    assert _fxamp_dtypes(fn, args, kwargs, config) == expected, (list_name, op_name)
