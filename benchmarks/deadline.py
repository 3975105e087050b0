"""The time a benchmark process may use, when benchmarks/gpu_report.py started it.

The report gives each stage a cap (Note [Shares of the time left] in benchmarks/gpu_stages.py)
and kills a part still running at it. So that a part cut short still leaves results, the report
passes the cap to its parts in the environment, as a wall-clock time, and the benchmarks size
themselves to it: they prepare no further recipe or mode when what is left would not cover it,
and they stop timing rounds when the end is near (keeping the rounds they have). Run alone
(no variable), a benchmark has no deadline.
"""

from __future__ import annotations

import math
import os
import time

ENV = "FXAMP_REPORT_DEADLINE"  # seconds since the epoch


def left_s() -> float:
    """Seconds left before the deadline (infinite when none is set)."""
    value = os.environ.get(ENV)
    return float(value) - time.time() if value else math.inf


def enough_for(seconds: float) -> bool:
    """Whether `seconds` of work still end before the deadline."""
    return seconds <= left_s()
