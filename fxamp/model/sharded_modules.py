"""FSDP2-sharded modules get fxamp's graphs too: their forwards are compiled on their own.

FSDP2's hooks are graph breaks, and Dynamo skips the frames of torch.nn modules and of loops over
sharded blocks, so at the model's first call (when the sharding is known) the forward of every
`fully_shard`-ed module, and of every module outside them that holds parameters of its own, is
compiled with the model's backend, each with a code object of its own and a backend that knows
its module path (`FxampBackend.for_module`).

Design (docs/design.md): Note [Sharded modules are compiled one by one].
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Optional

import torch

from fxamp import _compat
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.float8.delayed import is_delayed

__all__ = ["compile_sharded_modules", "modules_to_compile", "check_sharded",
           "check_not_sharded_since", "sharded_paths", "check_copyable"]


def sharded_paths(model: torch.nn.Module) -> list[str]:
    """The paths of `model`'s FSDP2-sharded modules ("<root>" for the model itself)."""
    fsdp = _compat.fsdp_module_class()
    return [] if fsdp is None else [name or "<root>" for name, m in model.named_modules()
                                    if isinstance(m, fsdp)]


def check_copyable(model: torch.nn.Module) -> None:
    """Refuse a private copy of a sharded model (explain and the debug tools run one): FSDP2
    refuses deepcopy with an AssertionError that names neither the tool nor the fix."""
    sharded = sharded_paths(model)
    if sharded:
        raise ConfigError(
            f"{', '.join(sharded)} of {_class_name(model)} sharded with fully_shard: "
            "fxamp.explain, locate_overflow and range_stats run a private copy of the model, "
            "and FSDP2 modules cannot be copied; call them on the model before fully_shard "
            "(its graphs name the same modules), or read "
            "fxamp.model.prepare.backend_of(model).compiled_graphs")


def modules_to_compile(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of what Note [Sharded modules are compiled one by one] compiles: empty
    unless `model` or some submodule is sharded with FSDP2 (the root's name is "")."""
    fsdp = _compat.fsdp_module_class()
    if fsdp is None:
        return []
    named = list(model.named_modules())
    sharded = [name for name, m in named if isinstance(m, fsdp)]
    if not sharded:
        return []

    def inside_sharded(name: str) -> bool:
        return any(name.startswith(s + ".") for s in sharded if s)

    return [(name, m) for name, m in named
            if isinstance(m, fsdp) or name and not inside_sharded(name)
            and any(True for _ in m.parameters(recurse=False))]


def check_sharded(targets: list[tuple[str, torch.nn.Module]], config: AmpConfig) -> None:
    """Refuse what fxamp cannot keep right under FSDP2 (asked at the first call, before anything
    is compiled; `targets`: `modules_to_compile(model)`): float8 delayed scaling, whose amax
    histories are buffers of the model that each rank would fill from its own inputs while a
    checkpoint keeps one rank's."""
    f8 = config.float8
    if not is_delayed(f8) or not targets:
        return
    raise ConfigError(
        "float8 scaling='delayed' under FSDP2: each rank would update the amax histories "
        "(buffers of the model, not sharded) from its own inputs, and a checkpoint keeps only "
        "one rank's, so a resumed run would not be the same run; use Float8Config("
        "scaling='dynamic') with fully_shard, or delayed scaling without it")


def check_not_sharded_since(model: torch.nn.Module) -> None:
    """Refuse a model sharded after its first call (which compiled no sharded modules): Dynamo
    recompiles it then (FSDP2 added hooks), and the sharded modules would run eagerly."""
    late = sharded_paths(model)
    if late:
        raise ConfigError(
            f"{', '.join(late)} of {_class_name(model)} sharded with fully_shard after the "
            "model's first call: fxamp compiles the forwards of sharded modules at the first "
            "call, so these would run eagerly, outside fxamp's graphs; call fully_shard "
            "before calling the model (docs/distributed.md, \"FSDP2\")")


class _CompiledForward(functools.partial):
    """The `forward` a compiled module gets: its compiled function with the module as first
    argument. A partial, not a Python `__call__`: that would be one frame of fxamp's own for
    every module, which Dynamo would compile as one code object. Copies and pickles get the
    class's own forward back (the copy's first call compiles again)."""

    def __reduce__(self) -> tuple:
        return _class_forward, self.args[:1]


def _class_name(model: torch.nn.Module) -> str:
    return _compat.unsharded_class(type(model)).__name__


def _class_forward(module: torch.nn.Module) -> Callable[..., Any]:
    return types.MethodType(type(module).forward, module)


def forward_code(model: torch.nn.Module, path: str, own: Optional[Callable[..., Any]], *,
                 prefix: str = "forward") -> Callable[..., Any]:
    """The function compiled for the module at `path`: its class's forward, or `own`, the
    forward set on the instance before (a hook library's wrapper), kept."""
    def forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if own is None:
            return type(module).forward(module, *args, **kwargs)
        return own(*args, **kwargs)

    name = f"{prefix}_{type(model).__name__}_{id(model):x}_{path.replace('.', '_')}"
    return types.FunctionType(forward.__code__.replace(co_name=name), forward.__globals__, name,
                              None, forward.__closure__)


def compile_sharded_modules(model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module]],
                            compile_fn: Callable[[Callable[..., Any], str, type],
                                                 Callable[..., Any]],
                            undo: contextlib.ExitStack) -> None:
    """Give each module of `targets` (`modules_to_compile(model)`) a forward compiled by
    `compile_fn(function, path, class)` (torch.compile with the model's backend for that
    module); what puts each module's forward back goes on `undo`."""
    for path, module in targets:
        before = module.__dict__.get("forward")
        own = None if isinstance(before, _CompiledForward) else before
        compiled = compile_fn(forward_code(model, path, own), path,
                              _compat.unsharded_class(type(module)))
        module.__dict__["forward"] = _CompiledForward(compiled, module)
        undo.callback(_restore_forward, module, before)


def _restore_forward(module: torch.nn.Module, before: Optional[Callable[..., Any]]) -> None:
    if before is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = before
