"""The part of an AmpConfig the optimizer and its loss scalers depend on; a change to it never
changes a model's compiled graphs."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from fxamp.config.keywords import as_loss_scale, check_scaler_bounds, digest
from fxamp.errors import ConfigError

__all__ = ["ScalerConfig"]


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """What the optimizer and its loss scalers depend on, under Apex's names. Built by
    `AmpConfig.from_opt_level`; each field is also an attribute of the AmpConfig
    (`config.loss_scale` is `config.scaler.loss_scale`).

    Attributes:
        master_weights: keep fp32 master copies of low-precision parameters in the optimizer;
            None at O1, whose fp32 weights are their own masters (O1 refuses a value).
        loss_scale: a positive number (a static scale) or "dynamic".
        min_loss_scale: the dynamic scale's floor, or None (1.0).
        max_loss_scale: the dynamic scale's cap, or None (no cap).
        num_losses: how many losses `scale_loss(loss_id=...)` scales, each by a loss scaler of
            its own (Apex's `num_losses`).
    """

    master_weights: Optional[bool] = None
    loss_scale: Union[float, str] = "dynamic"
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = 2.0**24
    num_losses: int = 1

    def __post_init__(self) -> None:
        if type(self.num_losses) is not int or self.num_losses < 1:
            raise ConfigError(f"num_losses={self.num_losses!r} must be a positive int (1, 2, ...)")
        if self.loss_scale != "dynamic":
            as_loss_scale(self.loss_scale)
        check_scaler_bounds(self.min_loss_scale, self.max_loss_scale)

    def cache_key(self) -> str:
        return digest(self)
