"""fxamp O1 with a torch preset gives the dtypes torch.autocast gives, op for op.

The cases are torch's own: torch.testing._internal.autocast_test_lists (autocast_lists.py).
CPU runs here; the CUDA list needs a GPU to run autocast on: tests/gpu/test_cuda_parity.py.
"""

import pytest
import torch
from autocast_lists import cases, check, torch_lists

CPU_CASES = cases(torch_lists("cpu"))


@pytest.mark.parametrize("list_name,op_name,args,kwargs", CPU_CASES)
def test_cpu_autocast_parity(list_name, op_name, args, kwargs):
    check("cpu", "torch-cpu", list_name, op_name, args, kwargs, torch.bfloat16)


def test_cpu_parity_count(capsys):
    """Every op of torch's CPU list, counted and reported in the test output."""
    passed, failed = 0, []
    for case in CPU_CASES:
        list_name, op_name, args, kwargs = case.values
        try:
            check("cpu", "torch-cpu", list_name, op_name, args, kwargs, torch.bfloat16)
            passed += 1
        except AssertionError:
            failed.append(f"{list_name}.{op_name}")
    with capsys.disabled():
        print(f"\nautocast parity (CPU, bf16): {passed}/{len(CPU_CASES)} ops match torch.autocast")
    assert not failed, failed
