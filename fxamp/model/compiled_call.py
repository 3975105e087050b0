"""The call `fxamp.compile` installs on a model: the torch.compile'd forward, and what to do
when it fails (un-prepare at a refused first call; name a model cast after fxamp.compile).

# Note [Un-preparing a refused model]
`fxamp.compile` checks everything it can before touching the model, but some refusals can only
come from the graph: a banned op, batch_norm statistics in the wrong dtype, a graph break under
`fullgraph=True`. They surface at the first call, after the weights were cast. So until a first
call succeeds, the model keeps its original tensors (the cast's `CastRecord`), and a refusal at
that call puts everything back: the original tensors (bit-identical), the compiled call and
fxamp's marker. The user can then retry `fxamp.compile` with the fix that the
error names. Each change `fxamp.compile` makes registers its undo on one `contextlib.ExitStack`
(the sharded modules' compiled forwards join it at the first call), closed at a refusal and
dropped at the first success. The cost is the original tensors' memory between `fxamp.compile`
and the end of the first call (at O2, the fp32 weights next to their bf16 copies); they are
freed as soon as it succeeds. A failure is only examined when it happens: a call that succeeds
costs one Python method call more than the bare compiled function.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from fxamp._compat import BackendCompilerFailed, Unsupported, UserError
from fxamp.model.cast_model import CastRecord, storage_dtype
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError, FxampError

__all__ = ["CompiledCall", "FirstCall", "check_storage", "fxamp_error"]

# Failures of compilation itself (the user's model did not fail): retrying can fix them.
_COMPILE_FAILURES = (BackendCompilerFailed, Unsupported, UserError, FxampError, ConfigError)
_RESTORED = ("fxamp restored the model as it was before fxamp.compile (weights, dtypes, "
             "forward); fix the cause and call fxamp.compile on it again")


class FirstCall:
    """What the compiled entries of one prepared model (its call, and the methods compiled with
    it) share until one of them succeeds: what runs at the first call, and the undo of
    `fxamp.compile`'s changes (Note [Un-preparing a refused model])."""

    def __init__(self, model: torch.nn.Module, config: AmpConfig,
                 undo: Optional[contextlib.ExitStack], record: Optional[CastRecord],
                 first_call: Callable[[contextlib.ExitStack], None]) -> None:
        """`undo` holds what puts the model back at a refused first call (None: nothing to
        put back); `first_call(undo)` runs before it and registers its own changes there."""
        self._model, self._config = model, config
        self._undo, self._record = undo, record
        self._first_call: Optional[Callable[[contextlib.ExitStack], None]] = first_call

    def before(self) -> None:
        if self._first_call is not None:  # sharding comes after fxamp.compile: looked at
            first_call, self._first_call = self._first_call, None  # at the first call
            first_call(contextlib.ExitStack() if self._undo is None else self._undo)

    def succeeded(self) -> None:
        if self._undo is not None:  # the first call succeeded: nothing to undo any more
            self._undo.pop_all()
            self._undo = None
            self._record.release()

    def undo_before_first_call(self) -> bool:
        """Put the model back as it was before `fxamp.compile` (bit for bit) if no call has
        succeeded yet: for a refusal that comes after `fxamp.compile` but before the model
        runs (a trainer's check of its optimizers). Returns whether it did."""
        if self._undo is None:
            return False
        undo, self._undo = self._undo, None
        undo.close()
        return True

    def failed(self, error: Exception) -> None:
        """Raise what a failed call should raise instead of `error`, if anything."""
        try:
            check_storage(self._model, self._config)  # Dynamo may fail on a recast model
        except ConfigError as recast:                 # before the backend runs
            raise recast from error
        if self._undo is not None and isinstance(error, _COMPILE_FAILURES):
            self.undo_before_first_call()
            raise _unwrapped(error) from None
        own = fxamp_error(error)
        if own is not None and own is not error:
            raise own from None  # fxamp's own message, not Dynamo's wrapper around it


class CompiledCall:
    """`model._compiled_call_impl` as `fxamp.compile` sets it, or a method of the model compiled
    with it (`CompileSettings.methods`): a compiled function and the model's `FirstCall`."""

    def __init__(self, compiled: Callable[..., Any], first: FirstCall) -> None:
        self._compiled, self.first = compiled, first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            self.first.before()
            out = self._compiled(*args, **kwargs)
        except Exception as e:
            self.first.failed(e)
            raise
        self.first.succeeded()
        return out


def fxamp_error(error: BaseException) -> Optional[Exception]:
    """fxamp's own error behind `error`: `error` itself, or the one Dynamo wrapped in
    BackendCompilerFailed (what a backend raises reaches the caller wrapped); else None.
    The one place that unwraps Dynamo's errors."""
    if isinstance(error, BackendCompilerFailed):
        error = error.inner_exception
    return error if isinstance(error, (FxampError, ConfigError)) else None


def check_storage(model: torch.nn.Module, config: AmpConfig) -> None:
    """Refuse a model whose weights were cast after fxamp.compile (the backend calls this
    whenever Dynamo compiles, which it does when a parameter's dtype changes)."""
    recast = _recast_tensors(model, config)
    if recast:
        raise ConfigError(
            f"{recast} of {type(model).__name__} changed dtype after fxamp.compile stored it "
            f"for {config.opt_level} (model.float(), .half(), .to(dtype)); cast the model "
            "before fxamp.compile, or rebuild it and compile it again")


def _recast_tensors(model: torch.nn.Module, config: AmpConfig) -> Optional[str]:
    for name, module in model.named_modules():
        dtype = storage_dtype(name, module, config)
        if dtype is None:
            continue
        # Parameters only: a cast of the model casts them all, while a buffer that forward
        # reassigns may legitimately change dtype.
        for key, t in module.named_parameters(recurse=False):
            if t is not None and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
                where = f"{name}.{key}" if name else key
                return f"{where!r} (now {t.dtype}, stored as {dtype})"
    return None


def _unwrapped(error: BaseException) -> BaseException:
    error = fxamp_error(error) or error
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(_RESTORED)
    return error
