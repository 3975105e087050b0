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
fit beside the anchor alone is recorded as skipped, and so is one still waiting when the
deadline (benchmarks/deadline.py) is near.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Optional

import torch

from benchmarks import deadline
from benchmarks.step_timing import count_kernels, interleaved, ratio_stats, storage_bytes

ANCHOR = "fxamp"
TIMING_RESERVE_S = 5.0  # besides twice the slowest method's readying, for a group's rounds


def time_mode(builders: dict[str, Callable], shape_list, n: int, device, args, *,
              budget_bytes: float, save: Callable[[dict, dict], None]) -> tuple[dict, dict]:
    """Rows (as optimizer_step.report reads them) and {method: why skipped}; `save` gets both
    after each group (Note [Groups that fit])."""
    rows, skipped, slowest = {}, {}, [0.0]
    anchor = {ANCHOR: _ready(builders[ANCHOR], shape_list, slowest)} if ANCHOR in builders \
        else {}
    pending = [name for name in builders if name != ANCHOR]
    group_no = 0
    while True:
        group = dict(anchor)
        while pending and deadline.enough_for(2 * slowest[0] + TIMING_RESERVE_S):
            name = pending.pop(0)
            if _add(group, name, builders[name], shape_list, device, budget_bytes, slowest):
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
        if not deadline.enough_for(2 * slowest[0] + TIMING_RESERVE_S):
            skipped.update({name: "not timed: the report's deadline was near" for name in pending})
            break
        save(rows, skipped)
    save(rows, skipped)
    return rows, skipped


def _add(group, name, build, shape_list, device, budget_bytes, slowest) -> bool:
    """Make `name` ready in `group`; False (and freed again) when the group then passes the
    budget or the device runs out of memory."""
    try:
        group[name] = _ready(build, shape_list, slowest)
        if in_use(group, device) <= budget_bytes:
            return True
    except torch.cuda.OutOfMemoryError:
        pass
    group.pop(name, None)
    _free(device)
    return False


def _ready(build, shape_list, slowest: list[float]):
    start = time.perf_counter()
    built = build(shape_list)
    built.step()
    slowest[0] = max(slowest[0], time.perf_counter() - start)
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
    return {name: {
        "s": statistics.median(times[name]),
        "ratio": ratio_stats(times[name], ours) if ours else (float("nan"),) * 3,
        "bytes_per_param": storage_bytes(b.tensors()) / n,
        "kernels": count_kernels(b.step, device),
        "group": group_no} for name, b in group.items() if name not in keep}
