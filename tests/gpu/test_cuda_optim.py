"""The fused optimizer step on CUDA: numerics against torch.optim.AdamW in fp32, no host
synchronisation, and a kernel count that does not grow with the number of tensors.
Skips without a CUDA device.

Tolerances: the masters (or fp32 weights) agree with torch.optim.AdamW fed the same gradients to
1e-5 of each tensor's largest magnitude after 20 steps (the CPU suite measures ~3e-7 with 1e-6,
tests/optim/test_numerics.py; CUDA kernels may contract multiply-adds differently, hence 10x).
The 16-bit model is the master rounded to it, bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

import fxamp.optim as fo
from benchmarks.step_timing import kernel_profile

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
STEPS, TOL = 20, 1e-5
KWARGS = dict(lr=1e-2, weight_decay=0.1)


def _mlp(dtype, width=16, depth=2, seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    return torch.nn.Sequential(*layers).to(CUDA, dtype)


def _batch(step, dtype, width=16):
    gen = torch.Generator(device=CUDA).manual_seed(step)
    x = torch.randn(32, width, device=CUDA, generator=gen)
    return x.to(dtype), torch.randn(32, width, device=CUDA, generator=gen)


def _assert_rel(ours, ref, tol):
    for a, b in zip(ours, ref):
        err = (a.float() - b.float()).abs().max()
        scale = b.float().abs().max().clamp_min(1e-30)
        assert err <= tol * scale, f"max error {err.item():.3g} vs scale {scale.item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["O1-fp32", "O2-fp16"])
def test_fused_step_matches_torch_adamw_fp32(dtype):
    model = _mlp(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = fo.AdamW(model.parameters(), **KWARGS)
    ref_opt = torch.optim.AdamW(ref, **KWARGS)
    scaler = fo.LossScaler("dynamic")
    for step in range(STEPS):
        x, y = _batch(step, dtype)
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        for p, r in zip(model.parameters(), ref):  # the same gradients, unscaled in fp32
            r.grad = p.grad.float() / scale
        opt.step(scaler)
        ref_opt.step()
    assert not opt.last_step_skipped()
    bucket = opt.buckets[0]
    _assert_rel(bucket.views(bucket.weights), ref, TOL)
    for p, master in zip(model.parameters(), bucket.views(bucket.weights)):
        assert torch.equal(p, master.to(dtype))


def test_step_never_synchronises():
    model = _mlp(torch.float16)
    opt = fo.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    scaler = fo.LossScaler()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    def step(i):
        x, y = _batch(i, torch.float16)
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        opt.step(scaler)
        sched.step()

    step(0)  # compiles, and creates the device state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 6):
            step(i)
        model[0].weight.grad.fill_(float("inf"))
        opt.step(scaler)  # a skipped step is a select on the device too
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.last_step_skipped()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _kernels_per_step(n_tensors, total=300 * 64 * 64):
    # The same number of elements in 10 or 300 tensors: whether Inductor splits a reduction
    # into two kernels depends on its size, which is not what this test is about.
    gen = torch.Generator(device=CUDA).manual_seed(n_tensors)
    params = [torch.nn.Parameter(torch.randn(total // n_tensors, device=CUDA, generator=gen)
                                 .half()) for _ in range(n_tensors)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt, scaler = fo.AdamW(params, **KWARGS), fo.LossScaler()
    opt.step(scaler)  # compiles
    return kernel_profile(lambda: opt.step(scaler), CUDA)


def test_kernels_per_step_do_not_grow_with_tensors():
    # Note [One kernel for the per-step scalars]: a split reduction (2 kernels, its last one
    # computing every per-step scalar) and the update (1).
    profiles = [_kernels_per_step(n) for n in (10, 300)]
    counts = [sum(k["calls"] for k in p) for p in profiles]
    names = [[f"{k['name'][:60]} x{k['calls']}" for k in p] for p in profiles]
    assert counts[0] == counts[1] <= 3, (counts, names)
