"""A model's layers, compiled on their own as well (`CompileSettings.layers`): what a caller
outside the model (a Lightning step) calls directly, and what it calls that is not the model.

Design (docs/design.md): Note [A step calls the model's layers].
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

from fxamp.model.sharded_modules import _CompiledForward, forward_code

__all__ = ["split_children", "compile_layers", "holds_parameters", "LAYER_ENTRY"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def holds_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def split_children(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]],
                                                     list[tuple[str, torch.nn.Module]]]:
    """(layers, helpers) of `model`: its outermost submodules that hold parameters (a
    ModuleList or ModuleDict is looked into: it is never called), and those that hold none (a
    loss, a torchmetrics metric, a parameterless helper), which are not the model's."""
    layers: list[tuple[str, torch.nn.Module]] = []
    helpers: list[tuple[str, torch.nn.Module]] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if not holds_parameters(child):
                helpers.append((path, child))
            elif isinstance(child, _CONTAINERS):
                visit(f"{path}.", child)
            else:
                layers.append((path, child))

    visit("", model)
    return layers, helpers


# The attribute of a prepared model that compiles one of its layers: a copy's layers, rebuilt
# before the copy has its state, compile with the copy's (Note [Copies keep the compiled call]).
LAYER_ENTRY = "_fxamp_layer_entry"

LayerEntry = Callable[[Callable[..., Any], str, torch.nn.Module], Callable[..., Any]]


def compile_layers(model: torch.nn.Module, entry: LayerEntry,
                   undo: contextlib.ExitStack) -> None:
    """Give each layer of `model` (`split_children`) a forward that runs `entry(function, path,
    layer)` (its forward compiled with the model's backend, made at its first call) when called
    from eager code, and the layer's own forward when Dynamo traces it inside another of the
    model's graphs (the model's call: one graph, as before). What puts each forward back goes
    on `undo`."""
    for path, layer in split_children(model)[0]:
        before = layer.__dict__.get("forward")
        own = None if isinstance(before, (_CompiledForward, _LayerForward)) else before
        layer.__dict__["forward"] = _layer_forward(model, path, layer, entry, own)
        undo.callback(_restore_forward, layer, before)


class _LayerForward(functools.partial):
    """A layer's forward (`compile_layers`). A copy of the model gets one of its own, which
    compiles with the copy's backend (`LAYER_ENTRY`)."""

    def __reduce__(self) -> tuple:
        return _copied_forward, (self.args[0], *self.where)


def _copied_forward(layer: torch.nn.Module, model: torch.nn.Module,
                    path: str) -> _LayerForward:
    # The copy's model may not have its state yet: its entry is looked up at the first call.
    return _layer_forward(model, path, layer, lambda *a: model.__dict__[LAYER_ENTRY](*a), None)


def _layer_forward(model: torch.nn.Module, path: str, layer: torch.nn.Module,
                   entry: LayerEntry, own: Any) -> _LayerForward:
    compiled: list[Callable[..., Any]] = []

    def forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside the model's own graph: traced inline
            if own is None:
                return type(layer).forward(layer, *args, **kwargs)
            return own(*args, **kwargs)
        if not compiled:
            compiled.append(entry(forward_code(model, path, own, prefix="layer"), path,
                                  layer))
        return compiled[0](layer, *args, **kwargs)

    made = _LayerForward(forward, layer)
    made.where = (model, path)
    return made


def _restore_forward(layer: torch.nn.Module, before: Any) -> None:
    if before is None:
        layer.__dict__.pop("forward", None)
    else:
        layer.__dict__["forward"] = before
