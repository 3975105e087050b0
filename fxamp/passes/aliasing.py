"""Aliasing: which nodes of a pre-dispatch graph share storage, and where it is written.

Note [Casts and in-place updates of views]: the pre-dispatch ATen graph is not functional. A
node's value is what its storage holds when the node is read, not when it is made:
`h = emb(ids); h[:, 0] += cls; return mix(h)` traces to `select(embedding) -> add_ -> copy_`
into a view of `embedding`, and the linear then reads the `embedding` node, which the `copy_`
changed. A cast is a copy, so two rules keep it from separating a value from its storage:

- a cast is taken after the last write to its source's storage that comes before its reader
  (insert_casts): taken right after the source, it copies the value before the write, the
  reader never sees the update and the gradient of what was written goes nowhere;
- the input of a view op is never cast when its storage is written after the view (annotate):
  the view would be a view of the copy, so a write through it would miss the real storage,
  and a write to the real storage would miss the view.

Torch's schemas say what aliases what: a return with alias info is a view of (or, when the
argument's alias info is written, the same tensor as) the argument of the same alias set, and
an argument whose alias info is written is mutated. `aten.to.dtype` is a view by its schema
(it returns its input when the dtype already matches) and is treated as one: that can only
place a cast later than needed, never before a write.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from fxamp._compat import OpOverload, pytree, storage_key

__all__ = ["Aliasing", "written_positions"]


def written_positions(op: OpOverload) -> set[int]:
    """The positions of the arguments `op` writes to (the `self` of `add_`, the `out=`)."""
    return {i for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write}


def _aliased_position(op: OpOverload) -> Optional[int]:
    """The position of the argument `op`'s first return is a view of (or is), if any."""
    returns = op._schema.returns
    if not returns or returns[0].alias_info is None:
        return None
    # A list of views (`split(Tensor(a -> *) self) -> Tensor(a)[]`) shows no set on the list:
    # its argument's alias set goes to the wildcard.
    sets = returns[0].alias_info.before_set or {"*"}
    return next((i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None
                 and (a.alias_info.before_set | a.alias_info.after_set) & sets), None)


def _node_args(node: fx.Node, position: int) -> list[fx.Node]:
    name = node.target._schema.arguments[position].name  # type: ignore[union-attr]
    arg = node.args[position] if position < len(node.args) else node.kwargs.get(name)
    return [a for a in pytree.tree_leaves(arg) if isinstance(a, fx.Node)]


@dataclasses.dataclass
class Aliasing:
    """Storage sharing in one graph: `root` maps a view (or an in-place op's result) to the
    node that made its storage; `writes` lists, per root, the nodes that write to it."""

    order: dict[fx.Node, float]
    root: dict[fx.Node, fx.Node]
    writes: dict[fx.Node, list[fx.Node]]

    @classmethod
    def of(cls, graph: fx.Graph) -> "Aliasing":
        aliasing = cls({}, {}, {})
        storages: dict[Any, fx.Node] = {}
        for i, node in enumerate(graph.nodes):
            aliasing.order[node] = i
            if node.op == "placeholder":
                aliasing._share_input(node, storages)
            else:
                aliasing._visit(node)
        return aliasing

    def _share_input(self, node: fx.Node, storages: dict[Any, fx.Node]) -> None:
        # Graph inputs may be views of one another: a graph break between `v = h[:, 0]` and
        # `v += c; mix(h)` hands the graph both v and h, and AOTAutograd replays writes to v
        # on h. Fake values made from the same storage say so.
        val = node.meta.get("val")
        key = storage_key(val) if isinstance(val, torch.Tensor) else None
        if key is not None and storages.setdefault(key, node) is not node:
            self.root[node] = storages[key]

    def _visit(self, node: fx.Node) -> None:
        if node.target is operator.getitem and node.args[0] in self.root:  # split, unbind, ...
            self.root[node] = self.root[node.args[0]]
            return
        if not isinstance(node.target, OpOverload):
            return
        for position in written_positions(node.target):
            for arg in _node_args(node, position):
                self.writes.setdefault(self.root_of(arg), []).append(node)
        aliased = _aliased_position(node.target)
        sources = _node_args(node, aliased) if aliased is not None else []
        if len(sources) == 1:
            self.root[node] = self.root_of(sources[0])

    def root_of(self, node: fx.Node) -> fx.Node:
        return self.root.get(node, node)

    def share(self, copy: fx.Node, source: fx.Node) -> None:
        """`copy` stands in for `source` from now on (all its readers were moved to it)."""
        self.root[copy] = self.root_of(source)
        self.order[copy] = self.order[source] + 0.5

    def last_write(self, node: fx.Node, reader: fx.Node) -> Optional[fx.Node]:
        """The last write to `node`'s storage after `node` and before `reader`."""
        start, end = self.order[node], self.order[reader]
        between = [w for w in self.writes.get(self.root_of(node), ())
                   if start < self.order[w] < end]
        return between[-1] if between else None

    def written_after(self, node: fx.Node) -> bool:
        """Whether `node`'s storage is written by a node after it."""
        return any(self.order[w] > self.order[node]
                   for w in self.writes.get(self.root_of(node), ()))

    def uncastable(self, node: fx.Node) -> set[int]:
        """Positions of `node`'s arguments a cast must not replace: those it writes, and the
        one it views when that storage is written after it (Note [Casts and in-place updates
        of views])."""
        op = node.target
        blocked = written_positions(op)  # type: ignore[arg-type]
        aliased = _aliased_position(op)  # type: ignore[arg-type]
        if aliased is not None and self.written_after(node):
            blocked.add(aliased)
        return blocked
