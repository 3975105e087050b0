"""Exceptions raised by fxamp. Every message names the bad value and what would be valid."""

__all__ = ["ConfigError", "FxampError", "BannedOpError", "EagerRegionWarning",
           "MasterWeightsWarning"]


class ConfigError(ValueError):
    """A bad opt level, override, dtype or argument combination (raised before anything changes)."""


class FxampError(RuntimeError):
    """A graph pass could not handle a node; the message names the pass and the node."""


class BannedOpError(FxampError):
    """An op that is unsafe in the low-precision dtype; the message names the safe alternative."""


class EagerRegionWarning(UserWarning):
    """A module Dynamo does not trace runs eagerly, outside fxamp's graphs (the message names
    it and what policy it gets instead); see docs/backend.md, "Graph breaks and eager regions"."""


class MasterWeightsWarning(UserWarning):
    """16-bit weights stepped by an optimizer without fp32 masters (Note [16-bit weights need
    fp32 masters] in fxamp/master_weights.py)."""
