"""The code Dynamo does not compile runs under the opt level's policy too.

At O1 each call of a compiled model runs under `torch.autocast` of the level's device and dtype,
so graph breaks and modules Dynamo does not trace get autocast's table, while fxamp's graphs run
(and are traced) with that autocast off; O0, O2 and O3 run without it. Untraced recurrent layers
at O1 also run under `RecurrentCasts`, which casts them as Apex did.

Design (docs/design.md): Note [Eager regions run under autocast], Note [Recurrent layers at O1,
as Apex].
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from torch.overrides import TorchFunctionMode

from fxamp import _compat
from fxamp.config import AmpConfig
from fxamp.errors import EagerRegionWarning
from fxamp.policy.tables import RECURRENT_FUNCTIONS

__all__ = ["with_policy_autocast", "without_autocast", "untraced_modules", "warn_untraced",
           "RecurrentCasts"]

_RECURRENT = frozenset(getattr(torch, name) for name in RECURRENT_FUNCTIONS.split())
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # never fp64, never integers


class RecurrentCasts(TorchFunctionMode):
    """Runs torch.lstm/gru/rnn_tanh/rnn_relu with every fp32/16-bit floating tensor argument
    (input, hidden state, weights) cast to `dtype` (Note [Recurrent layers at O1, as Apex])."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.dtype) if value.dtype in _CASTABLE else value
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v) for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RECURRENT:
            args, kwargs = self._cast(args), {k: self._cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def with_policy_autocast(fn: Callable[..., Any], config: AmpConfig, *,
                         recurrent: Callable[[], bool] = lambda: False) -> Callable[..., Any]:
    """`fn` run under `torch.autocast(device, dtype)` at O1 (and under `RecurrentCasts` when
    `recurrent()`: the model has untraced recurrent modules); `fn` itself at other levels."""
    if not config.patch_torch_functions:
        return fn
    device_type, dtype = config.device_type, config.dtype

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            if not recurrent():
                return fn(*args, **kwargs)
            with RecurrentCasts(dtype):
                return fn(*args, **kwargs)

    return call


def without_autocast(compiled: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """`compiled` run with autocast off for `device_type` (Dynamo's calling convention kept)."""
    boxed = getattr(compiled, "_boxed_call", False)

    def call(*args: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            return compiled(*args)

    call._boxed_call = boxed  # type: ignore[attr-defined]
    return call


def untraced_modules(model: torch.nn.Module) -> list[str]:
    """'path (Class)' of every submodule Dynamo runs eagerly instead of tracing (RNNs)."""
    if _compat.dynamo_traces_rnns():
        return []
    return [f"{name or '<root>'} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, torch.nn.RNNBase)]


def eager_policy(config: AmpConfig) -> str:
    """What an eager region gets at this level, in words."""
    if config.patch_torch_functions:
        return (f"torch.autocast({config.device_type!r}, dtype={config.dtype}), not fxamp's "
                f"graphs; recurrent layers get input, state and weights cast to {config.dtype} "
                "(Apex's rule)")
    return f"no casts: its weights as stored ({config.opt_level} casts no ops)"


def warn_untraced(model: torch.nn.Module, config: AmpConfig) -> list[str]:
    """Warn once, at fxamp.compile, naming the modules that will run eagerly."""
    found = untraced_modules(model)
    if found:
        warnings.warn(
            f"fxamp {config.opt_level}: {', '.join(found)} not traced by Dynamo (RNN modules "
            f"run eagerly), so they run under {eager_policy(config)}; fxamp.explain() lists "
            "them", EagerRegionWarning, stacklevel=3)
    return found
