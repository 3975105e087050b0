"""Compiling an fxamp-prepared model again, in place, with another config of the same storage.

Healing (fxamp/debug/heal.py) promotes a module to fp32 while the model trains: the optimizer
holds the model's parameters, so the new config must store every parameter and buffer in the
dtype it already has (at O1 nothing is cast; at O2/O3 a module overridden to fp32 would change
its weights' dtype under the optimizer, which is refused). Everything is checked before the
model changes; then the compiled call is replaced as `fxamp.compile` installs it, and the next
call compiles the graphs with the new config (the backend, whose identity is the config's
graph part, is part of Dynamo's cache key, so no stale graph is reused).
"""

from __future__ import annotations

import torch

from fxamp.model.cast_model import storage_dtype
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.policy.rules import check_module_overrides
from fxamp.model.prepare import backend_of, compile_module

__all__ = ["recompile"]


def recompile(model: torch.nn.Module, config: AmpConfig) -> AmpConfig:
    """Prepare `model`, already prepared by `fxamp.compile`, again with `config`, in place.

    Returns:
        The resolved config the model now runs with.

    Raises:
        ConfigError: the model was not prepared by fxamp.compile, a module override names no
            module, or `config` would store a parameter or buffer in another dtype; the model
            is then unchanged.
    """
    backend = backend_of(model)
    if backend is None or backend.settings is None:
        raise ConfigError(f"{type(model).__name__} was not prepared by fxamp.compile: compile "
                          "it first (fxamp.compile(model, ...)), then recompile it")
    old = backend.config
    check_module_overrides(model, config)
    new = config.resolve(old.device_type)
    for name, module in model.named_modules():
        before, after = storage_dtype(name, module, old), storage_dtype(name, module, new)
        if before != after:
            raise ConfigError(
                f"recompiling would store module {name or '<root>'!r} "
                f"({type(module).__name__}) in {after} instead of {before}, under the "
                f"optimizer that holds its parameters; only configs that keep every weight's "
                f"dtype can be applied to a prepared model ({old.opt_level} -> "
                f"{new.opt_level}; at O1 nothing is cast)")
    compile_module(model, backend.settings.backend(new), backend.settings)
    return new
