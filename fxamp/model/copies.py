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

from typing import Callable

import torch

from fxamp._compat import COMPILED_CALL_ATTR

__all__ = ["make_copyable", "forget_copyable"]

_REDUCE = "__reduce_ex__"


class _Reducer:
    """The instance's `__reduce_ex__` (a class, not a closure, so that it pickles)."""

    def __init__(self, module: torch.nn.Module, rebuild: Callable[..., torch.nn.Module],
                 args: tuple, own: tuple[str, ...]):
        self.module, self.rebuild, self.args, self.own = module, rebuild, args, own

    def __call__(self, protocol: int) -> tuple:
        # nn.Module.__getstate__ leaves the compiled call out; a subclass's own (Lightning's
        # LightningModule) may not, and the copy compiles its own call anyway
        state = self.module.__getstate__()
        drop = {_REDUCE, COMPILED_CALL_ATTR, *self.own}
        state = {k: v for k, v in state.items() if k not in drop}
        return self.rebuild, (type(self.module), *self.args), state


def make_copyable(module: torch.nn.Module, rebuild: Callable[..., torch.nn.Module],
                  args: tuple, own: tuple[str, ...]) -> None:
    """Give `module` the `__reduce_ex__` of Note [Copies keep the compiled call]: a copy is
    `rebuild(type(module), *args)` (a module-level function, so that it pickles by name) with
    the original's state, without the attributes named in `own` (those `rebuild` makes for the
    copy itself: fxamp's marker, the compiled methods)."""
    module.__dict__[_REDUCE] = _Reducer(module, rebuild, args, own)


def forget_copyable(module: torch.nn.Module) -> None:
    """Undo `make_copyable` (a refused model goes back to what it was)."""
    module.__dict__.pop(_REDUCE, None)
