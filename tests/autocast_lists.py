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


# Note [Reading torch's lists as torch's tests do]
# An entry is (op, args) or (op, args, third), and the third element means what torch's own
# tests (test/test_cuda.py, test/test_autocast.py) make of it: keyword arguments where it is a
# dict; the expected output dtype in the *_expect_builtin_promote lists (checked here against
# autocast itself, so not needed); and in torch_fp16 a skip flag (`TEST_WITH_ROCM`): torch runs
# the entry only when it is falsy. torch_fp16's einsum entry, ("einsum", "bkhd,bqhd->bqkh",
# mat0 + mat1), has its operands in the flag's place: torch never runs it (a non-empty tuple is
# true), and running it here splatted the equation string into 15 arguments ("Number of einsum
# subscripts, 1, must be equal to the number of operands, 14": GPU report, H100, 2026-11-27).
SKIP_FLAG_LISTS = ("torch_fp16",)


def cases(lists) -> list:
    """One pytest.param(list_name, op_name, args, kwargs) per entry of torch's lists, read as
    torch reads them (Note [Reading torch's lists as torch's tests do])."""
    found = []
    for list_name in LISTS:
        for i, entry in enumerate(getattr(lists, list_name, [])):
            op_name, args = entry[0], entry[1]
            third = entry[2] if len(entry) > 2 else None
            kwargs = third if isinstance(third, dict) else {}
            marks = ()
            if list_name in SKIP_FLAG_LISTS and third is not None and bool(third):
                marks = pytest.mark.skip(reason="torch's own test skips this entry (its third "
                                                "element, the skip flag, is true)")
            found.append(pytest.param(list_name, op_name, args, kwargs, marks=marks,
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


class _Calls(torch.nn.Module):
    """A model whose forward is one call of `fn` (`anchor`: fxamp.compile refuses a model with no
    floating-point state)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.register_buffer("anchor", torch.zeros(()))

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _fxamp_compiled(fn, args, kwargs, dtype, preset):
    import fxamp

    model = fxamp.compile(_Calls(fn), opt_level="O1", dtype=dtype, policy=preset,
                          compiler="aot_eager")
    return model(*args, **kwargs)


def check(device, preset, list_name, op_name, args, kwargs, dtype) -> None:
    """Assert fxamp O1 with `preset` gives what torch.autocast gives for one list entry: the
    output dtypes (traced, `transform`), or for an op whose result is not a tensor
    (`torch.equal`'s bool, which no graph can hold: Dynamo runs it eagerly, under the level's
    autocast) the value, through `fxamp.compile`."""
    fn = _function(list_name, op_name)
    with torch.autocast(device, dtype=dtype):
        expected = fn(*args, **kwargs)
    if not _dtypes(expected):
        got = _fxamp_compiled(fn, args, kwargs, dtype, preset)
        assert got == expected and type(got) is type(expected), (list_name, op_name, got)
        return
    config = AmpConfig.from_opt_level("O1", dtype=dtype, policy=preset).resolve(device)
    assert _fxamp_dtypes(fn, args, kwargs, config) == _dtypes(expected), (list_name, op_name)
