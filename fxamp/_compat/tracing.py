"""make_fx, fake tensors and the dispatcher: tracing sessions, higher-order ops, node metadata."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

# Checked on 2.11.0, 2.13.0, 2.14.1 (all imports below: same module paths on all three).
import torch.utils._pytree as pytree  # noqa: F401  (re-exported: tree_map, tree_leaves, ...)
from torch._guards import detect_fake_mode  # noqa: F401
from torch._ops import HigherOrderOperator, OpOverload  # noqa: F401
from torch._subclasses import FakeTensor, FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

# What AOTAutograd and the partitioner write on the nodes they derive: the autograd sequence
# number shared by a forward node and the backward nodes derived from it, the forward's module
# stack copied onto backward nodes, and the forward/backward tag. Checked on 2.11.0, 2.13.0,
# 2.14.1.
SEQ_NR = "seq_nr"
FWD_NN_MODULE_STACK = "fwd_nn_module_stack"
PARTITIONER_TAG = "partitioner_tag"
# The fake value Dynamo records on its graph's placeholders. Checked on 2.11.0, 2.13.0, 2.14.1.
EXAMPLE_VALUE = "example_value"


def rename_node(node: fx.Node, candidate: str) -> str:
    """Rename a placeholder to `candidate` (made unique in its graph); returns the new name.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    return node._rename(candidate) or node.name


def from_node_names(node: fx.Node) -> list[str]:
    """Names of the nodes `node` was traced from (`meta["from_node"]`).

    A list of `NodeSource` objects with a `.name` on 2.11.0, 2.13.0, 2.14.1.
    """
    return [source.name for source in node.meta.get("from_node") or ()]


# What fxamp needs to keep Dynamo's higher-order ops (autograd_function_apply,
# tag_activation_checkpoint, register_hook) as nodes while it re-traces a graph to ATen; see
# Note [Higher-order ops keep their bodies] in fxamp/passes/hops.py. The same spelling works
# on 2.11.0, 2.13.0, 2.14.1 (2.11 has no register_hook op: Dynamo traces Tensor.register_hook
# in forward as an autograd_function_apply there). Checked on 2.11.0, 2.13.0, 2.14.1.
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


def size_rule_holds(cond: Any) -> bool:
    """`cond`, a bool or a SymBool about sizes (`m % 16 == 0`), as a bool. A symbolic one is
    decided from the sizes being traced and guarded on, so a later size that decides it the
    other way recompiles; one about data-dependent (unbacked) sizes does not hold.
    `torch.fx.experimental.symbolic_shapes.guard_or_false`, checked on 2.13.0."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return guard_or_false(cond)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (fake) tensors have the same dtype, device, sizes, strides and storage
    offset, decided without adding a guard: a symbolic size not known to be equal counts as
    different. `torch.fx.experimental.symbolic_shapes.statically_known_true`, checked on
    2.11.0, 2.13.0, 2.14.1."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if a.dtype != b.dtype or a.device != b.device or a.dim() != b.dim():
        return False
    pairs = [*zip(a.shape, b.shape), *zip(a.stride(), b.stride()),
             (a.storage_offset(), b.storage_offset())]
    return all(x is y or statically_known_true(x == y) for x, y in pairs)


def size_hint(value: Any) -> Optional[int]:
    """An int size, or the value a symbolic one (SymInt) had in the example being traced;
    None when it has none (data-dependent). `SymInt.node.hint`, checked on 2.11.0, 2.13.0,
    2.14.1."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


def python_dispatcher() -> Any:
    """The context Dynamo and make_fx trace under: ops run their Python decompositions. A
    CompositeImplicit C++ kernel run on fake tensors with symbolic sizes may read a concrete
    size (on 2.11.0 `aten.linear` of a 3-d input reaches `matmul`'s `numel()`: "Cannot call
    numel() on tensor with symbolic sizes"); under it they decompose symbolically.
    `torch._dispatch.python.enable_python_dispatcher`, checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()
