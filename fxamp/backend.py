"""The torch.compile backend that runs fxamp's passes (`fxamp.compile` is in model/entry.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx

from fxamp import _compat
from fxamp.arguments import check_compiler, compiler_name
from fxamp.model.compiled_call import check_storage
from fxamp.config import AmpConfig
from fxamp.model.double_backward import eager_autograd, first_order_only
from fxamp.model.eager_regions import without_autocast
from fxamp.errors import ConfigError
from fxamp.float8.config import check_float8_support
from fxamp.float8.delayed import history_of, is_delayed, keeps_state
from fxamp.passes import PassStats, run_passes
from fxamp.passes.capture import fake_inputs, to_aten
from fxamp.provenance import place_in_model
from fxamp.model.sharded_modules import check_not_sharded_since

__all__ = ["FxampBackend", "backend", "CompiledGraph", "Compiler"]

log = logging.getLogger(__name__)

Compiler = Union[str, Callable[[fx.GraphModule, Sequence[Any]], Callable]]


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
    if compiler == "aot_eager":
        return _compat.aot_eager
    if compiler == "eager":  # Note [Double backward runs the cast graph eagerly]
        return eager_autograd
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
    Two backends compare equal only when the graph part of their configs (`config.graph`) and
    their compiler settings are equal, so a changed policy never reuses a stale compiled
    graph, and a changed loss-scale setting never recompiles one.
    """

    def __init__(self, config: AmpConfig, *, compiler: Compiler = "inductor",
                 mode: Optional[str] = None, options: Optional[dict] = None,
                 module: Optional[tuple[str, type]] = None):
        check_compiler(compiler, mode, options)
        self.config = config
        compiler_key = compiler if isinstance(compiler, str) else id(compiler)
        self._key = (config.graph.cache_key(), compiler_key, mode,
                     tuple(sorted((options or {}).items())), module)
        # (path, class) of the submodule whose forward this backend compiles on its own
        # (Note [Sharded modules are compiled one by one]); None: the model or a function.
        self.module = module
        self._inner = _inner_compiler(compiler, mode, options)
        self.compile_args = {"compiler": compiler, "mode": mode, "options": options}
        self.compiled_graphs: list[CompiledGraph] = []
        # The model fxamp.compile prepared (set by prepare.compile_module): each compile checks that
        # its weights were not cast since (Dynamo recompiles when a parameter's dtype changes).
        self.model: Optional[torch.nn.Module] = None
        # Whether the model's first call found FSDP2-sharded modules (None: not called yet).
        self.sharded_at_first_call: Optional[bool] = None
        # The CompileSettings the model was prepared with (set by prepare.compile_module), so that
        # fxamp.model.recompile.recompile can prepare it again alike.
        self.settings: Any = None
        # Note [Graphs that hold a model's state]: the Float8History of the model, for delayed
        # float8 (set by prepare.compile_module before the model is compiled; a token of its
        # own for a copy, whose history comes with its state); None otherwise.
        self.owner: Optional[object] = None

    def for_module(self, path: str, module_type: type) -> "FxampBackend":
        """A backend for the forward of the submodule at `path`, recording its graphs with
        this one's and naming its modules as the model does."""
        unit = FxampBackend(self.config, **self.compile_args, module=(path, module_type))
        unit.compiled_graphs, unit.model, unit.owner = self.compiled_graphs, self.model, self.owner
        return unit

    def _float8_history(self, config: AmpConfig):
        if not keeps_state(config.float8):
            return None
        history = history_of(self.model)
        if history is None:
            raise ConfigError(_DELAYED_NEEDS_MODEL if is_delayed(config.float8)
                              else _SEED_NEEDS_MODEL)
        return history

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FxampBackend) and other._key == self._key
                and other.owner is self.owner)

    def __hash__(self) -> int:
        return hash((self._key, id(self.owner)))

    def __repr__(self) -> str:
        return f"FxampBackend({self.config.opt_level}, key={self._key[0]})"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        config = self.config
        if not config.is_resolved:
            config = config.resolve(config.device_type or _device_type(example_inputs))
        grad_enabled = torch.is_grad_enabled()  # the caller's: Dynamo guards on it
        check_float8_support(config.float8, config.device_type, config.dtype,
                             self.compile_args["compiler"])
        _check_active_ddp()
        if self.model is not None:
            check_storage(self.model, config)
            if self.module is None and self.sharded_at_first_call is False:
                check_not_sharded_since(self.model)
            # Note [Module paths in the model's terms]
            place_in_model(gm, {id(m): name for name, m in self.model.named_modules()},
                           self.module)
        fake_mode = _compat.detect_fake_mode(example_inputs) or _compat.FakeTensorMode()
        # Note [Eager regions run under autocast]: fxamp's graphs see only fxamp's policy.
        with torch.autocast(config.device_type, enabled=False):
            start = time.perf_counter()
            aten_gm = to_aten(gm, fake_inputs(gm, example_inputs, fake_mode), fake_mode)
            traced = time.perf_counter()
            stats = run_passes(aten_gm, config, fake_mode,
                               float8_history=self._float8_history(config),
                               grad_enabled=grad_enabled)
            self.compiled_graphs.append(CompiledGraph(aten_gm, stats, config, traced - start,
                                                      time.perf_counter() - traced))
            log.info("fxamp %s: graph %d, %s", config.opt_level, len(self.compiled_graphs), stats)
            return without_autocast(self._compile(aten_gm, example_inputs), config.device_type)

    def _compile(self, aten_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.compile_args["compiler"] == "eager":
            return self._inner(aten_gm, example_inputs)
        # Note [Graphs whose backward runs twice]
        compiled = _compat.without_donated_buffers(self._inner, aten_gm, example_inputs)
        return first_order_only(compiled, compiler_name(self.compile_args["compiler"]))


# Note [Graphs that hold a model's state]: Dynamo reuses a graph compiled by an equal backend
# (its backend guard compares backends with ==), so a second model of the same class prepared
# with the same config runs the first one's graphs without compiling (the graphs read the
# parameters as inputs). A delayed-float8 graph also holds its model's amax-history buffers: a
# second model (or a copy) reusing it would read and push the first one's histories. So a
# backend whose model keeps histories equals only a backend of the same histories (`owner`,
# compared by identity: a new model never matches a collected one's graphs; a copy, whose
# histories arrive with its state after its backend is made, owns a token of its own).


# Note [Graphs whose backward runs twice]: AOTAutograd marks a saved activation that aliases no
# graph input or output as donated (Inductor's backward may reuse its memory), and a graph with
# such marks refuses a backward that keeps the graph: `backward(retain_graph=True)` and a second
# backward over one forward (several losses sharing it) fail once the graph's backward was
# first compiled by an ordinary backward. Plain torch.compile rarely meets this on small models
# (a Linear saves its input and weight, which are graph inputs), but fxamp's casts make the
# saved tensors new values (the 16-bit copies of input and weight), so almost every fxamp graph
# would. fxamp compiles its graphs without donated buffers: retain_graph always works, at the
# cost of the backward memory Inductor's reuse of those buffers would save.


_DELAYED_NEEDS_MODEL = (
    "float8 scaling='delayed' keeps its amax histories in the model's state_dict, which a "
    "torch.compile backend does not own: use fxamp.compile(model, float8=Float8Config("
    "scaling='delayed')), or scaling='dynamic' with the backend")

_SEED_NEEDS_MODEL = (
    "float8 nvfp4_stochastic_rounding keeps the counter its noise is drawn from in the model's "
    "state_dict, which a torch.compile backend does not own: use fxamp.compile(model, "
    "float8=Float8Config(recipe='nvfp4', nvfp4_stochastic_rounding=True)), or "
    "nvfp4_stochastic_rounding=False with the backend")


def check_ddp_order(ddp: torch.nn.Module) -> None:
    """Raise if `ddp` (a DistributedDataParallel) was built before `fxamp.compile` changed its
    module's parameter dtypes; see docs/distributed.md, "Wrapping order".

    Raises:
        ConfigError: a parameter's dtype differs from the dtype DDP's buckets reduce in.
    """
    bucket_dtypes = _compat.ddp_bucket_dtypes(ddp)
    if bucket_dtypes is None:
        return
    param_dtypes = {p.dtype for p in ddp.module.parameters() if p.requires_grad}
    if param_dtypes - bucket_dtypes:
        raise ConfigError(
            f"DistributedDataParallel reduces gradients in {sorted(map(str, bucket_dtypes))} but "
            f"the model's parameters are now {sorted(map(str, param_dtypes))}: it was wrapped "
            "before fxamp.compile cast them. Call fxamp.compile(model) first, then "
            "DistributedDataParallel(model), then build the fxamp optimizer")


def _check_active_ddp() -> None:
    # Traced inside a DistributedDataParallel's forward: refuse a DDP built before fxamp.compile
    # cast the parameters (it would reduce in the old dtype and let the replicas drift).
    ddp = _compat.active_ddp_module()
    if ddp is not None:
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
    if getattr(overrides.get("float8"), "scaling", None) == "delayed":
        raise ConfigError(_DELAYED_NEEDS_MODEL)
    if getattr(overrides.get("float8"), "nvfp4_stochastic_rounding", False):
        raise ConfigError(_SEED_NEEDS_MODEL)
    if overrides.get("cast_model_outputs") is not None:
        raise ConfigError("cast_model_outputs applies at the model boundary, which a backend "
                          "does not see: use fxamp.compile(model, cast_model_outputs=...)")
    return FxampBackend(AmpConfig.from_opt_level(opt_level, **overrides), compiler=compiler,
                        mode=mode, options=options)


def registered_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                       mode: Optional[str] = None, options: Optional[dict] = None):
    """`torch.compile(model, backend="fxamp")`: O1 with the device defaults.

    Registered through the "torch_dynamo_backends" entry point in pyproject.toml; Inductor's
    `mode` and `options` pass through as torch.compile hands them to named backends.
    """
    return FxampBackend(AmpConfig.from_opt_level("O1"), mode=mode, options=options)(
        gm, example_inputs)
