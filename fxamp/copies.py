"""Copies of an fxamp-compiled model are fxamp-compiled models with the same config.

Note [Copies keep the compiled call]: `nn.Module.__getstate__` drops the compiled call
(`_compiled_call_impl`), so a `copy.deepcopy`, a pickle / `torch.save(model)` round trip or a
`torch.optim.swa_utils.AveragedModel` (which deep-copies) used to keep fxamp's weights and
marker but run eagerly: a dtype mismatch at O2, silent fp32 at O1. `copy` and `pickle` both
ask the object itself for `__reduce_ex__`, so fxamp.compile gives the model one: the copy is
rebuilt as a bare instance of the model's class, prepared like the original (its own
backend with the same config and compiler settings, compiled lazily at its first call), and
then gets the original's state as `nn.Module.__setstate__` would give it. Nothing global,
nothing patched: the reducer lives on the instance and travels with its copies.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

__all__ = ["CompileSettings", "make_copyable", "forget_copyable"]

_REDUCE = "__reduce_ex__"


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """What `compile_module` needs to prepare a copy exactly like the original."""

    config: Any  # the resolved AmpConfig
    compiler: Any
    mode: Optional[str]
    options: Optional[dict]
    dynamic: Optional[bool]
    fullgraph: bool


class _Reducer:
    """The instance's `__reduce_ex__` (a class, not a closure, so that it pickles)."""

    def __init__(self, module: torch.nn.Module, settings: CompileSettings, marker: str):
        self.module, self.settings, self.marker = module, settings, marker

    def __call__(self, protocol: int) -> tuple:
        state = self.module.__getstate__()  # already without the compiled call
        state = {k: v for k, v in state.items() if k not in (_REDUCE, self.marker)}
        return _rebuild, (type(self.module), self.settings), state


def _rebuild(cls: type, settings: CompileSettings) -> torch.nn.Module:
    from fxamp.backend import FxampBackend, compile_module  # backend imports this module

    module = cls.__new__(cls)
    backend = FxampBackend(settings.config, compiler=settings.compiler, mode=settings.mode,
                           options=settings.options)
    compile_module(module, backend, dynamic=settings.dynamic, fullgraph=settings.fullgraph)
    return module  # nn.Module.__setstate__ then adds the original's state


def make_copyable(module: torch.nn.Module, settings: CompileSettings, marker: str) -> None:
    """Give `module` the `__reduce_ex__` of Note [Copies keep the compiled call]."""
    module.__dict__[_REDUCE] = _Reducer(module, settings, marker)


def forget_copyable(module: torch.nn.Module) -> None:
    """Undo `make_copyable` (a refused model goes back to what it was)."""
    module.__dict__.pop(_REDUCE, None)
