"""Store a module's parameters and buffers in the dtype its opt level asks for (O0, O2, O3),
and cast what crosses the model boundary (see Note [Model-boundary casts]).

This is the one place fxamp changes a model outside a graph: O2/O3 save memory only if the
weights themselves are 16-bit, which no graph pass can do. Parameters keep their identity
(`param.data` is replaced), so optimizers built earlier still hold them.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Optional

import torch

from fxamp import _compat
from fxamp.config import AmpConfig
from fxamp.policy import LOW_DTYPES, CastPolicy
from fxamp.model.layers import holds_parameters
from fxamp.provenance import boundary_casts
from fxamp.policy.rules import match_module_override

__all__ = ["cast_model", "storage_dtype", "boundary_forward", "hook_outer_calls", "OuterCalls",
           "CastRecord"]

_BATCH_NORM = _compat.NORM_MODULE_TYPES


def storage_dtype(name: str, module: torch.nn.Module, config: AmpConfig) -> Optional[torch.dtype]:
    """dtype the module's own floating tensors are stored in, or None to leave them."""
    target = config.model_dtype
    if target in LOW_DTYPES:
        if isinstance(module, _BATCH_NORM) and config.keep_batchnorm_fp32:
            return torch.float32
        found = match_module_override(name, type(module).__name__, config)
        if found and found[1] == CastPolicy.FP32:
            return torch.float32
    return target


def _cast_floats(value: Any, dtype: torch.dtype, sources: tuple[torch.dtype, ...]) -> Any:
    # Plain recursion rather than pytree: Dynamo traces it without a graph break.
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype in sources else value
    # Containers keep their type: a named tuple stays one, and so does a dict subclass such as
    # transformers' ModelOutput (a dataclass built from keywords), so `outputs.logits` works.
    if isinstance(value, (list, tuple)):
        cast = [_cast_floats(v, dtype, sources) for v in value]
        if type(value) in (list, tuple):
            return type(value)(cast)
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        cast = {k: _cast_floats(v, dtype, sources) for k, v in value.items()}
        if type(value) is dict:
            return cast
        return type(value)(**cast) if dataclasses.is_dataclass(value) else type(value)(cast)
    return value


def boundary_forward(model: torch.nn.Module, config: AmpConfig,
                     method: Optional[str] = None) -> Callable[..., Any]:
    """`model`'s call (or its `method`: Note [Methods compiled with the model]) with Apex's
    model-boundary casts (`model_boundary="call"`; with "modules" the hooks of `OuterCalls`
    cast at the model's modules instead), as one function for torch.compile.

    Note [Model-boundary casts]: at O0/O2/O3 the weights change dtype before Dynamo traces the
    model, so an fp32 input would meet bf16 weights inside Dynamo's own tracing, before any
    graph pass runs. Like Apex, fxamp casts floating inputs to the model dtype on the way in
    and outputs to `config.output_dtype` on the way out (never fp64, never ints). Written as
    a function that calls the module, Dynamo traces the casts into the model's graph (module
    hooks on the top-level module would each become a graph of their own).
    """
    casts = config.model_boundary == "call"
    in_dtype = config.model_dtype if casts else None
    out_dtype = config.output_dtype if casts else None
    in_sources = _sources(in_dtype)
    out_sources = tuple(d for d in LOW_DTYPES if d != out_dtype)
    suffix = f"{type(model).__name__}_{id(model):x}"
    # The method's own code copied too: a graph break inside it makes it a frame of its own.
    function = None if method is None else _own_code(getattr(type(model), method), suffix)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if in_dtype is not None:
            with boundary_casts():  # Note [Boundary casts are tagged when traced]
                args, kwargs = _cast_floats((args, kwargs), in_dtype, in_sources)
        if function is None:
            output = _compat.call_impl(model, *args, **kwargs)
        else:
            output = function(model, *args, **kwargs)
        if out_dtype is None:
            return output
        with boundary_casts():
            return _cast_floats(output, out_dtype, out_sources)

    # Note [One code object per compiled model]: Dynamo caches compiled graphs per code object.
    # Closures share their code, so every model compiled by fxamp would pile its entries (and
    # its recompiles) onto one cache until Dynamo's recompile limit silently sent models back
    # to eager fp32. A copy of the code object gives each model its own cache; its own name
    # keeps Dynamo's automatic-dynamic memory (keyed by name and place) per model too, so one
    # model seeing several batch sizes does not make the next one compile with dynamic shapes.
    return _own_code(forward, suffix, f"{method or 'forward'}_{suffix}")


def _own_code(function: Callable[..., Any], suffix: str,
              name: Optional[str] = None) -> Callable[..., Any]:
    """`function` with a code object of its own, named `name` (its name and `suffix`)."""
    name = name or f"{function.__name__}_{suffix}"
    own = types.FunctionType(function.__code__.replace(co_name=name), function.__globals__,
                             name, function.__defaults__, function.__closure__)
    own.__kwdefaults__ = function.__kwdefaults__
    return own


def _sources(dtype: Optional[torch.dtype]) -> tuple[torch.dtype, ...]:
    return tuple(d for d in (torch.float32, *LOW_DTYPES) if d != dtype)


class OuterCalls:
    """Forward hooks on every module of a model compiled with methods (Note [Methods compiled
    with the model]): a module called from outside the model's modules (a step's
    `self.encoder(x)`, or the model itself) gets Apex's model-boundary casts, floating inputs
    to the model dtype and outputs to `config.output_dtype`; a call inside a module gets none.
    A class, so that a copy of the model gets its own (it holds the model: the copy's)."""

    def __init__(self, model: torch.nn.Module, config: AmpConfig) -> None:
        self.root, self.depth = model, 0
        self.root_counted: list[bool] = []  # per call of the root, innermost last
        self.in_dtype, self.out_dtype = config.model_dtype, config.output_dtype
        self.in_sources = _sources(self.in_dtype)
        self.out_sources = tuple(d for d in LOW_DTYPES if d != self.out_dtype)

    def enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if module is self.root:
            # Lightning's DDP/FSDP redirection calls a step through the model's call, with
            # the instance's forward set to it: that call is the step's, not a boundary.
            self.root_counted.append(not _redirected(module))
            if not self.root_counted[-1]:
                return None
        self.depth += 1
        if self.depth > 1 or self.in_dtype is None:
            return None
        with boundary_casts():
            return _cast_floats((args, kwargs), self.in_dtype, self.in_sources)

    def leave(self, module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if module is self.root and not self.root_counted.pop():
            return None
        self.depth -= 1
        if self.depth > 0 or self.out_dtype is None:
            return None
        with boundary_casts():
            return _cast_floats(output, self.out_dtype, self.out_sources)


def _redirected(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and getattr(forward, "__func__", None) is not type(module).forward


def hook_outer_calls(model: torch.nn.Module, config: AmpConfig) -> list[Any]:
    """Give every module of `model` the hooks of `OuterCalls` (none where `model_boundary` is
    "call", or at a level that casts no model boundary); returns their handles."""
    if config.model_boundary != "modules" or (config.model_dtype is None
                                              and config.output_dtype is None):
        return []
    calls, handles = OuterCalls(model, config), []
    # A module that holds no parameters (a loss, a metric) is not the model's: no boundary.
    for module in filter(holds_parameters, model.modules()):
        handles.append(module.register_forward_pre_hook(calls.enter, with_kwargs=True))
        handles.append(module.register_forward_hook(calls.leave, always_call=True))
    return handles


@dataclasses.dataclass
class CastRecord:
    """What `cast_model` changed, to put back exactly (Note [Un-preparing a refused model])."""

    originals: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its .data before the cast)

    def __len__(self) -> int:
        return len(self.originals)

    def undo(self) -> None:
        for tensor, data in self.originals:
            tensor.data = data
        self.release()

    def release(self) -> None:
        """Forget the originals (after the first successful call), freeing their memory."""
        self.originals = []


def cast_model(model: torch.nn.Module, config: AmpConfig,
               leave: tuple[str, ...] | list[str] = ()) -> CastRecord:
    """Cast floating (non-fp64) parameters and buffers in place, but those of the submodules
    at the paths `leave` and inside them (a step's loss and metrics); returns what changed.

    Note [The state dict is the live weights]: `model.state_dict()` is left as torch makes it,
    the stored tensors themselves (16-bit at O2/O3), so code that writes into its values in
    place (an EMA or SWA copy, weight averaging, a loader's `sd[k].copy_(...)`) changes the
    model, as in eager torch and in Apex's amp before its 2019 O2 state-dict hook. That hook
    (and fxamp's until issue 32) returned fp32 copies instead, which such writes never
    reached: an EMA of an O2 model never moved. The copies held no more than the 16-bit
    weights, so nothing is lost: `load_state_dict` casts a 16-bit checkpoint exactly into an
    fp32 model (and an fp32 one into an O2 model), and the fp32 master weights are in the
    optimizer's state dict (docs/backend.md, "state_dict").
    """
    record = CastRecord([])
    for name, module in model.named_modules():
        dtype = storage_dtype(name, module, config)
        if dtype is None or any(name == p or name.startswith(p + ".") for p in leave):
            continue
        for tensor in _compat.own_tensors(module):
            if (tensor is not None and tensor.is_floating_point()
                    and tensor.dtype not in (torch.float64, dtype)):
                record.originals.append((tensor, tensor.data))
                tensor.data = tensor.data.to(dtype)
    return record
