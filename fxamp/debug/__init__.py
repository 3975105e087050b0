"""Numerics debugging: the op that overflowed, per-op value ranges, skipped-step reporting,
healing (promoting the op that keeps overflowing to fp32).

Everything here is opt-in: nothing runs, and no compiled graph changes, unless called.
"""

from fxamp.debug.heal import Healer, Promotion
from fxamp.debug.locate import (OverflowLocator, OverflowReport, OverflowSite, TensorSummary,
                                locate_overflow)
from fxamp.debug.ranges import RangeRecorder, RangeRow, RangeTable, range_stats
from fxamp.debug.skips import SkipMonitor

__all__ = [
    "Healer",
    "OverflowLocator",
    "Promotion",
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
