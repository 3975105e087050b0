"""A PrecisionPlan as strict JSON, both ways (docs/planner.md, "The plan as data").

Written: standard JSON only, never `Infinity` or `NaN` (strict parsers refuse them): a
non-finite float is the string "inf", "-inf" or "nan". Read: every field of every record,
no other, each of the type its dataclass declares (the type hints drive the reader, so a new
field is read as strictly as the old ones), or a ConfigError that names the field by its
path ("sites[2].errors[0][1]").
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Union

from fxamp.errors import ConfigError

__all__ = ["dumps", "loads"]

_NON_FINITE = ("inf", "-inf", "nan")


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def dumps(record: Any, header: dict[str, Any]) -> str:
    """`header` and the fields of dataclass `record` as JSON text."""
    return json.dumps({**header, **_encode(dataclasses.asdict(record))}, indent=1,
                      allow_nan=False)


def _refuse_constant(name: str) -> None:
    raise ConfigError(f"malformed fxamp plan JSON: {name} is not JSON (a non-finite number is "
                      'written "inf", "-inf" or "nan")')


def loads(text: str) -> Any:
    """JSON text as Python values, refusing the non-standard constants Infinity and NaN."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(f"malformed fxamp plan JSON: {e}") from None


def _bad(path: str, want: str, value: Any) -> ConfigError:
    return ConfigError(f"malformed fxamp plan JSON: {path} must be {want}, not {value!r}")


def _scalar(value: Any, hint: type, path: str) -> Any:
    if hint is float:
        if isinstance(value, str) and value in _NON_FINITE:
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(path, 'a number (or "inf", "-inf", "nan")', value)
    if not isinstance(value, hint) or isinstance(value, bool) != (hint is bool):
        raise _bad(path, f"a JSON {'string' if hint is str else 'integer'}", value)
    return value


def _tuple(value: Any, args: tuple, path: str) -> tuple:
    if not isinstance(value, list):
        raise _bad(path, "a JSON array", value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(read(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise _bad(path, f"an array of {len(args)}", value)
    return tuple(read(v, h, f"{path}[{i}]") for i, (v, h) in enumerate(zip(value, args)))


def read(value: Any, hint: Any, path: str) -> Any:
    """`value` (parsed JSON) as type `hint`: a dataclass, Optional, tuple, float, int or str."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _record(value, hint, path)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return read(value, inner, path)
    if origin is tuple:
        return _tuple(value, args, path)
    return _scalar(value, hint, path)


def _record(value: Any, cls: type, path: str) -> Any:
    if not isinstance(value, dict):
        raise _bad(path or "the plan", "a JSON object", value)
    at = lambda name: f"{path}.{name}" if path else name
    names = [f.name for f in dataclasses.fields(cls)]
    problems = ([f"field {at(n)!r} is missing" for n in names if n not in value]
                + [f"field {at(k)!r} is not one of {cls.__name__}'s" for k in value
                   if k not in names])
    if problems:
        raise ConfigError(f"malformed fxamp plan JSON: {'; '.join(problems)} (write plans with "
                          "plan.to_json())")
    hints = typing.get_type_hints(cls)
    return cls(**{n: read(value[n], hints[n], at(n)) for n in names})
