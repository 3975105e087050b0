"""Capture: lower Dynamo's torch-level graph to the pre-dispatch ATen graph the passes edit.

Pre-dispatch tracing keeps the ops torch.autocast itself sees (aten.linear, aten.softmax.int,
aten.batch_norm), folds Dynamo's several spellings of one op into one overload, and leaves
autograd to run later, on the graph with casts (see Note [Why casts are inserted before
autograd] in insert_casts.py). Running Dynamo's graph through an Interpreter under
`preserve_node_meta` carries each node's stack trace and nn_module_stack onto the ATen nodes.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.overrides import TorchFunctionMode

from fxamp._compat import EXAMPLE_VALUE, OpOverload, make_fx, rename_node

from fxamp._compat import (GET_DATA_ATTR, SET_GRAD_ENABLED, emit_call, make_fx_tracer, pytree,
                           record_node, retrace_subgraph, split_returned_input, traced_record)
from fxamp.passes.aliasing import written_positions
from fxamp.passes.hops import HopSpec, body_inputs, hop_spec

__all__ = ["to_aten", "fake_inputs", "MixedOperandsMode", "TRAINABLE"]

TRAINABLE = "fxamp_trainable"  # meta key: a graph input that requires grad


def fake_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode) -> list[Any]:
    """Fake versions of a backend's example inputs (symbolic where Dynamo made them so)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fakes = []
    for node, value in zip(placeholders, example_inputs):
        example = node.meta.get(EXAMPLE_VALUE)
        if isinstance(value, torch.Tensor):
            fakes.append(fake_mode.from_tensor(value))
        else:
            fakes.append(example if example is not None else value)
    return fakes


class _Run(fx.Interpreter):
    """Runs a Dynamo graph (or a higher-order op's body) for make_fx.

    Note [tensor.data is traced as .data]: Dynamo records `t.data` as `_get_data_attr(t)`,
    whose result pre-dispatch tracing does not track: it would enter the graph as a constant
    holding the traced (fake) value, and fail at the next op ("Please convert all Tensors to
    FakeTensors first"; under Inductor "Cannot access data pointer"). So the call is recorded
    by hand, the node Dynamo had: AOTAutograd traces it as under plain torch.compile, and
    `compiler="eager"` runs it for real. Not `aten.detach`: a detached alias shares the version
    counter, `.data` does not, so a write through `.data` into a tensor saved for backward
    (`y = h * h; h.data.zero_()`) would fail autograd's check where eager PyTorch runs it.
    """

    def call_function(self, target, args, kwargs):
        if target is GET_DATA_ATTR:  # recorded by hand: make_fx does not track its result
            return emit_call(target, args, kwargs, target(*args, **kwargs))
        return _one_value_per_node(super().call_function, target, args, kwargs)

    def call_method(self, target, args, kwargs):
        return _one_value_per_node(super().call_method, target, args, kwargs)


class _Lower(_Run):
    """`_Run` whose higher-order ops in `HOPS` stay one node each."""

    def call_function(self, target, args, kwargs):
        spec = hop_spec(target)
        if spec is not None:
            return _trace_hop(target, spec, args, kwargs)
        with _mixed_operands_autocast(args, kwargs):
            return super().call_function(target, args, kwargs)


def _one_value_per_node(call, target, args: tuple, kwargs: dict) -> Any:
    """`call(target, args, kwargs)`, its value distinct from its inputs unless it wrote one.

    Note [One value per Dynamo node]: make_fx records one node per tensor object, and an op
    that returns its input object moves the input to the op's node. For an in-place op that
    is right: later reads of `h` after `h.add_(x)` read the `add_`. But `aten.to` returns its
    input when the dtype already matches, and the graph is traced in fp32: with `h` bf16 at O1,
    `h.float()` (inside torch.no_grad, to update a buffer) is a copy, yet every later read of
    `h` would read that copy, made without gradient (conformance pattern buffer_update). So a
    non-writing op that returns its input gets a value of its own, and the input keeps its
    node; the aliasing that `to` may have is still known from its schema (aliasing.py).
    """
    inputs = {id(t): traced_record(t) for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor)}
    out = call(target, args, kwargs)
    if not isinstance(out, torch.Tensor) or inputs.get(id(out)) is None:
        return out
    node = record_node(traced_record(out))
    if node is record_node(inputs[id(out)]) or (
            isinstance(node.target, OpOverload) and written_positions(node.target)):
        return out
    return split_returned_input(out, inputs[id(out)])


def _mixed_operands_autocast(args: tuple, kwargs: dict):
    """Autocast around one traced call whose floating operands mix a 16-bit dtype with fp32.

    Note [Mixed operands trace under autocast]: at O1 Dynamo traces the user's code under the
    level's autocast (Note [Eager regions run under autocast]), so a 16-bit activation may meet
    an fp32 weight in an op whose kernel insists on one dtype (`F.conv2d(x.half(), w)`: "Input
    type and bias type should be the same"). Pre-dispatch tracing records the op above
    autocast, so the graph is unchanged; only the fake value it computes takes autocast's
    dtype. The annotate pass then casts the operands per fxamp's policy and recomputes the
    value from the cast operands, so nothing downstream keeps autocast's choice.

    The same holds for autocast's "promote" ops (`torch_need_autocast_promote`: bilinear, dot,
    vdot, tensordot, scatter_add, ...), whose kernels refuse fp16 beside fp32 and which CUDA
    autocast runs in the widest dtype: traced here under CUDA autocast, they get a value, and
    the torch-cuda preset's promote rule casts them. Autocast is the one place that can do it
    for composite ops (tensordot checks its operands' dtypes before it decomposes, above any
    Python dispatch mode). The device's autocast decides only whether tracing can proceed; on
    CPU, whose autocast does not promote those ops, torch.autocast refuses such a program and
    so does fxamp. `transform` (fxamp.testing) traces under `MixedOperandsMode`, the same rule
    for a plain function: without it the CUDA autocast-list tests failed on what the backend
    traces (GPU report, H100, 2026-11-27).
    """
    dtypes = {t.dtype for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    low = dtypes & {torch.float16, torch.bfloat16}
    if len(dtypes) < 2 or len(low) != 1:
        return contextlib.nullcontext()
    device = next(t.device.type for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dtype in low)
    return _autocast_state(device, low.pop())


class MixedOperandsMode(TorchFunctionMode):
    """Each torch call traced under it gets `_mixed_operands_autocast`, as every node of a Dynamo
    graph does in `_Lower`: for tracing a plain function the way the backend traces a graph
    (fxamp.testing.transform; Note [Mixed operands trace under autocast])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with _mixed_operands_autocast(args, kwargs):
            return func(*args, **kwargs)


@contextlib.contextmanager
def _autocast_state(device: str, dtype: torch.dtype):
    # The thread-local switches, not `torch.autocast`: the tracer would record the latter as
    # the user's own autocast region (Note [The user's autocast wins] in annotate.py).
    before = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device, before[0])
        torch.set_autocast_dtype(device, before[1])


def _trace_hop(target, spec: HopSpec, args: tuple, kwargs: dict) -> Any:
    # Note [Higher-order ops keep their bodies] in hops.py. Emitted the way torch's own
    # pre-dispatch rules for higher-order ops do it: policy bodies are re-traced to ATen inside
    # the make_fx session in progress, registered on its root, and the op becomes one node.
    inputs = body_inputs(args)
    args = tuple(_retrace_body(a, inputs) if i in spec.policy_bodies else a
                 for i, a in enumerate(args))
    first = args[spec.policy_bodies[0]] if spec.policy_bodies else None
    out = spec.output(output_vals(first) if first else None, args)
    return emit_call(target, args, kwargs, out)


def _retrace_body(body: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    outer = make_fx_tracer().graph
    before = set(outer.nodes)
    with fx_traceback.preserve_node_meta():  # make_fx's subgraph tracing does not keep it on
        aten_body = retrace_subgraph(_Run(body).run, *inputs)
    # The grad-mode switches inside the body are recorded in the body and, through the
    # enclosing trace's torch-function mode, once more around the node: drop the copies.
    for node in [n for n in outer.nodes if n not in before]:
        if node.target is SET_GRAD_ENABLED and not node.users:
            outer.erase_node(node)
    # Selective checkpointing keeps its policy on the body (Dynamo puts it there).
    aten_body.meta.update({k: v for k, v in body.meta.items() if k not in aten_body.meta})
    return aten_body


def output_vals(gm: fx.GraphModule) -> Any:
    """The fake values `gm` returns, as its output node's `meta['val']`s."""
    output = gm.graph.output_node()
    return pytree.tree_map(lambda n: n.meta.get("val") if isinstance(n, fx.Node) else n,
                           output.args[0])


def to_aten(gm: fx.GraphModule, fakes: Sequence[Any], fake_mode) -> fx.GraphModule:
    """Re-trace `gm` to ATen with `pre_dispatch=True` under `fake_mode`, keeping node metadata.

    The higher-order ops in `fxamp.passes.hops.HOPS` stay nodes, with their forward bodies
    re-traced to ATen (Note [Higher-order ops keep their bodies]).
    """

    def run(*args):
        return _Lower(gm).run(*args)

    with fx_traceback.preserve_node_meta(), fake_mode:
        aten_gm = make_fx(run, pre_dispatch=True)(*fakes)
    sources = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for node, source, fake in zip(list(aten_gm.graph.find_nodes(op="placeholder")), sources,
                                  fakes):
        node.target = rename_node(node, readable_name(source))
        if isinstance(fake, torch.Tensor) and fake.requires_grad:
            node.meta[TRAINABLE] = True  # a parameter (the traced value has lost the flag)
    # Not recompiled: the code make_fx generated still runs (renaming its placeholders changes
    # no argument's position), and run_passes recompiles the graph it changes (a Python
    # compile of a GPT-2 graph is ~5 % of the re-trace).
    return aten_gm


_DYNAMO_NOISE = re.compile(r"(?<![^_])(modules|parameters|buffers)_")


def readable_name(dynamo_name: str) -> str:
    """'l_self_modules_fc_parameters_weight_' -> 'fc_weight', 'l_x_' -> 'x'."""
    name = re.sub(r"^l_(self_|model_)?", "", dynamo_name)
    name = _DYNAMO_NOISE.sub("", name).strip("_")
    return name or dynamo_name
