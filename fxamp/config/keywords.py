"""Apex's keyword values as canonical Python values (opt levels, dtypes by name, the strings
"True" and "False" its launch scripts pass), each refusal a ConfigError naming the value."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Union

import torch

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.policy import LOW_DTYPES

__all__ = ["OPT_LEVELS", "check_opt_level", "as_dtype", "as_bool", "as_loss_scale",
           "as_model_type", "check_scaler_bounds", "digest"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def as_dtype(value: Any, what: str, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    dtype = _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ConfigError(f"{what}={value!r} is not one of {names}")
    return dtype


def as_model_type(value: Any) -> Union[torch.dtype, bool]:
    # Apex casts the model only `if properties.cast_model_type:`, so False (multi-model and
    # fine-tuning scripts pass it) means "leave the model's dtypes alone" at every level.
    return _dtype_or_false(value, "cast_model_type",
                           "torch.float16, torch.bfloat16, torch.float32",
                           "leave the model's dtypes alone")


def as_outputs(value: Any) -> Union[torch.dtype, bool]:
    """`cast_model_outputs`: a dtype floating outputs are cast to, or False to leave them as
    the graph computes them (a model whose outputs another model consumes: torchtitan's)."""
    return _dtype_or_false(value, "cast_model_outputs",
                           "torch.float32, torch.float16, torch.bfloat16",
                           "leave the outputs as computed")


def _dtype_or_false(value: Any, what: str, dtypes: str, false_means: str
                    ) -> Union[torch.dtype, bool]:
    # False (the bool) is a choice of its own; True and the strings are refused, not read as it
    if value is False:
        return False
    if value is True or value in ("True", "False"):
        raise ConfigError(f"{what}={value!r} must be a dtype ({dtypes}) or False (the bool: "
                          f"{false_means})")
    return as_dtype(value, what, (torch.float32, *LOW_DTYPES))


def as_bool(value: Any, what: str) -> bool:
    # Apex accepts the strings "True"/"False" because its launch scripts pass argv through.
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ConfigError(f"{what}={value!r} must be True, False, 'True' or 'False'")


def as_loss_scale(value: Any) -> Union[float, str]:
    if value == "dynamic" and isinstance(value, str):
        return "dynamic"
    if isinstance(value, str):  # Apex's launch scripts pass "128.0" through from argv
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"loss_scale={value!r} must be a positive number, a numeric "
                              "string or 'dynamic'") from None
    return validation.positive_finite(value, "loss_scale", " or 'dynamic'")


def check_scaler_bounds(min_scale: Any, max_scale: Any) -> None:
    if min_scale is not None:
        validation.positive_finite(min_scale, "min_loss_scale",
                                   " or None (the default floor, 1.0)")
    if max_scale is not None:
        validation.positive_finite(max_scale, "max_loss_scale", " or None (no cap)")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ConfigError(f"min_loss_scale={min_scale!r} exceeds max_loss_scale={max_scale!r}; "
                          "the floor must be <= the cap")


def check_opt_level(opt_level: Any) -> str:
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if isinstance(opt_level, str) and opt_level.upper().replace("0", "O", 1) in OPT_LEVELS:
        hint = (" (the prefix is the letter O, not the number zero)" if opt_level[:1] == "0"
                else " (the prefix is an upper-case letter O)")
    raise ConfigError(f"opt_level {opt_level!r} is not one of 'O0', 'O1', 'O2', 'O3'{hint}")


def digest(config: Any) -> str:
    """A digest that is stable across processes (dtype objects hash by id)."""
    fields = ((f.name, str(getattr(config, f.name))) for f in dataclasses.fields(config))
    return hashlib.sha256(repr(tuple(fields)).encode()).hexdigest()[:16]
