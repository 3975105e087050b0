"""Checks of loaded state dicts, run in full before anything is loaded (atomic loads)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from fxamp import validation
from fxamp.errors import ConfigError

__all__ = ["parse_scaler_state", "single_scaler_entry"]


def _number(value: Any) -> Any:
    # torch.load may hand back 0-dim tensors where the saver wrote numbers.
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _non_negative_int(value: Any, what: str) -> int:
    value = _number(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{what}={value!r} in the loss-scaler state dict must be an int >= 0")
    return value


def parse_scaler_state(sd: Any, rule: Any) -> tuple[float, int, int, int, dict[str, Any]]:
    """(scale, growth tracker, hysteresis left, skipped steps, rule fields) of fxamp's,
    GradScaler's or Apex's loss-scaler state, every value checked (ConfigError names the key and
    the valid range); GradScaler's and Apex's hold no skip count (0)."""
    if not isinstance(sd, Mapping):
        raise ConfigError(f"a loss-scaler state dict is a dict, not {type(sd).__name__}")
    if not sd:
        raise ConfigError("the loss-scaler state dict is empty, as a disabled scaler saves it "
                          "(GradScaler's too); load it into a LossScaler(enabled=False)")
    if "loss_scale" in sd:  # Apex
        scale_key, tracker = "loss_scale", _non_negative_int(sd.get("unskipped"), "unskipped")
    elif "scale" in sd:  # GradScaler or fxamp
        scale_key = "scale"
        tracker = _non_negative_int(sd.get("_growth_tracker", 0), "_growth_tracker")
    else:
        raise ConfigError(f"not a loss-scaler state dict: keys {sorted(sd)}; expected 'scale' "
                          "(fxamp, GradScaler) or 'loss_scale' and 'unskipped' (Apex)")
    scale = validation.positive_finite(_number(sd[scale_key]), f"state_dict[{scale_key!r}]",
                                       " (a scale that reached 0 or inf cannot be resumed; load "
                                       "a checkpoint saved before it, or set_scale() a new one)")
    hyst = validation.positive_int(_number(sd.get("hysteresis_left", rule.hysteresis)),
                                   "state_dict['hysteresis_left']")
    skipped = _non_negative_int(sd.get("skipped_steps", 0), "skipped_steps")
    return scale, tracker, hyst, skipped, _rule_fields(sd)


def _rule_fields(sd: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if "growth_factor" in sd:
        factor = validation.real(_number(sd["growth_factor"]), "state_dict['growth_factor']",
                                 "a finite number >= 1")
        if not (factor >= 1 and math.isfinite(factor)):
            raise ConfigError(f"state_dict['growth_factor']={factor!r} must be a finite number "
                              ">= 1")
        fields["growth_factor"] = factor
    if "backoff_factor" in sd:
        fields["backoff_factor"] = validation.fraction(
            _number(sd["backoff_factor"]), "state_dict['backoff_factor']", closed_low=False)
    if "growth_interval" in sd:
        fields["growth_interval"] = validation.positive_int(
            _number(sd["growth_interval"]), "state_dict['growth_interval']")
    return fields


def single_scaler_entry(sd: Any) -> Any:
    """`sd`, or its one Apex "loss_scalerN" entry; refuse an Apex dict with several."""
    entries = [k for k in sd if k.startswith("loss_scaler")] if isinstance(sd, Mapping) else []
    if not entries:
        return sd
    if len(entries) == 1:
        return sd[entries[0]]
    raise ConfigError(f"this Apex amp state dict holds {len(entries)} loss scalers "
                      f"({', '.join(sorted(entries))}); pass one entry to LossScaler."
                      "load_state_dict or use fxamp.optim.load_amp_state_dict")
