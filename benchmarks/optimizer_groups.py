"""The optimizer benchmark's methods of one mode, timed in groups that fit the device's memory.

# Note [Groups that fit]
At 1B parameters each method keeps 6 to 20 bytes per parameter: the O2 methods together need
about 100 GB, more than an H100's 80. So the methods are made ready one at a time, in the
order given (priority: the targets' baselines first), each built and stepped once (torch's
optimizers create their state then; fxamp compiles), into a group until the memory in use
passes the budget; the method that passed it is freed and opens the next group. fxamp's default
step, the anchor and every ratio's denominator, stays in every group, so each ratio is still
taken within a round (Note [Taking turns] in benchmarks/optimizer_step.py). Memory in use is
the CUDA allocator's count; on CPU, the storages the ready methods keep. A method that does not
fit beside the anchor alone is recorded as skipped, and so is one whose readying would not end
before the deadline (benchmarks/deadline.py; Note [What readying a method costs]).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional

import torch

from benchmarks import deadline
from benchmarks.step_timing import interleaved, kernel_profile, ratio_stats, storage_bytes

ANCHOR = "fxamp"
TIMING_RESERVE_S = 5.0  # besides readying the next method: for a group's rounds and profiles
KERNELS_KEPT = 12  # per method, in the results: its slowest kernels by name


def time_mode(builders: dict[str, Callable], shape_list, n: int, device, args, *,
              budget_bytes: float, save: Callable[[dict, dict], None],
              compiles: Callable[[str], bool] = lambda name: True) -> tuple[dict, dict]:
    """Rows (as optimizer_step.report reads them) and {method: why skipped}; `save` gets both
    after each group (Note [Groups that fit]). `compiles(name)`: whether readying that method
    compiles (Note [What readying a method costs])."""
    rows: dict = {}
    skipped: dict = {}
    cost = ReadyCost(compiles)
    anchor = {ANCHOR: _ready(ANCHOR, builders[ANCHOR], shape_list, cost)} \
        if ANCHOR in builders else {}
    pending = [name for name in builders if name != ANCHOR]
    group_no = 0
    while True:
        group = dict(anchor)
        while pending:
            name = pending.pop(0)
            if not deadline.enough_for(cost.expected(name) + TIMING_RESERVE_S):
                skipped[name] = "not timed: the report's deadline was near"
                continue  # a cheaper one further on may still fit
            if _add(group, name, builders[name], shape_list, device, budget_bytes, cost):
                continue
            if len(group) == len(anchor):  # alone beside the anchor, it does not fit
                skipped[name] = f"does not fit in {budget_bytes / 2**30:.1f} GiB beside fxamp"
                continue
            pending.insert(0, name)
            break
        if len(group) > len(anchor) or not rows:
            rows.update(_time_group(group, group_no, n, device, args, keep=rows))
            group_no += 1
        for name in [k for k in group if k not in anchor]:
            del group[name]
        _free(device)
        if not pending:
            break
        save(rows, skipped)
    save(rows, skipped)
    return rows, skipped


# Note [What readying a method costs]
# Readying a method (building it and taking its first step) costs a compile for fxamp's steps
# (and torchao's, which compiles a step per parameter shape), and well under a second for
# torch's eager optimizers, even at 1B parameters. The first compile in the process also pays
# Inductor's start-up, so the anchor's readying (fxamp's default step, first) overstates what
# the next compiled method takes. The first GPU report (H100, 2026-11-27) estimated every method
# at twice the slowest readying so far, the anchor's cold compile: 59 s of a 100 s cap were used
# and every peer was skipped as "the deadline was near", torch's eager baselines included. Now
# a method is expected to take what the last method of its kind took (the anchor's time for the
# first compiled one after it, EAGER_GUESS_S for the first eager one), and one that does not fit
# is skipped while cheaper ones after it are still tried.
EAGER_GUESS_S = 5.0


class ReadyCost:
    """Seconds each method took to ready, and what the next one is expected to take."""

    def __init__(self, compiles: Callable[[str], bool]) -> None:
        self.compiles = compiles
        self.last: dict[bool, float] = {}  # compiles -> the last readying of that kind

    def record(self, name: str, seconds: float) -> None:
        self.last[self.compiles(name)] = seconds

    def expected(self, name: str) -> float:
        kind = self.compiles(name)
        return self.last.get(kind, max(self.last.values(), default=0.0) if kind
                             else EAGER_GUESS_S)


def _add(group, name, build, shape_list, device, budget_bytes, cost) -> bool:
    """Make `name` ready in `group`; False (and freed again) when the group then passes the
    budget or the device runs out of memory."""
    try:
        group[name] = _ready(name, build, shape_list, cost)
        if in_use(group, device) <= budget_bytes:
            return True
    except torch.cuda.OutOfMemoryError:
        pass
    group.pop(name, None)
    _free(device)
    return False


def _ready(name: str, build, shape_list, cost: ReadyCost):
    start = time.perf_counter()
    built = build(shape_list)
    built.step()
    built.ready_s = time.perf_counter() - start
    cost.record(name, built.ready_s)
    print(f"  {name}: ready in {built.ready_s:.1f} s", flush=True)
    return built


def in_use(group: dict, device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return storage_bytes([t for b in group.values() for t in b.tensors()])


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_group(group: dict, group_no: int, n: int, device, args, keep: dict) -> dict:
    times = interleaved({k: b.step for k, b in group.items()}, device, args.warmup, args.reps)
    ours: Optional[list] = times.get(ANCHOR)
    rows = {}
    for name, b in group.items():
        if name in keep:
            continue
        kernels = kernel_profile(b.step, device)
        rows[name] = {
            "s": statistics.median(times[name]),
            "ratio": ratio_stats(times[name], ours) if ours else (float("nan"),) * 3,
            "bytes_per_param": storage_bytes(b.tensors()) / n,
            "kernels": sum(k["calls"] for k in kernels),
            # what the launches are (the slowest KERNELS_KEPT by name) and their time in one
            # profiled step, for the kernel-count target
            "kernel_list": kernels[:KERNELS_KEPT],
            "ready_s": round(b.ready_s, 4),  # eager rows: milliseconds
            "group": group_no}
    return rows
