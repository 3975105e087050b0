"""The step's functions compiled once per kind of call, shared by every optimizer and loss scaler
of the process (Note [One compiled step per kind] in docs/design.md).

A call's kind is what its graph depends on: the structure of its arguments (how many buckets,
which states), each tensor's type, dtype, device and number of dimensions, and every other value
that is not an int (the update rule, the master kind, flags, floats such as the loss scale's
factors, the process group). Sizes and ints are symbols in the graph (`compile_symbolic`), and
the hyperparameters are tensors, so two optimizers over models of other sizes, or with other
learning rates, are one kind.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch

from fxamp._compat import compile_symbolic, cpu_code_options, pytree

__all__ = ["CompiledPerKind", "kind_of"]


def kind_of(value: Any) -> Hashable:
    """What a compiled graph of a call with argument `value` depends on (see the module)."""
    if isinstance(value, torch.Tensor):
        return (type(value), value.dtype, value.device, value.dim())
    if isinstance(value, int) and not isinstance(value, bool):
        return int  # a symbol in the graph (0 and 1 are specialised: Dynamo guards them)
    if value is None or isinstance(value, (bool, str, float)):
        return (type(value), value)  # constants in the graph; 1.0 and 1 and True differ
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(kind_of(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, kind_of(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return (type(value), id(value))
    return value  # a function, a frozen config, a process group: by its own equality


class CompiledPerKind:
    """`fn` compiled with symbolic sizes once per kind of its arguments, each kind with a
    Dynamo cache of its own (so no kind counts against another's recompile limit).

    Args:
        fn: a pure function of tensors (it may write its tensor arguments in place).
        options: Inductor options for every kind, computed at the first compile.
    """

    def __init__(self, fn: Callable, options: Optional[Callable[[], dict]] = None) -> None:
        self.fn = fn
        self._options = options
        self._compiled: dict[Hashable, Callable] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kind = (kind_of(args), kind_of(kwargs))
        compiled = self._compiled.get(kind)
        if compiled is None:
            options = {} if self._options is None else self._options()
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                   for t in pytree.tree_leaves((args, kwargs))):
                # Note [Inductor's cache and the CPU's instruction set]
                options = {**cpu_code_options(), **options}
            compiled = compile_symbolic(self.fn, fullgraph=True, options=options or None)
            self._compiled[kind] = compiled
        return compiled(*args, **kwargs)

    @property
    def kinds(self) -> int:
        """How many kinds were compiled so far in this process."""
        return len(self._compiled)

    def __repr__(self) -> str:
        return f"CompiledPerKind({self.fn.__name__}, {self.kinds} kinds)"
