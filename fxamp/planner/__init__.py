"""The precision planner (docs/planner.md): the plan's data and the cost model's targets.

`fxamp.plan` itself lives in fxamp/planner/choose.py: it measures through the debug tools,
which prepare models, and `fxamp.compile(plan=...)` reads the plan's data from here.
"""

from fxamp.planner.cost import TARGETS, GemmShape, Target
from fxamp.planner.plan import PlannedGemm, PrecisionPlan

__all__ = ["PlannedGemm", "PrecisionPlan", "Target", "TARGETS", "GemmShape"]
