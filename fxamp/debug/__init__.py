"""Numerics debugging: the op that overflowed, per-op value ranges, skipped-step reporting.

Everything here is opt-in: nothing runs, and no compiled graph changes, unless called.
"""

from fxamp.debug.locate import (OverflowLocator, OverflowReport, OverflowSite, TensorSummary,
                                locate_overflow)
from fxamp.debug.ranges import RangeRecorder, RangeRow, RangeTable, range_stats
from fxamp.debug.skips import SkipMonitor

__all__ = [
    "OverflowLocator",
    "OverflowReport",
    "OverflowSite",
    "TensorSummary",
    "RangeRecorder",
    "RangeRow",
    "RangeTable",
    "SkipMonitor",
    "locate_overflow",
    "range_stats",
]
