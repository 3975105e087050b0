"""The torch.compile backend that runs fxamp's passes, and `fxamp.compile` on top of it."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from fxamp import _compat
from fxamp.arguments import check_compile_flags, check_compiler, entry_config
from fxamp.cast_model import CastRecord, boundary_forward, cast_model
from fxamp.compiled_call import CompiledCall, check_storage
from fxamp.config import AmpConfig
from fxamp.copies import CompileSettings, forget_copyable, make_copyable
from fxamp.eager_regions import warn_untraced, with_policy_autocast, without_autocast
from fxamp.errors import ConfigError
from fxamp.float8.config import check_float8_support
from fxamp.float8.delayed import attach_history, detach_history, history_of
from fxamp.passes import PassStats, run_passes
from fxamp.passes.capture import fake_inputs, to_aten
from fxamp.rules import check_module_overrides, check_op_override_keys

__all__ = ["FxampBackend", "backend", "backend_of", "compile", "compile_module", "config_of",
           "CompiledGraph"]

log = logging.getLogger(__name__)

Compiler = Union[str, Callable[[fx.GraphModule, Sequence[Any]], Callable]]
_BACKEND_ATTR = "_fxamp_backend"


@dataclasses.dataclass(frozen=True)
class CompiledGraph:
    """One graph the backend transformed: the ATen graph after the passes, what they did, and
    the seconds fxamp's own stages took (the re-trace to ATen, the passes)."""

    graph_module: fx.GraphModule
    stats: PassStats
    config: AmpConfig
    trace_s: float = 0.0
    passes_s: float = 0.0


def _device_type(example_inputs: Sequence[Any]) -> str:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    floating = [t for t in tensors if t.is_floating_point()]
    return (floating or tensors)[0].device.type if tensors else "cpu"


def _inner_compiler(compiler: Compiler, mode: Optional[str], options: Optional[dict]):
    if callable(compiler):
        return compiler
    if compiler == "inductor":
        patches = {**(_compat.list_mode_options(mode) if mode else {}), **(options or {})}
        return lambda gm, inputs: _compat.compile_fx(gm, inputs, config_patches=patches or None)
    if compiler in ("aot_eager", "eager"):
        return _compat.aot_eager
    raise ConfigError(f"compiler={compiler!r} is not one of 'inductor', 'aot_eager' or a callable")


class FxampBackend:
    """A `torch.compile` backend: Dynamo graph -> ATen -> fxamp passes -> inner compiler.

    Args:
        config: the (possibly unresolved) AmpConfig; the device defaults are resolved from
            each graph's inputs.
        compiler: "inductor" (default), "aot_eager", or any backend callable.
        mode: an Inductor mode ("reduce-overhead", "max-autotune", ...).
        options: Inductor config patches, as `torch.compile(options=...)` takes them.

    Instances remember the graphs they transformed in `compiled_graphs` (for explain()).
    Two backends compare equal only when config and compiler settings are equal, so a
    changed policy never reuses a stale compiled graph.
    """

    def __init__(self, config: AmpConfig, *, compiler: Compiler = "inductor",
                 mode: Optional[str] = None, options: Optional[dict] = None):
        check_compiler(compiler, mode, options)
        check_op_override_keys(config)
        self.config = config
        self._key = (config.cache_key(), compiler if isinstance(compiler, str) else id(compiler),
                     mode, tuple(sorted((options or {}).items())))
        self._inner = _inner_compiler(compiler, mode, options)
        self.compile_args = {"compiler": compiler, "mode": mode, "options": options}
        self.compiled_graphs: list[CompiledGraph] = []
        # The model fxamp.compile prepared (set by compile_module): each compile checks that
        # its weights were not cast since (Dynamo recompiles when a parameter's dtype changes).
        self.model: Optional[torch.nn.Module] = None

    def _float8_history(self, config: AmpConfig):
        if config.float8 is None or config.float8.scaling != "delayed":
            return None
        history = history_of(self.model)
        if history is None:
            raise ConfigError(_DELAYED_NEEDS_MODEL)
        return history

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FxampBackend) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"FxampBackend({self.config.opt_level}, key={self._key[0]})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        config = self.config
        if not config.is_resolved:
            config = config.resolve(config.device_type or _device_type(example_inputs))
        check_float8_support(config.float8, config.device_type, config.dtype)
        _check_active_ddp()
        if self.model is not None:
            check_storage(self.model, config)
        fake_mode = _compat.detect_fake_mode(example_inputs) or _compat.FakeTensorMode()
        # Note [Eager regions run under autocast]: fxamp's graphs see only fxamp's policy.
        with torch.autocast(config.device_type, enabled=False):
            start = time.perf_counter()
            aten_gm = to_aten(gm, fake_inputs(gm, example_inputs, fake_mode), fake_mode)
            traced = time.perf_counter()
            stats = run_passes(aten_gm, config, fake_mode,
                               float8_history=self._float8_history(config))
            self.compiled_graphs.append(CompiledGraph(aten_gm, stats, config, traced - start,
                                                      time.perf_counter() - traced))
            log.info("fxamp %s: graph %d, %s", config.opt_level, len(self.compiled_graphs), stats)
            return without_autocast(self._inner(aten_gm, example_inputs), config.device_type)


_DELAYED_NEEDS_MODEL = (
    "float8 scaling='delayed' keeps its amax histories in the model's state_dict, which a "
    "torch.compile backend does not own: use fxamp.compile(model, float8=Float8Config("
    "scaling='delayed')), or scaling='dynamic' with the backend")


def _check_active_ddp() -> None:
    # Traced inside a DistributedDataParallel's forward: refuse a DDP built before fxamp.compile
    # cast the parameters (it would reduce in the old dtype and let the replicas drift).
    ddp = _compat.active_ddp_module()
    if ddp is not None:
        from fxamp.distributed import check_ddp_order

        check_ddp_order(ddp)


def backend(opt_level: str = "O1", *, compiler: Compiler = "inductor", mode: Optional[str] = None,
            options: Optional[dict] = None, **overrides: Any) -> FxampBackend:
    """A `torch.compile` backend applying an Apex opt level as graph passes.

    Example:
        >>> model = torch.compile(model, backend=fxamp.backend(opt_level="O1"))

    The backend casts ops and graph inputs; it cannot change how parameters are stored, so
    at O2/O3 fp32 parameters are cast at each use. `fxamp.compile` also stores them in the
    low dtype (the memory saving of O2/O3).

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        compiler, mode, options: see `FxampBackend`.
        **overrides: `AmpConfig.from_opt_level` keywords (dtype, keep_batchnorm_fp32,
            op_overrides, module_overrides, policy, cast_model_outputs, ...).
    """
    float8 = overrides.get("float8")
    if getattr(float8, "scaling", None) == "delayed":
        raise ConfigError(_DELAYED_NEEDS_MODEL)
    if overrides.get("cast_model_outputs") is not None:
        raise ConfigError("cast_model_outputs applies at the model boundary, which a backend "
                          "does not see: use fxamp.compile(model, cast_model_outputs=...)")
    return FxampBackend(AmpConfig.from_opt_level(opt_level, **overrides), compiler=compiler,
                        mode=mode, options=options)


def _check_model(model: Any) -> torch.device:
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"fxamp.compile takes an nn.Module, not {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError("model is already wrapped in DistributedDataParallel: call "
                          "fxamp.compile first and wrap the result in DDP afterwards")
    if backend_of(model) is not None:
        raise ConfigError("model was already prepared by fxamp.compile "
                          f"({backend_of(model).config.opt_level}); compile it once")
    tensors = list(model.parameters()) + list(model.buffers())
    floating = [t for t in tensors if t.is_floating_point()]
    if not floating:
        raise ConfigError(f"{type(model).__name__} has no floating-point parameters or buffers:"
                          " fxamp only changes floating-point computation")
    return floating[0].device


def compile(model: torch.nn.Module, *, opt_level: Optional[str] = None,
            config: Optional[AmpConfig] = None,
            enabled: bool = True, compiler: Compiler = "inductor", mode: Optional[str] = None,
            options: Optional[dict] = None, dynamic: Optional[bool] = None,
            fullgraph: bool = False, **overrides: Any) -> torch.nn.Module:
    """Apply an Apex opt level to `model` as compiler passes and compile it with Inductor.

    Like `apex.amp.initialize`, this prepares the model in place and returns it: at O0 the
    parameters are stored in fp32, at O2/O3 in the low dtype (O2 keeps BatchNorm, and any
    module overridden to fp32, in fp32), and `model.compile(backend=fxamp.backend(...))`
    makes every call run the transformed graph, with floating inputs cast to the model dtype
    and outputs to fp32 (or `cast_model_outputs`) at O0/O2/O3, as Apex did.

    Args:
        model: a module with floating-point parameters, not yet wrapped in DDP.
        opt_level: "O0", "O1", "O2" or "O3" (letter O); O1 unless given.
        config: a ready AmpConfig instead of opt_level + overrides.
        enabled: False returns `model` untouched.
        compiler, mode, options: the inner compiler and Inductor's mode / options.
        dynamic, fullgraph: passed to torch.compile.
        **overrides: `AmpConfig.from_opt_level` keywords: dtype, keep_batchnorm_fp32,
            cast_model_type, master_weights, loss_scale, cast_model_outputs, policy,
            op_overrides, module_overrides, ...

    Returns:
        The same module object, compiled.

    Raises:
        ConfigError: for a bad level, override, argument or model; the model is then left
            unchanged. A refusal at the first call (a banned op, say) restores the model as it
            was, so that it can be compiled again with the fix.
    """
    config = entry_config(config, opt_level, overrides, "fxamp.compile")
    check_compiler(compiler, mode, options)
    check_compile_flags(dynamic=dynamic, fullgraph=fullgraph, enabled=enabled)
    check_op_override_keys(config)
    if not enabled:
        return model
    device = _check_model(model)
    config = config.resolve(config.device_type or device.type)
    check_module_overrides(model, config)
    check_float8_support(config.float8, config.device_type, config.dtype)
    # Everything is checked: from here on the model changes (Note [Un-preparing a refused model]).
    record = cast_model(model, config)
    compile_module(model, FxampBackend(config, compiler=compiler, mode=mode, options=options),
                   dynamic=dynamic, fullgraph=fullgraph, record=record)
    warn_untraced(model, config)
    return model


def compile_module(model: torch.nn.Module, fxamp_backend: FxampBackend, *,
                   dynamic: Optional[bool] = None, fullgraph: bool = False,
                   record: Optional[CastRecord] = None) -> None:
    """Make every `model(...)` call run the fxamp-compiled graph, boundary casts included.

    fxamp fills the slot `nn.Module.compile` itself fills (`_compat.set_compiled_call`) with
    the model's call wrapped in its boundary casts (Note [Model-boundary casts]), at O1 under
    torch.autocast for the code Dynamo leaves eager (Note [Eager regions run under autocast]).
    With the `record` of the cast, a refusal at the first call restores the model.
    """
    # A copy being rebuilt (copies.py) is not initialised yet: it gets the original's history.
    initialised = "_buffers" in model.__dict__
    history_hook = attach_history(model, fxamp_backend.config.float8) if initialised else None
    forward = boundary_forward(model, fxamp_backend.config)
    compiled = with_policy_autocast(
        torch.compile(forward, backend=fxamp_backend, dynamic=dynamic, fullgraph=fullgraph),
        fxamp_backend.config)

    def unprepare() -> None:
        record.undo()
        if history_hook is not None:
            detach_history(model, history_hook)
        _compat.set_compiled_call(model, None)
        delattr(model, _BACKEND_ATTR)
        forget_copyable(model)

    fxamp_backend.model = model
    _compat.set_compiled_call(model, CompiledCall(model, compiled, fxamp_backend.config,
                                                  None if record is None else unprepare, record))
    setattr(model, _BACKEND_ATTR, fxamp_backend)
    settings = CompileSettings(fxamp_backend.config, **fxamp_backend.compile_args,
                               dynamic=dynamic, fullgraph=fullgraph)
    make_copyable(model, settings, _BACKEND_ATTR)  # Note [Copies keep the compiled call]


def backend_of(model: torch.nn.Module) -> Optional[FxampBackend]:
    """The FxampBackend `fxamp.compile` attached to `model` (its `compiled_graphs` show every
    graph it transformed), or None."""
    return getattr(model, _BACKEND_ATTR, None)


def config_of(model: torch.nn.Module) -> Optional[AmpConfig]:
    """The resolved AmpConfig `fxamp.compile` applied to `model`, or None."""
    backend = backend_of(model)
    return None if backend is None else backend.config


def registered_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                       mode: Optional[str] = None, options: Optional[dict] = None):
    """`torch.compile(model, backend="fxamp")`: O1 with the device defaults.

    Registered through the "torch_dynamo_backends" entry point in pyproject.toml; Inductor's
    `mode` and `options` pass through as torch.compile hands them to named backends.
    """
    return FxampBackend(AmpConfig.from_opt_level("O1"), mode=mode, options=options)(
        gm, example_inputs)
