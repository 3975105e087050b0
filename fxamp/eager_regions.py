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
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from fxamp import _compat
from fxamp.config import AmpConfig
from fxamp.errors import EagerRegionWarning

__all__ = ["with_policy_autocast", "without_autocast", "untraced_modules", "warn_untraced"]


def with_policy_autocast(fn: Callable[..., Any], config: AmpConfig) -> Callable[..., Any]:
    """`fn` run under `torch.autocast(device, dtype)` at O1; `fn` itself at other levels."""
    if not config.patch_torch_functions:
        return fn
    device_type, dtype = config.device_type, config.dtype

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
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
        return f"torch.autocast({config.device_type!r}, dtype={config.dtype}), not fxamp's graphs"
    return f"no casts: its weights as stored ({config.opt_level} casts no ops)"


def warn_untraced(model: torch.nn.Module, config: AmpConfig) -> list[str]:
    """Warn once, at fxamp.compile, naming the modules that will run eagerly."""
    found = untraced_modules(model)
    if found:
        warnings.warn(
            f"fxamp {config.opt_level}: {', '.join(found)} not traced by Dynamo (RNN modules "
            f"run eagerly), so they run under {eager_policy(config)}; fxamp.explain() lists "
            "them. On CPU, nn.LSTM under bf16 autocast can fail inside oneDNN (a torch "
            "limitation, plain torch.autocast too): exclude it with a torch.autocast("
            "enabled=False) region in forward", EagerRegionWarning, stacklevel=3)
    return found
