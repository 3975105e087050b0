"""The planner's roofline against measured GEMM times on the GPU (docs/planner.md, "Limits").
Skips without a CUDA device; run with `pytest -m gpu tests/gpu -s` to see the table.

For each shape, one training step of the GEMM site (forward, grad_input, grad_weight) is timed
with CUDA events in bf16 and in fxamp's float8 GEMM (eager: its casts unfused, as the cost
model counts them) and compared with `gemm_time` for the device. A roofline is a lower bound
made of datasheet peaks, so measured times may exceed it; the bounds below say only that the
model is the right size (measured within 0.5x-4x of modeled for bf16, 0.5x-8x for float8).
Not yet run on a GPU when written (the session had none).
"""

import pytest
import torch

from fxamp.float8.gemm import Float8MM
from fxamp.planner.cost import TARGETS, GemmShape, gemm_time

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = [(4096, 4096, 4096), (16384, 2048, 8192), (16384, 1024, 1024), (8192, 768, 3072)]


def _target():
    name = torch.cuda.get_device_name().lower()
    return TARGETS["h200"] if "h200" in name else TARGETS["h100"]


def _time(step, repeats=10) -> float:
    for _ in range(3):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _step(m, k, n, precision):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5).requires_grad_()
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def step():
        out = a @ b if precision == "bf16" else Float8MM.apply(a, b, precision)
        torch.autograd.grad(out, (a, b), g)

    return step


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 needs compute capability 8.9+")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_modeled_gemm_times_are_the_measured_ones_order_of_magnitude(shape):
    target = _target()
    site = GemmShape(*shape)
    rows = []
    for precision, high in (("bf16", 4), ("tensorwise", 8), ("rowwise", 8)):
        modeled = gemm_time(site, precision, target)
        measured = _time(_step(*shape, precision))
        rows.append(f"{precision:10} modeled {modeled * 1e6:9.1f} us  measured "
                    f"{measured * 1e6:9.1f} us  ({measured / modeled:.2f}x)")
        assert 0.5 * modeled <= measured <= high * modeled, rows[-1]
    print(f"\n{'x'.join(map(str, shape))} on {torch.cuda.get_device_name()}:\n" + "\n".join(rows))
