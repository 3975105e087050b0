"""The code Dynamo does not compile runs under the opt level's policy too.

Note [Eager regions run under autocast]: a graph break (`.item()`, `print`, a builtin Dynamo
cannot trace, a data-dependent branch), a module Dynamo will not trace (nn.LSTM, nn.GRU) or
a frame Dynamo skips (the forward of a torch.nn module called from eager code) runs eagerly,
between or around fxamp's graphs. At O1 the activations it receives are already 16-bit and
the weights fp32, so outside any policy it fails (`mat1 and mat2 must have the same dtype`)
or silently runs in fp32. So `fxamp.compile` runs each O1 call under `torch.autocast` of the
level's device and dtype -- the eager regions get autocast's op table, the same table as
fxamp's default preset for the device -- and every graph fxamp compiles runs with autocast
turned off for that device (and is traced with it off), so inside the graphs only fxamp's
policy applies, never both. The user's own `torch.autocast` regions inside forward are graph
nodes and keep their meaning (Note [The user's autocast wins] in passes/annotate.py).

O0, O2 and O3 cast no ops (their eager regions meet weights in the dtype they are stored in,
as under Apex), so they run without autocast.

Note [Recurrent layers at O1, as Apex]: Dynamo does not trace nn.RNN/GRU/LSTM, so they are eager
regions, and autocast alone gives them the device's rule, not Apex's: on CUDA cuDNN's autocast
runs them in fp16, on CPU nn.RNN and nn.LSTM (oneDNN) run in bf16 but nn.GRU in fp32. Apex ran
every recurrent layer in fp16: input, hidden state and weights cast (Apex's `amp.rnn_compat`),
outputs 16-bit, gradients back to the fp32 weights through the casts. At O1 a model with such
modules is called under `RecurrentCasts` as well, a torch function mode that does exactly that
for the functions the modules call (`RECURRENT_FUNCTIONS`, packed sequences included) and passes
every other call through unchanged; Dynamo traces the mode (it adds no graph break: the module
call is one already). Only models with untraced recurrent modules get the mode.
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
