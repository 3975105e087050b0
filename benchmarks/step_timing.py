"""Timing and counting shared by the optimizer benchmarks: steps taking turns, per-round ratios,
kernels per step, and the bytes a method keeps (benchmarks/optimizer_step.py)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import deadline

NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::view", "aten::slice", "aten::select",
             "aten::as_strided", "aten::detach", "aten::alias", "aten::lift_fresh",
             "aten::resolve_conj", "aten::resolve_neg", "aten::_local_scalar_dense",
             "aten::item", "aten::t", "aten::unsqueeze", "aten::reshape", "aten::expand"}


def storage_bytes(tensors) -> int:
    """Bytes of the memory behind `tensors`' storages, each byte once: views of one buffer, and
    storages that are windows into another's memory (fxamp's parameters: Note [Parameters own
    their storage] in fxamp/optim/buffers/flat.py), count once."""
    spans = sorted({(str(t.device), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    for t in tensors})
    total, end, device = 0, 0, None
    for dev, start, size in spans:
        if dev != device:
            device, end = dev, 0
        total += max(0, start + size - max(start, end))
        end = max(end, start + size)
    return total


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(step: Callable, device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def time_step(step: Callable, device, warmup: int, reps: int) -> float:
    """Median seconds per call after warm-up (the first call compiles where it compiles)."""
    for _ in range(warmup):
        step()
    return statistics.median(_timed(step, device) for _ in range(reps))


def interleaved(steps: dict[str, Callable], device, warmup: int, reps: int) -> dict[str, list]:
    """Seconds per step of every method, taking turns round by round (Note [Taking turns])."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    names, times = list(steps), {name: [] for name in steps}
    for i in range(reps):
        start = time.perf_counter()
        k = i % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(_timed(steps[name], device))
        # Under a report's deadline, fewer rounds (at least 3) rather than none at all.
        if i >= 2 and not deadline.enough_for(2 * (time.perf_counter() - start) + 1):
            break
    return times


def ratio_stats(times: list[float], ours: list[float]) -> tuple[float, float, float]:
    """Median, lowest and highest of the per-round ratios time / fxamp's time."""
    ratios = sorted(t / o for t, o in zip(times, ours))
    return statistics.median(ratios), ratios[0], ratios[-1]


def kernel_profile(step: Callable, device) -> list[dict]:
    """The kernels one call of `step` launches, by name: [{"name", "calls", "us"}], slowest
    first (CUDA: every device activity, memcpy and memset included, with its device time; CPU:
    Inductor's C++ kernels and the ATen ops that do work, with their CPU time)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [(e.name, e.time_range.elapsed_us()) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        parents = {id(e.cpu_parent) for e in events if e.cpu_parent is not None}
        kernels = [(e.name, e.cpu_time_total) for e in events if id(e) not in parents and (
            "cpp_fused" in e.name or (e.name.startswith("aten::") and e.name not in NO_KERNEL))]
    by_name: dict[str, dict] = {}
    for name, us in kernels:
        row = by_name.setdefault(name, {"name": name, "calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += us
    return sorted(by_name.values(), key=lambda r: -r["us"])


def count_kernels(step: Callable, device) -> int:
    """How many kernels one call of `step` launches (`kernel_profile`'s calls)."""
    return sum(r["calls"] for r in kernel_profile(step, device))
