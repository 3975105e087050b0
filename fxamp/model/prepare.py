"""Preparing a model for fxamp: the one place that checks, casts, compiles and attaches.

Every entry point goes through `prepare`: `fxamp.compile` and `fxamp.initialize` prepare the
user's model in place; `explain`, `locate_overflow`, `range_stats` and the CLI prepare a private
copy (or a function). `prepare` checks everything first (the model, the config against it, the
compiler settings) and only then changes anything (Note [Un-preparing a refused model] in
compiled_call.py covers refusals that only the first call can make). `backend_of` and
`config_of` are the one way to ask whether a model is prepared, and with what config.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Optional

import torch

from fxamp import _compat
from fxamp.arguments import check_compile_flags, entry_config
from fxamp.backend import Compiler, CompiledGraph, FxampBackend
from fxamp.model.cast_model import CastRecord, boundary_forward, cast_model, hook_outer_calls
from fxamp.model.compiled_call import CompiledCall, FirstCall, fxamp_error
from fxamp.config import AmpConfig
from fxamp.model.copies import forget_copyable, make_copyable
from fxamp.model.layers import LAYER_ENTRY, compile_layers, split_children
from fxamp.model.eager_regions import untraced_modules, warn_untraced, with_policy_autocast
from fxamp.model.methods import check_methods, compile_methods
from fxamp.errors import ConfigError
from fxamp.master_weights import guard_master_weights
from fxamp.policy import LOW_DTYPES
from fxamp.float8.config import check_float8_support
from fxamp.float8.delayed import attach_history, detach_history, history_of, keeps_state
from fxamp.policy.rules import check_module_overrides
from fxamp.model.sharded_modules import (check_copyable, check_sharded, compile_sharded_modules,
                                   modules_to_compile)

__all__ = ["prepare", "Prepared", "CompileSettings", "requested_config", "check_model",
           "backend_of", "config_of", "compile_module", "undo_before_first_call"]

_BACKEND_ATTR = "_fxamp_backend"


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How a prepared model is compiled (kept so that its copies are prepared alike).
    `methods`: methods of the model compiled with its call (Note [Methods compiled with the
    model]). `layers`: each outermost submodule that holds parameters is compiled on its own
    as well, for callers that call it directly, and those that hold none are left as they are
    (Note [A step calls the model's layers])."""

    compiler: Compiler = "inductor"
    mode: Optional[str] = None
    options: Optional[dict] = None
    dynamic: Optional[bool] = None
    fullgraph: bool = False
    methods: tuple[str, ...] = ()
    layers: bool = False

    def backend(self, config: AmpConfig) -> FxampBackend:
        return FxampBackend(config, compiler=self.compiler, mode=self.mode, options=self.options)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` made: `fn` runs it (the prepared module itself, or a compiled function);
    `backend` records every graph fxamp transformed for it."""

    fn: Callable[..., Any]
    backend: FxampBackend

    @property
    def graphs(self) -> list[CompiledGraph]:
        return self.backend.compiled_graphs

    @property
    def config(self) -> AmpConfig:
        """The config the graphs were transformed with (resolved once a graph compiled)."""
        return self.graphs[0].config if self.graphs else self.backend.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`; fxamp's own refusals come out as themselves, not wrapped in
        Dynamo's BackendCompilerFailed."""
        try:
            return self.fn(*args, **kwargs)
        except _compat.BackendCompilerFailed as e:
            own = fxamp_error(e)
            if own is None:
                raise
            raise own from None


def backend_of(model: torch.nn.Module) -> Optional[FxampBackend]:
    """The FxampBackend `fxamp.compile` attached to `model` (its `compiled_graphs` show every
    graph it transformed), or None."""
    return getattr(model, _BACKEND_ATTR, None)


def config_of(model: torch.nn.Module) -> Optional[AmpConfig]:
    """The resolved AmpConfig `fxamp.compile` applied to `model`, or None."""
    backend = backend_of(model)
    return None if backend is None else backend.config


def undo_before_first_call(model: torch.nn.Module) -> bool:
    """Put a model `fxamp.compile` prepared back as it was, bit for bit, if it has not run yet
    (`FirstCall.undo_before_first_call`); returns whether it did."""
    call = getattr(model, "_compiled_call_impl", None)
    return isinstance(call, CompiledCall) and call.first.undo_before_first_call()


def requested_config(config: Any, opt_level: Optional[str], overrides: dict[str, Any],
                     where: str) -> Optional[AmpConfig]:
    """The config an entry point was asked for, or None when it was asked for none."""
    if config is None and opt_level is None and not overrides:
        return None
    return entry_config(config, opt_level, overrides, where)


def check_model(model: Any, config: AmpConfig, compiler: Any = None) -> AmpConfig:
    """Refuse a model `fxamp.compile` cannot prepare with `config` (and `compiler`, where
    given); returns the config resolved for the model's device. Changes nothing."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxamp.compile takes an nn.Module, not {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError("model is already wrapped in DistributedDataParallel: call "
                          "fxamp.compile first and wrap the result in DDP afterwards")
    if backend_of(model) is not None:
        raise ConfigError("model was already prepared by fxamp.compile "
                          f"({config_of(model).opt_level}); compile it once")
    floating = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if not floating:
        raise ConfigError(f"{type(model).__name__} has no floating-point parameters or buffers:"
                          " fxamp only changes floating-point computation")
    check_module_overrides(model, config)
    if config.device_type is None and floating[0].device.type == "meta":
        raise ConfigError(
            f"{type(model).__name__} is on the meta device, and fxamp takes the compute device "
            "from the weights (it decides the 16-bit dtype and the op table): name it, e.g. "
            f"fxamp.compile(model, config=fxamp.AmpConfig.from_opt_level({config.opt_level!r}"
            ").resolve('cuda')), or materialise the model first (model.to_empty(device=...) "
            "and its initialisation)")
    resolved = config.resolve(config.device_type or floating[0].device.type)
    check_float8_support(resolved.float8, resolved.device_type, resolved.dtype, compiler)
    return resolved


def prepare(model_or_fn: Callable[..., Any], config: Optional[AmpConfig], *,
            settings: CompileSettings = CompileSettings(),
            in_place: bool = True) -> Prepared:
    """Prepare `model_or_fn` for fxamp: check everything, then cast and compile.

    A module is prepared in place (`fxamp.compile`) or, with `in_place=False`, as a private
    copy that leaves the caller's model alone (explain and the debug tools). A private copy of
    a module `fxamp.compile` already prepared keeps that module's config (its weights are cast
    for it); asking for another config then is refused. `config=None` means O1, or that config.
    A function is compiled with fxamp's backend (nothing to cast).

    Raises:
        ConfigError: for a bad model, config or setting; nothing was changed.
    """
    backend = settings.backend(config or AmpConfig.from_opt_level("O1"))  # checks settings
    check_compile_flags(dynamic=settings.dynamic, fullgraph=settings.fullgraph)
    if not isinstance(model_or_fn, torch.nn.Module) and not in_place:
        compiled = torch.compile(model_or_fn, backend=backend, dynamic=settings.dynamic,
                                 fullgraph=settings.fullgraph)
        return Prepared(compiled, backend)
    if not in_place:
        check_copyable(model_or_fn)
    existing = None if in_place else config_of(model_or_fn)
    if existing is None:
        resolved = check_model(model_or_fn, backend.config, settings.compiler)
        check_methods(model_or_fn, settings.methods)
        model = model_or_fn if in_place else copy.deepcopy(model_or_fn)
        # Everything is checked: from here on it changes. A loss or a metric is not the
        # model's (Note [A step calls the model's layers]).
        helpers = [p for p, _ in split_children(model)[1]] if settings.layers else []
        record = cast_model(model, resolved, leave=helpers)
    else:
        _check_no_request(config, existing)
        resolved, record = existing, None
        # a prepared copy (Note [Copies keep the compiled call])
        model = copy.deepcopy(model_or_fn)
    backend = settings.backend(resolved)
    compile_module(model, backend, settings, record=record if in_place else None,
                   guard_masters=in_place)
    if in_place:
        warn_untraced(model, resolved)
    return Prepared(model, backend)


def _check_no_request(config: Optional[AmpConfig], existing: AmpConfig) -> None:
    if config is not None:
        raise ConfigError(f"the model was prepared by fxamp.compile with "
                          f"{existing.opt_level}, whose config its weights are cast for; "
                          "pass no config, opt_level or overrides, or pass the uncompiled "
                          "model to try another config")


def compile_module(model: torch.nn.Module, fxamp_backend: FxampBackend,
                   settings: CompileSettings, *, record: Optional[CastRecord] = None,
                   guard_masters: bool = False) -> None:
    """Make every `model(...)` call (and every call of `settings.methods`) run the
    fxamp-compiled graph, boundary casts included.

    fxamp fills the slot `nn.Module.compile` itself fills (`_compat.set_compiled_call`) with
    the model's call wrapped in its boundary casts (Note [Model-boundary casts]), at O1 under
    torch.autocast for the code Dynamo leaves eager (Note [Eager regions run under autocast]).
    With the `record` of the cast, a refusal at the first call restores the model.
    `guard_masters`: the model (prepared in place, or a copy) warns when an optimizer without
    fp32 masters steps its 16-bit weights (Note [Where fxamp sees an optimizer step]).
    """
    # Note [Un-preparing a refused model]: each change registers its undo as it is made.
    undo = contextlib.ExitStack()
    if record is not None:
        undo.callback(record.undo)
    # A copy being rebuilt (copies.py) is not initialised yet: it gets the original's history.
    initialised = "_buffers" in model.__dict__
    history_hook = attach_history(model, fxamp_backend.config.float8) if initialised else None
    if history_hook is not None:
        undo.callback(detach_history, model, history_hook)
    if guard_masters and fxamp_backend.config.model_dtype in LOW_DTYPES:
        undo.callback(guard_master_weights(model, fxamp_backend.config.opt_level))
    # Note [Graphs that hold a model's state]; a copy gets its histories with its state, after
    # this: a token of its own until then (its graphs read them at their first trace).
    fxamp_backend.owner = history_of(model) or (
        object() if keeps_state(fxamp_backend.config.float8) else None)
    # A model whose graphs hold its state compiles them in a Dynamo cache region of its own,
    # so that other models' graphs count against no recompile limit of its frames.
    isolated = _compat.isolated_recompiles() if fxamp_backend.owner is not None else {}

    # Note [Sharded modules are compiled one by one]
    def first_call(undo: contextlib.ExitStack) -> None:
        targets = modules_to_compile(model)
        check_sharded(targets, fxamp_backend.config)
        fxamp_backend.sharded_at_first_call = bool(targets)
        compile_sharded_modules(model, targets, lambda fn, path, module_type: torch.compile(
            fn, backend=fxamp_backend.for_module(path, module_type), dynamic=settings.dynamic,
            fullgraph=settings.fullgraph, **isolated), undo)

    fxamp_backend.model, fxamp_backend.settings = model, settings
    first = FirstCall(model, fxamp_backend.config, None if record is None else undo, record,
                      first_call)

    def entry(method: Optional[str]) -> CompiledCall:
        function = boundary_forward(model, fxamp_backend.config, method)
        compiled = torch.compile(function, backend=fxamp_backend, dynamic=settings.dynamic,
                                 fullgraph=settings.fullgraph, **isolated)
        return CompiledCall(with_policy_autocast(compiled, fxamp_backend.config,
                                                 recurrent=recurrent), first)

    recurrent = _has_recurrent(model)
    _compat.set_compiled_call(model, entry(None))
    undo.callback(_compat.set_compiled_call, model, None)
    if record is not None:  # a copy's modules come with their hooks
        for handle in hook_outer_calls(model, fxamp_backend.config):
            undo.callback(handle.remove)
    compile_methods(model, settings.methods, entry, undo)

    def layer_entry(function: Callable[..., Any], path: str,
                    layer: torch.nn.Module) -> CompiledCall:
        compiled = torch.compile(function, backend=fxamp_backend.for_module(path, type(layer)),
                                 dynamic=settings.dynamic, fullgraph=settings.fullgraph,
                                 **isolated)
        return CompiledCall(with_policy_autocast(compiled, fxamp_backend.config,
                                                 recurrent=_has_recurrent(layer)), first)

    if settings.layers:  # Note [A step calls the model's layers]
        model.__dict__[LAYER_ENTRY] = layer_entry  # a copy's layers compile with it
        undo.callback(model.__dict__.pop, LAYER_ENTRY, None)
        if initialised:
            compile_layers(model, layer_entry, undo)
    setattr(model, _BACKEND_ATTR, fxamp_backend)
    undo.callback(delattr, model, _BACKEND_ATTR)
    # Note [Copies keep the compiled call]
    make_copyable(model, _rebuild_copy, (fxamp_backend.config, settings),
                  (_BACKEND_ATTR, LAYER_ENTRY, *settings.methods))
    undo.callback(forget_copyable, model)


def _has_recurrent(model: torch.nn.Module) -> Callable[[], bool]:
    """Whether `model` has recurrent modules Dynamo leaves eager, asked at the first call (a copy
    being rebuilt has no submodules yet when it is compiled)."""
    found: list[bool] = []

    def has() -> bool:
        if not found:
            found.append(bool(untraced_modules(model)))
        return found[0]

    return has


def _rebuild_copy(cls: type, config: AmpConfig, settings: CompileSettings) -> torch.nn.Module:
    module = cls.__new__(cls)
    compile_module(module, settings.backend(config), settings, guard_masters=True)
    return module  # nn.Module.__setstate__ then adds the original's state
