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


# The causes of the CUDA list's failures (GPU report, H100, 2026-11-27), reproduced on CPU with
# torch's CUDA lists built from CPU tensors.
def _cuda_lists_on_cpu():
    from torch.testing._internal import autocast_test_lists as lists

    torch_lists("cpu")  # imports the lists module (without expecttest where it is missing)
    return lists.AutocastTestLists(torch.device("cpu"))


def _entries(lists, list_name, op_name):
    return [c for c in cases(lists) if c.values[:2] == (list_name, op_name)]


MIXED = {  # ops whose kernels refuse a 16-bit operand beside an fp32 one, lowered by CPU autocast
    "linalg_vecdot": (torch.linalg.vecdot, lambda: (torch.randn(4, 8).bfloat16(),
                                                    torch.randn(4, 8))),
    "conv2d": (torch.nn.functional.conv2d, lambda: (torch.randn(1, 3, 6, 6).bfloat16(),
                                                    torch.randn(4, 3, 3, 3), torch.randn(4))),
}


@pytest.mark.parametrize("name", MIXED)
def test_transform_traces_mixed_operands_as_the_backend_does(name):
    # Note [Mixed operands trace under autocast]: a 16-bit activation meeting an fp32 weight in
    # an op that wants one dtype traces under the device's autocast, in fxamp.testing.transform
    # as in fxamp.compile; transform alone refused it (on CUDA: dot, tensordot, bilinear,
    # scatter_add of torch_need_autocast_promote).
    import fxamp
    from fxamp import AmpConfig
    from fxamp.testing import transform

    fn, make = MIXED[name]
    x, *weights = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(x, *weights)
    config = AmpConfig.from_opt_level("O1", dtype=torch.bfloat16).resolve("cpu")
    assert transform(fn, x, *weights, config=config)(x, *weights).dtype == expected.dtype

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weights[0])
            self.bias = torch.nn.Parameter(weights[1]) if len(weights) > 1 else None

        def forward(self, x):
            return fn(x, self.weight) if self.bias is None else fn(x, self.weight, self.bias)

    model = fxamp.compile(Model(), opt_level="O1", dtype=torch.bfloat16, compiler="aot_eager")
    assert torch.equal(model(x), expected)


def test_cuda_promote_entries_follow_the_device_autocast():
    # On CUDA autocast promotes them (and so does the torch-cuda preset); CPU autocast does not,
    # so torch.autocast refuses these programs on CPU, and fxamp refuses them too.
    from fxamp import AmpConfig
    from fxamp.policy import CastPolicy
    from fxamp.policy.tables import preset_table, resolve_op_name
    from fxamp.testing import transform

    lists = _cuda_lists_on_cpu()
    table = preset_table("torch-cuda")
    config = AmpConfig.from_opt_level("O1", dtype=torch.float16, policy="torch-cuda").resolve(
        "cpu")
    failed_on_cuda = {"bilinear", "dot", "vdot", "tensordot", "scatter_add"}
    refused = [(e[0], e[1]) for e in lists.torch_need_autocast_promote
               if e[0] in failed_on_cuda and _refuses(e[0], e[1])]
    assert {name for name, _ in refused} == failed_on_cuda  # their kernels want one dtype
    for op_name, args in refused:
        assert table[resolve_op_name(op_name)] is CastPolicy.PROMOTE, op_name
        fn = _torch_fn(op_name)
        with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=torch.float16):
            fn(*args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        with pytest.raises(RuntimeError):
            transform(lambda *t: fn(*_refill(args, t)), *tensors, config=config)


def _torch_fn(op_name):
    return getattr(torch, op_name, None) or getattr(torch.nn.functional, op_name)


def _refuses(op_name, args) -> bool:
    try:
        _torch_fn(op_name)(*args)
    except RuntimeError:
        return True
    return False


def _refill(args, tensors):
    it = iter(tensors)
    return [next(it) if isinstance(a, torch.Tensor) else a for a in args]


def test_equal_gives_autocasts_value_through_fxamp_compile():
    # torch.equal returns a bool that depends on the data: no graph can hold it (tracing raised
    # DataDependentOutputException), Dynamo runs it eagerly under the level's autocast, and the
    # check compares its value.
    (entry,) = _entries(_cuda_lists_on_cpu(), "torch_expect_builtin_promote", "equal")
    _, op_name, (a, b), kwargs = entry.values
    check("cpu", "torch-cpu", "torch_expect_builtin_promote", op_name, (a, b), kwargs,
          torch.bfloat16)
    check("cpu", "torch-cpu", "torch_expect_builtin_promote", op_name, (b.float(), b), kwargs,
          torch.bfloat16)  # equal values in two dtypes: True, under autocast and fxamp alike


def test_torch_lists_are_read_as_torch_reads_them():
    # Note [Reading torch's lists as torch's tests do] in autocast_lists.py.
    lists = _cuda_lists_on_cpu()
    (einsum,) = _entries(lists, "torch_fp16", "einsum")
    assert [m.name for m in einsum.marks] == ["skip"]
    cudnn = _entries(lists, "torch_fp16", "cudnn_convolution")
    assert cudnn and not cudnn[0].marks  # its flag, TEST_WITH_ROCM, is false here
    (norm, *_) = _entries(lists, "torch_fp32", "norm")
    assert norm.values[3] == {"dim": 0} or norm.values[3] == {}
