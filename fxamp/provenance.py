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

import re
from typing import Any, Iterator, Optional

import torch.fx as fx
import torch.fx.traceback as fx_traceback

__all__ = ["module_path", "module_of", "module_chain", "source_line", "innermost_frame",
           "boundary_casts", "is_boundary_cast"]

_TAG_KEY, _BOUNDARY = "fxamp", "boundary"
_SOURCE_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_ITEM = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_FRAME = re.compile(r'\s*File "([^"]+)", line (\d+), in (\S+)')


def module_path(dynamo_path: str) -> str:
    """Dynamo's "L['self'].blocks[0]._modules['ln']" -> "blocks.0.ln" (the named_modules path)."""
    path = _SOURCE_PREFIX.sub("", dynamo_path)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _ITEM.sub(r".\1", path)
    return path.strip(".").replace("..", ".")


def _type_name(module_type: Any) -> str:
    return getattr(module_type, "__name__", str(module_type).rsplit(".", 1)[-1])


def module_chain(stack: Optional[dict]) -> Iterator[tuple[str, str]]:
    """(named_modules path, class name) of every module in an `nn_module_stack`, innermost
    first."""
    for dynamo_path, module_type in reversed(list((stack or {}).values())):
        yield module_path(dynamo_path), _type_name(module_type)


def module_of(stack: Optional[dict]) -> tuple[str, str]:
    """(path, class name) of the innermost module of an `nn_module_stack`; ("", "") without."""
    return next(module_chain(stack), ("", ""))


def innermost_frame(stack_trace: Optional[str]) -> Optional[tuple[str, str, str, str]]:
    """(file, line, function, code) of the innermost frame of a node's `stack_trace`."""
    lines = (stack_trace or "").rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = _FRAME.match(lines[i])
        if match:
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
