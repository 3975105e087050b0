"""Where a graph node came from, in the user's terms: module path and type, source line, and
whether fxamp itself traced it at the model boundary.

Note [Boundary casts are tagged when traced]: `fxamp.compile` casts the model's inputs and
outputs in a function Dynamo traces into the model's graph (Note [Model-boundary casts] in
cast_model.py). Those casts are traced inside `boundary_casts()`, a `torch.fx.traceback.annotate`
region, so Dynamo records the tag in each node's `meta["custom"]` and the re-trace to ATen
(`preserve_node_meta`) carries it to the ATen cast. `is_boundary_cast` reads the tag; nothing
looks at file names or reason strings.

This module sits below the policy rules, the passes, explain() and the debug tools, which all
read node provenance (the passes package imports the rules, so it cannot live inside it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterator, Optional

import torch.fx as fx
import torch.fx.traceback as fx_traceback

from fxamp import _compat

__all__ = ["OpSite", "module_path", "module_of", "module_chain", "source_line", "innermost_frame",
           "boundary_casts", "is_boundary_cast", "place_in_model"]

_TAG_KEY, _BOUNDARY = "fxamp", "boundary"
_SOURCE_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_STACK_SLOT = re.compile(r"^L\['___stack\d+'\]")
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')
# fxamp's own files: a frame there is fxamp's machinery (the compiled call's entry, the
# boundary casts), never the user's code, so a source line never names one
_OWN_FILES = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class OpSite:
    """Which op of which graph: what the debug tools' Origin, RangeRow, OverflowSite and the
    planner's PlannedGemm start with."""

    phase: str  # "forward" or "backward" ("loss" for OverflowSite's loss_fn site)
    graph: int
    node: str  # the node that ran (AOTAutograd's graph)
    op: str  # the ATen op that ran, e.g. "aten.addmm.default"
    source_op: str  # the op fxamp annotated, e.g. "aten.linear.default" ("" if none)
    module: str  # named_modules path of the innermost module, "" at the top level



def module_path(dynamo_path: str) -> str:
    """Dynamo's "L['self'].blocks[0]._modules['ln']" -> "blocks.0.ln" (the named_modules path)."""
    path = _SOURCE_PREFIX.sub("", dynamo_path)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _ITEM.sub(r".\1", path)
    return path.strip(".").replace("..", ".")


def _type_name(module_type: Any) -> str:
    module_type = _compat.unsharded_class(module_type)  # "Linear", not FSDP2's "FSDPLinear"
    return getattr(module_type, "__name__", str(module_type).rsplit(".", 1)[-1])


def place_in_model(gm: fx.GraphModule, names: dict[int, str],
                   module: Optional[tuple[str, type]] = None) -> None:
    """Name the modules of `gm`'s `nn_module_stack`s (higher-order op bodies included) by their
    paths in the model: `names` maps id(module) to its `named_modules` path.

    Note [Module paths in the model's terms]: Dynamo names a module by the source it was
    reached from, which is not always its path in the model:
    - in a resume function (the code after a graph break) a module loaded before the break
      arrives as a stack slot, "L['___stack1']"; Dynamo keys each entry by `str(id(module))`
      (with "@n" for repeated calls; checked on 2.11.0, 2.13.0, 2.14.1), so such an entry is
      named by identity;
    - a graph traced from one submodule's forward (`module`: its path and class; Note [Sharded
      modules are compiled one by one] in docs/design.md) names modules from that
      submodule ("L['module'].attn.c_attn") and its own ops have no entry: every stack gets the
      submodule as its outermost entry and its entries' paths below it.
    Module overrides, float8's `skip_modules`, delayed scaling's histories, explain() and the
    debug tools then read the same names as in the model's own graph."""
    prefix = module[0] if module else ""
    own = {f"fxamp_module_{prefix}": module} if module else {}
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if node.op in ("placeholder", "output") or not (stack or own):
                continue
            node.meta["nn_module_stack"] = {**own, **{
                key: (_model_path(key, where, prefix, names), module_type)
                for key, (where, module_type) in (stack or {}).items()}}


def _model_path(key: str, where: str, prefix: str, names: dict[int, str]) -> str:
    if _STACK_SLOT.match(where):  # a resume function's stack slot
        try:
            found = names.get(int(str(key).split("@")[0]))
        except ValueError:
            found = None
        if found is not None:
            return found
    return ".".join(p for p in (prefix, module_path(where)) if p)


def module_chain(stack: Optional[dict]) -> Iterator[tuple[str, str]]:
    """(named_modules path, class name) of every module in an `nn_module_stack`, innermost
    first."""
    for dynamo_path, module_type in reversed(list((stack or {}).values())):
        yield module_path(dynamo_path), _type_name(module_type)


def module_of(stack: Optional[dict]) -> tuple[str, str]:
    """(path, class name) of the innermost module of an `nn_module_stack`; ("", "") without."""
    return next(module_chain(stack), ("", ""))


def innermost_frame(stack_trace: Optional[str]) -> Optional[tuple[str, str, str, str]]:
    """(file, line, function, code) of the innermost frame of a node's `stack_trace` outside
    fxamp's own files (None if there is none: the traced code is torch's and fxamp's alone,
    e.g. an nn.Sequential of torch modules)."""
    lines = (stack_trace or "").rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _FRAME.match(lines[i])
        if match and not os.path.abspath(match[1]).startswith(_OWN_FILES):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return match[1], match[2], match[3], code
    return None


def source_line(stack_trace: Optional[str]) -> str:
    """'path/models.py:28 in forward: return self.fc2(...)', or "" without a trace."""
    frame = innermost_frame(stack_trace)
    return "" if frame is None else f"{frame[0]}:{frame[1]} in {frame[2]}: {frame[3]}"


def boundary_casts():
    """The region `fxamp.compile`'s boundary casts are traced in (Note [Boundary casts are
    tagged when traced])."""
    return fx_traceback.annotate({_TAG_KEY: _BOUNDARY})


def is_boundary_cast(node: fx.Node) -> bool:
    return (node.meta.get("custom") or {}).get(_TAG_KEY) == _BOUNDARY
