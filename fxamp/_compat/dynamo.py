"""Dynamo: its exceptions, counters and caches, its AOTAutograd backends, fresh compiles."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable

import torch
import torch.fx as fx

# Checked on 2.11.0, 2.13.0, 2.14.1.
import torch._dynamo.exc as _dynamo_exc
from torch._dynamo.utils import counters as dynamo_counters  # noqa: F401

# Checked on 2.11.0, 2.13.0, 2.14.1.
BackendCompilerFailed = _dynamo_exc.BackendCompilerFailed
Unsupported = _dynamo_exc.Unsupported
UserError = _dynamo_exc.UserError  # e.g. a data-dependent branch under fullgraph=True


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


def compile_fresh(fn: Callable, **compile_kwargs: Any) -> Callable:
    """`torch.compile(fn, **compile_kwargs)` with a Dynamo cache of its own.

    Dynamo keeps its compiled entries, and counts them against its recompile limit (8 by
    default), per code object, and closures or repeated `torch.compile` calls of one function
    share its code object. A copy of the code object (equal, not identical) starts an empty
    cache that dies with the returned function. Checked on 2.11.0, 2.13.0, 2.14.1
    (tests/test_compat.py: twelve copies each take a graph of their own, one function taking
    the same twelve graphs hits the limit). See Note [One compiled step per kind] in
    docs/design.md.
    """
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return torch.compile(copy, **compile_kwargs)


def compile_symbolic(fn: Callable, **compile_kwargs: Any) -> Callable:
    """`compile_fresh(fn, dynamic=True, **compile_kwargs)` where every size and int of a call is
    a symbol of its own and every float a constant.

    `dynamic=True` makes sizes, ints and floats symbols, except 0 and 1 (specialised). Two
    changes, for graphs shared by many optimizers:
    - Dynamo gives sizes that are equal in the first call one symbol ("duck shaping") and
      guards on their equality, so a later call where they differ (two buckets of equal sizes,
      then of other ones) would compile again: here each size gets a symbol of its own
      (`torch.fx.experimental._config.use_duck_shape`).
    - A float symbol that reaches an op which cannot take it as a tensor (`clamp_min(x)`) makes
      Dynamo restart the whole trace and specialise it anyway: here floats are constants from
      the start (`torch._dynamo.config.specialize_float`), part of the caller's kind.
    Both configs are read when Dynamo starts a compile, so they are set for the duration of
    each call (set and restored directly: `patch` costs five times as much per call). Under an
    enclosing torch.compile the call is traced inline. Checked on 2.11.0, 2.13.0, 2.14.1
    (tests/test_compat.py).
    """
    import torch._dynamo.config as dynamo_config
    import torch.fx.experimental._config as fx_config

    compiled = compile_fresh(fn, dynamic=True, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        duck, floats = fx_config.use_duck_shape, dynamo_config.specialize_float
        fx_config.use_duck_shape, dynamo_config.specialize_float = False, True
        try:
            return compiled(*args, **kwargs)
        finally:
            fx_config.use_duck_shape, dynamo_config.specialize_float = duck, floats

    return call


def isolated_recompiles() -> dict[str, Any]:
    """`torch.compile` keywords that give the compiled function a Dynamo cache region of its
    own, resume functions after graph breaks included (`isolate_recompiles=True`, 2.13 on);
    {} where torch has none (2.11: entries share the code object's recompile limit)."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    return {}


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
