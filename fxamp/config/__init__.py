"""fxamp's configuration: an AmpConfig (amp.py) is two frozen parts, what the model's graphs
depend on (GraphConfig, graph.py) and what the optimizer and its loss scalers depend on
(ScalerConfig, scaler.py), so a loss-scale setting never changes a compiled graph; keywords.py
reads Apex's keyword values."""

from fxamp.config.amp import AmpConfig
from fxamp.config.graph import GraphConfig
from fxamp.config.keywords import OPT_LEVELS
from fxamp.config.scaler import ScalerConfig

__all__ = ["AmpConfig", "GraphConfig", "ScalerConfig", "OPT_LEVELS"]
