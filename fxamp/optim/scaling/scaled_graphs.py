"""Which optimizers' gradients carry a loss scale that no step has taken off yet.

# Note [A scaled backward awaits its step]
`scaler.scale(loss).backward(); opt.step()` (the scaler forgotten) would apply an update
`scale` times too large (65536x by default) with no word. The scaler cannot know which
optimizer its loss will reach, and the step cannot read the gradients without a host sync. So
`LossScaler.scale` puts a hook on the scaled loss; when a backward starts from it, the hook
records the root of its autograd graph (one Python call per backward; a scaled loss that is
never backpropagated is never held, so an evaluation loop cannot pile up graphs). A step that
takes the scaler (or `zero_grad`) marks the recorded graphs done for that optimizer. Only a step that
finds no scaler at all looks at the scalers with unfinished graphs (a weak set: a scaler nobody
holds drops out) and walks their graphs to the parameters they reach; if they reach its own, it
refuses. The walk happens on that path only; the usual loop adds no work beyond the append.

The record follows the gradients: a parameter whose `.grad` is None had its gradient dropped
(`model.zero_grad()`, `p.grad = None`) after every backward recorded so far, so it carries no
scale. The check leaves such parameters out, and a `scale_loss` entry (the last moment before
a new backward could create their `.grad` again) marks done, for its optimizers, every record
that reaches none of their other parameters (`release_dropped`): Apex's multi-loss loop, where
a generator's loss reaches the discriminator and `D.zero_grad()` drops it, is not refused.
Gradients zeroed in place (`zero_grad(set_to_none=False)` on a module) cannot be told from
gradients still holding the scale, and stay refused.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from fxamp.errors import ConfigError

__all__ = ["ScaledGraphs", "check_no_pending_scale", "release_pending", "release_dropped"]

# Scalers whose `ScaledGraphs` hold roots; see the Note. Weak: it keeps no scaler alive.
_AWAITING: "weakref.WeakSet[Any]" = weakref.WeakSet()


class ScaledGraphs:
    """The autograd roots of one scaler's scaled losses since it was last stepped."""

    def __init__(self, scaler: Any) -> None:
        self._scaler = weakref.ref(scaler)
        self.roots: list[Any] = []
        self.done: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers that took the scale
        self._reached: Optional[frozenset[int]] = None

    def watch(self, scaled: torch.Tensor) -> None:
        """Record `scaled`'s graph when (if ever) a backward starts from it."""
        if scaled.grad_fn is None or torch.compiler.is_compiling():
            return  # nothing to backpropagate (an evaluation loss), or traced into a graph
        root = scaled.grad_fn  # alive as long as `scaled` is: the hook adds no lifetime
        scaled.register_hook(lambda grad: self._record(root))

    def _record(self, root: Any) -> None:
        if len(self.done):  # a new iteration: the last one's graphs were stepped
            self.roots, self._reached = [], None
            self.done = weakref.WeakSet()
        self.roots.append(root)
        self._reached = None
        _AWAITING.add(self._scaler())

    def mark_done(self, optimizer: Any) -> None:
        if self.roots:
            self.done.add(optimizer)

    def reaches(self, params: Iterable[torch.Tensor]) -> bool:
        if self._reached is None:
            self._reached = frozenset(id(v) for v in _leaves(self.roots))
        return any(id(p) in self._reached for p in params)


def _leaves(roots: list[Any]) -> Iterator[torch.Tensor]:
    # Python wrappers of autograd nodes can be created per access (torch 2.11): `seen` keeps
    # them alive so that no id is reused by another node's wrapper during the walk.
    seen: dict[int, Any] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
        if variable is not None:
            yield variable
        stack.extend(fn for fn, _ in node.next_functions)


def check_no_pending_scale(optimizer: Any, params: list[torch.Tensor], call: str) -> None:
    """Refuse to step (or unscale) `optimizer` with no scaler while the scaled gradients of a
    scaler that it has not stepped with reach its parameters."""
    for scaler in list(_AWAITING):
        graphs = scaler.scaled_graphs
        if optimizer in graphs.done or not graphs.roots or not graphs.reaches(
                [p for p in params if p.grad is not None]):  # None: dropped since
            continue
        name = type(optimizer).__name__
        what = f"master_params({name})" if call == "master_params" else f"{name}.{call}()"
        raise ConfigError(
            f"{what} was called without a scaler, but the gradients carry the scale "
            f"of {scaler!r} (scaler.scale(loss) was backpropagated into this {name}'s "
            f"parameters; scale {scaler.get_scale():g}): stepping would apply an update that "
            f"many times too large. {_FIXES[call]}; or opt.zero_grad() to drop these "
            "gradients")


# What each refused call should be instead; master_params takes no scaler, unscale_ does.
_FIXES = {
    "step": "Call step(scaler) with that scaler, which unscales, skips on overflow and moves "
            "the scale",
    "unscale_": "Call unscale_(scaler) with that scaler",
    "master_params": "Call fxamp.optim.unscale_(optimizer, scaler) with that scaler first "
                     "(master_params then yields the unscaled gradients, and step() takes "
                     "them, skipping on overflow), or backpropagate through "
                     "amp.scale_loss(loss, optimizer)",
}


def release_pending(optimizer: Any) -> None:
    """`optimizer` dropped its gradients (zero_grad): no scaled graph awaits its step."""
    for scaler in list(_AWAITING):
        scaler.scaled_graphs.mark_done(optimizer)


def release_dropped(optimizer: Any, params: Callable[[], list[torch.Tensor]]) -> None:
    """Before a backward: the records whose graphs reach only parameters of `optimizer` whose
    `.grad` is None (dropped) await its step no more (see the Note). `params` is called only if
    a record awaits `optimizer`."""
    for scaler in list(_AWAITING):
        graphs = scaler.scaled_graphs
        if optimizer in graphs.done or not graphs.roots:
            continue
        if not graphs.reaches([p for p in params() if p.grad is not None]):
            graphs.mark_done(optimizer)
