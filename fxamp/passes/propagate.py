"""Propagating a node's value again under fake tensors, with the casts annotate decided
(annotate.py walks the graph; these are its two steps per node)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxamp._compat import pytree, python_dispatcher, same_layout

__all__ = ["run_with_casts", "traced_if_same"]


def run_with_casts(node: fx.Node, vals: list[Any], arg_casts: dict[int, torch.dtype],
                   set_dtype_kwarg: bool, fake_mode) -> Any:
    """`node`'s op on `vals` (the flat leaves of its arguments), leaf i cast to
    `arg_casts[i]`, with `dtype=torch.float32` when `set_dtype_kwarg`."""
    cast_vals = list(vals)
    for i, dtype in arg_casts.items():
        cast_vals[i] = vals[i].to(dtype)
    args, kwargs = pytree.tree_unflatten(cast_vals,
                                         pytree.tree_flatten((node.args, node.kwargs))[1])
    if set_dtype_kwarg:
        kwargs = {**kwargs, "dtype": torch.float32}
    with fake_mode, python_dispatcher():  # symbolic sizes decompose as when traced
        return node.target(*args, **kwargs)


def traced_if_same(value: Any, node: fx.Node) -> Any:
    """`value`, or the node's traced value where they are laid out alike.

    Note [Propagating only what changed]: a node is propagated again (`run_with_casts`) when
    it gets casts or when one of its inputs is a value other than the traced one. Compared by
    identity alone, the first re-run would make every node after it a re-run, also where the
    casts leave the dtypes as traced (an fp32 island restored to the model dtype, a cast
    input of an op whose result keeps its dtype). Handing on the traced value wherever the new
    one has its dtype, sizes, strides and device keeps the re-runs to the nodes whose values
    really changed; the traced value also keeps the storage it shares with others.
    """
    traced = node.meta.get("val")
    new_leaves, spec = pytree.tree_flatten(value)
    old_leaves, old_spec = pytree.tree_flatten(traced)
    if spec != old_spec or not all(
            new is old or (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                           and same_layout(new, old))
            for new, old in zip(new_leaves, old_leaves)):
        return value
    return traced
