"""fxamp: Apex-style automatic mixed precision for PyTorch 2, as FX graph passes."""

from fxamp.backend import FxampBackend, backend
from fxamp.model.entry import compile
from fxamp.model.prepare import backend_of, config_of
from fxamp.config import AmpConfig
from fxamp.float8 import Float8Config
from fxamp.errors import BannedOpError, ConfigError, EagerRegionWarning, FxampError
from fxamp.policy import CastPolicy
from fxamp.explain import Explanation, explain
from fxamp.debug import Healer, SkipMonitor, locate_overflow, range_stats
from fxamp import distributed, optim, viewer
from fxamp.optim import (LossScaler, initialize, load_state_dict, master_params, scale_loss,
                         state_dict)
from fxamp.planner import PrecisionPlan, Target
from fxamp.planner.choose import plan

__all__ = [
    "AmpConfig",
    "BannedOpError",
    "CastPolicy",
    "Explanation",
    "explain",
    "Float8Config",
    "ConfigError",
    "EagerRegionWarning",
    "FxampBackend",
    "FxampError",
    "backend",
    "backend_of",
    "compile",
    "config_of",
    "SkipMonitor",
    "Healer",
    "locate_overflow",
    "range_stats",
    "distributed",
    "optim",
    "viewer",
    "LossScaler",
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "plan",
    "PrecisionPlan",
    "Target",
]
__version__ = "0.1.0"
