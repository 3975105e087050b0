"""Turns on one GPU for benchmark processes that run side by side (benchmarks/gpu_report.py).

Compiling is CPU work, timing needs the device to itself: a process holds the lock file shared
while it compiles and warms up, and exclusively while it times, so that several processes
compile at once and time one at a time. With no path both are no-ops (a lone run).
"""

from __future__ import annotations

import contextlib
import fcntl
from typing import Iterator, Optional


@contextlib.contextmanager
def hold(path: Optional[str], *, exclusive: bool) -> Iterator[None]:
    """Hold the lock file at `path` shared or exclusively for the block (waits for it)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
