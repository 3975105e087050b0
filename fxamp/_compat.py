"""Every private torch API fxamp uses, in one place, gated by torch version where they differ.

fxamp supports torch 2.11 to 2.14 (pyproject.toml). Whatever fxamp needs from torch that is not
public API (`torch._dynamo`, `torch._inductor`, `torch._functorch`, `torch._subclasses`,
`torch._guards`, `torch.utils._pytree`, private attributes of modules and of DDP, the metadata
keys AOTAutograd writes on nodes, Dynamo's caching behaviour) is reached through this module,
so that a torch release that moves one of them is fixed here and nowhere else.

Each entry says which torch versions it was checked on. "2.11.0, 2.13.0, 2.14.1" means the
same spelling works on all three (the CI legs, .ci/run); a version-gated entry names the
versions each branch was checked on.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

# Checked on 2.11.0, 2.13.0, 2.14.1 (all imports below: same module paths on all three).
import torch._dynamo.exc as _dynamo_exc
import torch.utils._pytree as pytree  # noqa: F401  (re-exported: tree_map, tree_leaves, ...)
from torch._dynamo.utils import counters as dynamo_counters  # noqa: F401
from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401
from torch._guards import detect_fake_mode  # noqa: F401
from torch._ops import OpOverload  # noqa: F401
from torch._subclasses import FakeTensor, FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

__all__ = [
    "TORCH_VERSION", "pytree", "dynamo_counters", "make_boxed_func", "detect_fake_mode",
    "OpOverload", "FakeTensor", "FakeTensorMode", "make_fx", "TorchDispatchMode",
    "BackendCompilerFailed", "Unsupported", "UserError", "compile_fx", "list_mode_options",
    "inductor_config_keys", "aot_eager", "aot_autograd", "without_donated_buffers",
    "compile_fresh", "ENTER_AUTOCAST", "EXIT_AUTOCAST", "NORM_MODULE_TYPES", "call_impl",
    "set_compiled_call", "COMPILED_CALL_ATTR", "own_tensors", "rename_node", "SEQ_NR",
    "FWD_NN_MODULE_STACK", "PARTITIONER_TAG", "EXAMPLE_VALUE", "from_node_names",
    "active_ddp_module", "ddp_bucket_dtypes", "functional_all_reduce", "foreach_add_",
    "foreach_copy_", "unscale_and_check_", "HigherOrderOperator", "SET_GRAD_ENABLED",
    "GET_DATA_ATTR", "make_fx_tracer",
    "retrace_subgraph", "emit_call", "dynamo_traces_rnns", "compile_time_metrics", "compile_cache_counters",
    "scaled_mm", "scaled_mm_refusal", "size_rule_holds", "python_dispatcher",
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])

# ------------------------------------------------------------------ Dynamo and the compilers
# Checked on 2.11.0, 2.13.0, 2.14.1.
BackendCompilerFailed = _dynamo_exc.BackendCompilerFailed
Unsupported = _dynamo_exc.Unsupported
UserError = _dynamo_exc.UserError  # e.g. a data-dependent branch under fullgraph=True


def compile_fx(gm: fx.GraphModule, example_inputs: Any, *, config_patches: Optional[dict] = None):
    """Inductor's compiler entry point (what `torch.compile(backend="inductor")` calls).

    Imported when first used: Inductor takes seconds to import. Checked on 2.11.0, 2.13.0,
    2.14.1.
    """
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, config_patches=config_patches)


def list_mode_options(mode: str) -> dict[str, Any]:
    """Inductor's config patches for a `torch.compile(mode=...)`. Checked on 2.11.0, 2.13.0,
    2.14.1."""
    from torch._inductor import list_mode_options as inductor_mode_options

    return inductor_mode_options(mode)


def inductor_config_keys() -> frozenset[str]:
    """The names `torch.compile(options=...)` accepts (Inductor's config, dotted names
    included). Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor import config as inductor_config

    return frozenset(inductor_config.get_config_copy())


# Inductor's store-versus-recompute thresholds (a pointwise value with several users and more
# reads or ops than these is written to a buffer). Names differ by version: 2.11.0 has the first
# three; 2.13.0 adds the CPU ones; 2.14.1 adds realize_opusers_threshold. Checked on all three.
_REALIZE_THRESHOLDS = ("realize_reads_threshold", "realize_opcount_threshold",
                       "realize_acc_reads_threshold", "realize_cpu_opcount_threshold",
                       "realize_cpu_acc_reads_threshold", "realize_opusers_threshold")


def recompute_pointwise_options() -> dict[str, int]:
    """`torch.compile(options=...)` that let Inductor recompute a pointwise value in each
    consumer instead of writing it to memory (Note [A codec the CPU runs fast] in
    fxamp/optim/functional/codecs.py), with the threshold names this torch has."""
    keys = inductor_config_keys()
    return {name: 1 << 30 for name in _REALIZE_THRESHOLDS if name in keys}


def run_and_get_code(fn: Callable, *args: Any) -> tuple[Any, list[str]]:
    """fn(*args) and the source of every module Inductor generated meanwhile (tests read it).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor.utils import run_and_get_code as inductor_run_and_get_code

    return inductor_run_and_get_code(fn, *args)


def aot_eager(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any):
    """Dynamo's "aot_eager" backend (AOTAutograd, no Inductor); takes fw_/bw_compiler.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._dynamo.backends.debugging import aot_eager as dynamo_aot_eager

    return dynamo_aot_eager(gm, example_inputs, **kwargs)


def aot_autograd(**kwargs: Any) -> Callable:
    """A Dynamo backend running AOTAutograd with the given fw_/bw_compiler. Checked on 2.11.0,
    2.13.0, 2.14.1."""
    from torch._dynamo.backends.common import aot_autograd as dynamo_aot_autograd

    return dynamo_aot_autograd(**kwargs)


def without_donated_buffers(compile_fn: Callable, gm: fx.GraphModule,
                            example_inputs: Any) -> Callable:
    """`compile_fn(gm, example_inputs)` with AOTAutograd's donated buffers off for this graph,
    so that its backward may run more than once (`retain_graph=True`, `create_graph=True`).

    `torch._functorch.config.donated_buffer` is read twice: when the graph is partitioned
    (saved activations that alias no input or output are marked donated, and Inductor's
    backward may overwrite them) and again when the backward runs (a backward that keeps its
    graph is refused if any are marked). Patching the flag for the compile alone leaves the
    marks unset (None), which the runtime check reads as "marked"; so the metadata this compile
    left on the tracing context is given an explicit empty list as well. On an AOTAutograd cache
    hit the context holds no metadata: the cached entry was saved with the empty list. Checked on
    2.13.0 (aot_eager and Inductor, cold and warm cache).
    """
    import torch._functorch.config as functorch_config
    from torch._guards import TracingContext

    with functorch_config.patch(donated_buffer=False):
        compiled = compile_fn(gm, example_inputs)
    context = TracingContext.try_get()
    metadata = None if context is None else context.fw_metadata
    if metadata is not None:
        metadata.bw_donated_idxs = []
    return compiled


def compile_fresh(fn: Callable, **compile_kwargs: Any) -> Callable:
    """`torch.compile(fn, **compile_kwargs)` with a Dynamo cache of its own.

    Dynamo keeps its compiled entries, and counts them against its recompile limit (8 by
    default), per code object, and closures or repeated `torch.compile` calls of one function
    share its code object. A copy of the code object (equal, not identical) starts an empty
    cache that dies with the returned function. Checked on 2.11.0, 2.13.0, 2.14.1
    (tests/test_compat.py: twelve copies each take a graph of their own, one function taking
    the same twelve graphs hits the limit). See Note [One compiled step per optimizer] in
    fxamp/optim/functional/fused_step.py.
    """
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return torch.compile(copy, **compile_kwargs)


# -------------------------------------------------------------------- modules and autocast
# The targets pre-dispatch tracing records for `with torch.autocast(...)` regions.
# Checked on 2.11.0, 2.13.0, 2.14.1.
ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast

# Base classes of BatchNorm1d/2d/3d (and SyncBatchNorm) and InstanceNorm1d/2d/3d.
# Checked on 2.11.0, 2.13.0, 2.14.1.
NORM_MODULE_TYPES = (torch.nn.modules.batchnorm._BatchNorm,
                     torch.nn.modules.instancenorm._InstanceNorm)

# The slot `nn.Module.compile` fills and `nn.Module.__call__` runs instead of `_call_impl`
# (hooks included). Checked on 2.11.0, 2.13.0, 2.14.1.
COMPILED_CALL_ATTR = "_compiled_call_impl"


def fsdp_module_class() -> Optional[type]:
    """FSDP2's `FSDPModule` (every `fully_shard`-ed module is one), or None without
    torch.distributed. Checked on 2.11.0, 2.13.0, 2.14.1."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def unsharded_class(cls: Any) -> Any:
    """The class `fully_shard` derived `cls` from (it swaps a module's class for a new
    `FSDP<Name>(FSDPModule, <Name>)`), or `cls` itself. Checked on 2.11.0, 2.13.0, 2.14.1."""
    fsdp = fsdp_module_class()
    if fsdp is None or not isinstance(cls, type) or cls is fsdp or not issubclass(cls, fsdp):
        return cls
    return next((base for base in cls.__bases__ if base is not fsdp), cls)


def call_impl(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)` with its hooks but without its compiled call (which would call
    back into the caller). Checked on 2.11.0, 2.13.0, 2.14.1."""
    return module._call_impl(*args, **kwargs)


def set_compiled_call(module: torch.nn.Module, fn: Callable) -> None:
    """Make `module(...)` run `fn`, as `module.compile()` makes it run its compiled forward.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    setattr(module, COMPILED_CALL_ATTR, fn)


def own_tensors(module: torch.nn.Module) -> list[Optional[torch.Tensor]]:
    """The module's own (not its children's) parameters and buffers, None entries included.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    return list(module._parameters.values()) + list(module._buffers.values())


def rename_node(node: fx.Node, candidate: str) -> str:
    """Rename a placeholder to `candidate` (made unique in its graph); returns the new name.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    return node._rename(candidate) or node.name


# ------------------------------------------------------------------------ node metadata keys
# What AOTAutograd and the partitioner write on the nodes they derive: the autograd sequence
# number shared by a forward node and the backward nodes derived from it, the forward's module
# stack copied onto backward nodes, and the forward/backward tag. Checked on 2.11.0, 2.13.0,
# 2.14.1.
SEQ_NR = "seq_nr"
FWD_NN_MODULE_STACK = "fwd_nn_module_stack"
PARTITIONER_TAG = "partitioner_tag"
# The fake value Dynamo records on its graph's placeholders. Checked on 2.11.0, 2.13.0, 2.14.1.
EXAMPLE_VALUE = "example_value"


def from_node_names(node: fx.Node) -> list[str]:
    """Names of the nodes `node` was traced from (`meta["from_node"]`).

    A list of `NodeSource` objects with a `.name` on 2.11.0, 2.13.0, 2.14.1.
    """
    return [source.name for source in node.meta.get("from_node") or ()]


# ------------------------------------------------------------------------------ distributed
def active_ddp_module() -> Optional[torch.nn.Module]:
    """The DistributedDataParallel whose forward Dynamo is tracing now, if any.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    getter = getattr(ddp_type, "_get_active_ddp_module", None)
    return None if getter is None else getter()


def ddp_bucket_dtypes(ddp: torch.nn.Module) -> Optional[set[torch.dtype]]:
    """The dtypes DDP's reducer reduces gradients in (None before it has buckets).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_get_zeros_like_grad_buckets"):
        return None
    return {b.buffer().dtype for b in reducer._get_zeros_like_grad_buckets()}


def functional_all_reduce(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """An all-reduce Dynamo traces into the graph (no host sync, no in-place collective).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch.distributed._functional_collectives import all_reduce

    return all_reduce(tensor, op, group)


# ----------------------------------------------------------------------------- foreach ops
# One kernel per list instead of one per tensor. Checked on 2.11.0, 2.13.0, 2.14.1.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_
# GradScaler's own unscale kernel: grads *= inv_scale in place, found_inf (a 1-element float
# tensor) set to 1 if any is inf/nan; tensors on one device. Checked on 2.11.0, 2.13.0, 2.14.1.
unscale_and_check_ = torch._amp_foreach_non_finite_check_and_unscale_


# ------------------------------------------------------------------------- higher-order ops
# What fxamp needs to keep Dynamo's higher-order ops (autograd_function_apply,
# tag_activation_checkpoint, register_hook) as nodes while it re-traces a graph to ATen; see
# Note [Higher-order ops keep their bodies] in fxamp/passes/hops.py. The same spelling works
# on 2.11.0, 2.13.0, 2.14.1 (2.11 has no register_hook op: Dynamo traces Tensor.register_hook
# in forward as an autograd_function_apply there). Checked on 2.11.0, 2.13.0, 2.14.1.
from torch._ops import HigherOrderOperator  # noqa: E402

SET_GRAD_ENABLED = torch._C._set_grad_enabled
# What Dynamo records for `tensor.data` (an alias without autograd history or a shared version
# counter). Pre-dispatch make_fx does not track its result (it would bake the traced value into
# the graph as a constant), so capture.py records the call itself. Checked on 2.13.0.
GET_DATA_ATTR = torch._C._autograd._get_data_attr


def storage_key(tensor: torch.Tensor) -> Any:
    """A hashable key equal for tensors that share storage (fake tensors included); None for
    tensors without a dense storage of their own (sparse, DTensor and other subclasses)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if tensor.layout != torch.strided or is_traceable_wrapper_subclass(tensor):
        return None
    return StorageWeakRef(tensor.untyped_storage())


def make_fx_tracer() -> Any:
    """The tracer of the make_fx session in progress (pre-dispatch included)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode().tracer


def retrace_subgraph(fn: Callable, *args: Any) -> fx.GraphModule:
    """Trace `fn(*args)` into a graph of its own inside the make_fx session in progress, with
    that session's settings (pre-dispatch, fake mode), as torch's own higher-order ops do."""
    from torch._higher_order_ops.utils import reenter_make_fx

    return reenter_make_fx(fn)(*args)


def emit_call(target: Callable, args: tuple, kwargs: dict, outputs: Any) -> Any:
    """Record `target(*args, **kwargs)` as one node of the make_fx session in progress, whose
    value is `outputs` (fake tensors); GraphModule arguments become submodules of the traced
    graph. How torch's own higher-order ops record themselves in pre-dispatch tracing."""
    from torch.fx.experimental.proxy_tensor import track_tensor_tree

    tracer = make_fx_tracer()
    for arg in args:
        if isinstance(arg, fx.GraphModule):
            tracer.root.register_module(tracer.get_fresh_qualname("fxamp_body"), arg)
    proxy_args, proxy_kwargs = pytree.tree_map(tracer.unwrap_proxy, (args, kwargs))
    proxy = tracer.create_proxy("call_function", target, proxy_args, proxy_kwargs)
    return track_tensor_tree(outputs, proxy, constant=None, tracer=tracer)


def traced_record(tensor: torch.Tensor) -> Any:
    """What the make_fx session in progress records for `tensor` (its proxy), or None."""
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    return get_proxy_slot(tensor, make_fx_tracer(), None)


def record_node(record: Any) -> fx.Node:
    return record.proxy.node


def split_returned_input(tensor: torch.Tensor, before: Any) -> torch.Tensor:
    """`tensor`, returned by an op that took it, now records the op's node: bind that record
    to a new alias of `tensor` (made without a node) and return it; `tensor` gets `before`
    back (Note [One value per Dynamo node] in fxamp/passes/capture.py)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, set_proxy_slot

    tracer = make_fx_tracer()
    with disable_proxy_modes_tracing():
        alias = torch.ops.aten.alias.default(tensor)
    set_proxy_slot(alias, tracer, traced_record(tensor))
    set_proxy_slot(tensor, tracer, before)
    return alias


# ------------------------------------------------------------------ compile-time accounting
def compile_time_metrics() -> dict[str, list[float]]:
    """Seconds per call of each function torch times while compiling (`dynamo_timed`), by name
    (benchmarks/compile_breakdown.py). The names read there, `_compile.compile_inner`,
    `OutputGraph.call_user_compiler`, `create_aot_dispatcher_function`,
    `compile_fx.<locals>.bw_compiler` and `compile_fx_inner`, checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._dynamo.utils import compilation_time_metrics

    return compilation_time_metrics


_CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                   ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
                   ("aot_autograd", "autograd_cache_miss"),
                   ("aot_autograd", "autograd_cache_bypass"))


def compile_cache_counters() -> dict[str, int]:
    """Hits, misses and bypasses of Inductor's FX graph cache and AOTAutograd's cache so far in
    this process. Checked on 2.11.0, 2.13.0, 2.14.1."""
    return {name: dynamo_counters[group][name] for group, name in _CACHE_COUNTERS}


def dynamo_traces_rnns() -> bool:
    """Whether Dynamo traces nn.RNN/GRU/LSTM (`torch._dynamo.config.allow_rnn`, off by default:
    they run eagerly). Checked on 2.11.0, 2.13.0, 2.14.1."""
    import torch._dynamo.config as dynamo_config

    return bool(getattr(dynamo_config, "allow_rnn", False))


# ------------------------------------------------------------------------------- float8 GEMMs
def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
              scale_b: torch.Tensor, out_dtype: torch.dtype,
              use_fast_accum: bool = False) -> torch.Tensor:
    """`torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=...)`: a float8 GEMM whose result is
    `(a * scale_a) @ (b * scale_b)` (scales are the inverse of the cast's multipliers), `a`
    row-major and `b` column-major. The same spelling on 2.11.0, 2.13.0, 2.14.1 (public
    `torch.nn.functional.scaled_mm` exists there too, with a different scale vocabulary).
    On CPU: tensor scales on all three; row/column scales only from 2.13 (2.11: "only supports
    per-tensor scaling for CPU backend"), see `scaled_mm_refusal`."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def scaled_mm_refusal(device_type: str, rowwise: bool, out_dtype: torch.dtype) -> Optional[str]:
    """Why `scaled_mm` cannot run on `device_type` with these scales and output dtype (the
    error of a 16x16 probe), or None when it can. Asked once per config, before anything
    changes; the probe is a real call because support depends on the build and the GPU
    (CUDA needs compute capability 8.9+), not on the version alone."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        device = torch.device(device_type)
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        shape_a, shape_b = ((16, 1), (1, 16)) if rowwise else ((), ())
        scaled_mm(a, a.t(), scale_a=torch.ones(shape_a, device=device),
                  scale_b=torch.ones(shape_b, device=device), out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, TypeError, AssertionError) as e:
        return str(e).strip().splitlines()[0][:300]
    return None


def size_rule_holds(cond: Any) -> bool:
    """`cond`, a bool or a SymBool about sizes (`m % 16 == 0`), as a bool. A symbolic one is
    decided from the sizes being traced and guarded on, so a later size that decides it the
    other way recompiles; one about data-dependent (unbacked) sizes does not hold.
    `torch.fx.experimental.symbolic_shapes.guard_or_false`, checked on 2.13.0."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(cond)


def python_dispatcher() -> Any:
    """The context Dynamo and make_fx trace under: ops run their Python decompositions. A
    CompositeImplicit C++ kernel run on fake tensors with symbolic sizes may read a concrete
    size (on 2.11.0 `aten.linear` of a 3-d input reaches `matmul`'s `numel()`: "Cannot call
    numel() on tensor with symbolic sizes"); under it they decompose symbolically.
    `torch._dispatch.python.enable_python_dispatcher`, checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()
