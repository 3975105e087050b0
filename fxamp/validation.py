"""Checks of user-supplied values, shared by the config, the loss scaler and the optimizers.

Each check returns the value in its canonical type or raises ConfigError naming the argument,
the bad value and the valid range, so that every entry point refuses the same inputs with the
same words, before it changes anything.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from fxamp.errors import ConfigError

__all__ = ["real", "positive_finite", "non_negative", "positive_int", "fraction", "choice",
           "boolean"]


def _is_real(value: Any) -> bool:
    # bool is an int to Python, but `loss_scale=True` is a mistake, not the scale 1.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real(value: Any, what: str, valid: str) -> float:
    """`value` as a float; refuses strings, bools, None and non-numbers."""
    if not _is_real(value):
        raise ConfigError(f"{what}={value!r} ({type(value).__name__}) must be {valid}")
    return float(value)


def positive_finite(value: Any, what: str, hint: str = "") -> float:
    """A number in (0, inf)."""
    valid = "a positive finite number" + hint
    number = real(value, what, valid)
    if not (number > 0 and math.isfinite(number)):
        raise ConfigError(f"{what}={value!r} must be {valid}")
    return number


def non_negative(value: Any, what: str, hint: str = "") -> float:
    """A finite number >= 0 (torch.optim's rule for lr, eps, weight_decay, momentum)."""
    valid = "a finite number >= 0" + hint
    number = real(value, what, valid)
    if not (number >= 0 and math.isfinite(number)):
        raise ConfigError(f"{what}={value!r} must be {valid}")
    return number


def fraction(value: Any, what: str, *, closed_low: bool = True) -> float:
    """A number in [0, 1) (or (0, 1) with `closed_low=False`)."""
    valid = ("a number in [0, 1)" if closed_low else "a number in (0, 1)")
    number = real(value, what, valid)
    if not ((number >= 0 if closed_low else number > 0) and number < 1):
        raise ConfigError(f"{what}={value!r} must be {valid}")
    return number


def positive_int(value: Any, what: str) -> int:
    """An int >= 1 (a float with an integral value such as 2000.0 is accepted)."""
    ok = _is_real(value) and math.isfinite(value) and float(value).is_integer() and value >= 1
    if not ok:
        raise ConfigError(f"{what}={value!r} must be a positive int (1, 2, ...)")
    return int(value)


def boolean(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{what}={value!r} must be True or False")
    return value


def choice(value: Any, what: str, choices: tuple, hint: Optional[str] = None) -> Any:
    """`value` if it is one of `choices` (compared by equality and type)."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        names = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{what}={value!r} is not one of {names}" + (f"; {hint}" if hint else ""))
    return value
