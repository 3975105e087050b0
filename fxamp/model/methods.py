"""Methods of a model compiled with its call (`CompileSettings.methods`): Lightning's steps.

Design (docs/design.md): Note [Methods compiled with the model].
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import torch

from fxamp.errors import ConfigError
from fxamp.model.compiled_call import CompiledCall

__all__ = ["check_methods", "compile_methods"]


def compile_methods(model: torch.nn.Module, methods: tuple[str, ...],
                    entry: Callable[[str], CompiledCall], undo: contextlib.ExitStack) -> None:
    """Make each of `methods` an attribute of the instance that runs it compiled (`entry`), as
    Note [Methods compiled with the model] says; each registers its undo on `undo`."""
    for method in methods:
        before = model.__dict__.get(method)  # none, or the method itself (check_methods)
        model.__dict__[method] = _as_method(entry(method), getattr(type(model), method))
        undo.callback(_put_back, model, method, before)


def check_methods(model: torch.nn.Module, methods: tuple[str, ...]) -> None:
    """Refuse `methods` (CompileSettings.methods) that `model` cannot have compiled with its
    call: not a method of its class, or hidden by an attribute of the instance. Changes
    nothing."""
    for name in methods:
        if name == "forward" or not inspect.isfunction(getattr(type(model), name, None)):
            raise ConfigError(f"methods: {name!r} is not a method of {type(model).__name__} "
                              "(its call, forward, is always compiled)")
        if name in model.__dict__ and not _is_own_method(model, name):
            raise ConfigError(
                f"{type(model).__name__}.{name} is replaced on the instance by a "
                f"{type(model.__dict__[name]).__name__} (a torch.compile wrapper?), so fxamp "
                f"could not compile the class's {name}: pass the model without it")


def _is_own_method(model: torch.nn.Module, name: str) -> bool:
    # The class's own method bound to the instance (what lightning's to_uncompiled leaves).
    value = model.__dict__[name]
    return (inspect.ismethod(value) and value.__self__ is model
            and value.__func__ is getattr(type(model), name))


def _put_back(model: torch.nn.Module, name: str, before: Any) -> None:
    if before is None:
        model.__dict__.pop(name, None)
    else:
        model.__dict__[name] = before


def _as_method(entry: CompiledCall, function: Callable[..., Any]) -> CompiledCall:
    # Reads as the method it replaces: its name and docs, and the signature of the function
    # (what inspect.getfullargspec gives for a bound method: self included), which trainers
    # inspect for optional arguments (Lightning's dataloader_idx).
    functools.update_wrapper(entry, function)
    entry.__signature__ = inspect.signature(function)
    return entry
