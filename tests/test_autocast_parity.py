"""fxamp O1 with a torch preset gives the dtypes torch.autocast gives, op for op.

The cases are torch's own: torch/testing/_internal/autocast_test_lists.py. CPU runs here; the
CUDA list (AutocastTestLists) needs a GPU to run autocast on, so it skips without one.
"""

import pytest
import torch
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists, AutocastTestLists
from torch.utils import _pytree as pytree

from fxamp import AmpConfig
from fxamp.testing import transform

_LISTS = ("torch_expect_builtin_promote", "methods_expect_builtin_promote", "torch_16",
          "torch_fp16", "torch_fp32", "nn_16", "nn_fp16", "nn_fp32", "linalg_fp16",
          "methods_fp16", "methods_fp32", "torch_need_autocast_promote")


def _function(list_name: str, op_name: str):
    if list_name.startswith("methods"):
        return lambda self, *rest, **kw: getattr(self, op_name)(*rest, **kw)
    namespace = {"nn": torch._C._nn, "linalg": torch._C._linalg}.get(
        list_name.split("_")[0], torch)
    return getattr(namespace, op_name)


def _cases(lists):
    cases = []
    for list_name in _LISTS:
        for i, entry in enumerate(getattr(lists, list_name, [])):
            op_name, args = entry[0], entry[1]
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            cases.append(pytest.param(list_name, op_name, args, kwargs,
                                      id=f"{list_name}-{op_name}-{i}"))
    return cases


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


def _check(device, preset, list_name, op_name, args, kwargs, dtype):
    fn = _function(list_name, op_name)
    with torch.autocast(device, dtype=dtype):
        expected = _dtypes(fn(*args, **kwargs))
    config = AmpConfig.from_opt_level("O1", dtype=dtype, policy=preset).resolve(device)
    assert _fxamp_dtypes(fn, args, kwargs, config) == expected, (list_name, op_name)


CPU_CASES = _cases(AutocastCPUTestLists(torch.device("cpu")))


@pytest.mark.parametrize("list_name,op_name,args,kwargs", CPU_CASES)
def test_cpu_autocast_parity(list_name, op_name, args, kwargs):
    _check("cpu", "torch-cpu", list_name, op_name, args, kwargs, torch.bfloat16)


def test_cpu_parity_count(capsys):
    """Every op of torch's CPU list, counted and reported in the test output."""
    passed, failed = 0, []
    for case in CPU_CASES:
        list_name, op_name, args, kwargs = case.values
        try:
            _check("cpu", "torch-cpu", list_name, op_name, args, kwargs, torch.bfloat16)
            passed += 1
        except AssertionError:
            failed.append(f"{list_name}.{op_name}")
    with capsys.disabled():
        print(f"\nautocast parity (CPU, bf16): {passed}/{len(CPU_CASES)} ops match torch.autocast")
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA list runs autocast on CUDA")
@pytest.mark.parametrize("list_name,op_name,args,kwargs",
                         _cases(AutocastTestLists(torch.device("cuda")))
                         if torch.cuda.is_available() else [])
def test_cuda_autocast_parity(list_name, op_name, args, kwargs):
    _check("cuda", "torch-cuda", list_name, op_name, args, kwargs, torch.float16)
