"""Compiled mixed-precision optimizers, loss scaling and Apex-style entry points."""

from fxamp.optim.loss_scaler import LossScaler
from fxamp.optim.optimizer import FusedOptimizer
from fxamp.optim.optimizers import LAMB, SGD, Adam, AdamW

__all__ = ["Adam", "AdamW", "SGD", "LAMB", "FusedOptimizer", "LossScaler"]
