"""Delayed scaling: amax histories kept as buffers of the model, updated inside the graph.

Note [Delayed scaling lives in the model]: with `Float8Config(scaling="delayed")` a GEMM's
input and weight are scaled from the largest amax of their last `history_len` steps instead of
their own (so the scale needs no reduction before the cast), and the current amax is pushed
into the history by the compiled graph itself: a `copy_` into a buffer, which AOTAutograd turns
into an input mutation of the compiled function, with no `.item()` and no host sync. The
buffers are registered on the model itself (`fxamp_float8_<graph>_<module>_<op><n>_input` /
`_weight`; a child module would change what an nn.Sequential runs), so they are in
`model.state_dict()`, move with checkpoints and resume bit for bit; a load_state_dict pre-hook
creates them when a checkpoint is loaded before the first call (the graph that names them is
traced only then). The `Float8History` that names them lives in the model's `__dict__`. A history is named after its graph, module, op and operand, so a model
that recompiles (new shapes) starts fresh histories for the new graph. The gradient operand
is scaled dynamically: its amax exists only in the backward graph, and AOTAutograd does not
carry a buffer mutation made there back to the buffer (checked on 2.11, 2.13, 2.14: it is
dropped silently), so a history of it could not be kept in-graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from fxamp.float8.config import Float8Config

__all__ = ["Float8History", "PREFIX", "attach_history", "history_of"]

PREFIX = "fxamp_float8_"
_ATTR = "_fxamp_float8_history"


class Float8History:
    """Names and creates the amax-history buffers of one model (Note [Delayed scaling lives
    in the model]): one fp32 buffer of `history_len` per delayed-scaled operand."""

    def __init__(self, model: torch.nn.Module, history_len: int, device: torch.device):
        self.model, self.history_len, self.device = model, history_len, device
        self.graphs_traced = 0  # names the histories of each graph the backend transforms

    def __getstate__(self) -> dict:
        # A copy retraces its graphs from the first, so it names them as the original did.
        return {**self.__dict__, "graphs_traced": 0}

    def get(self, name: str, entries: int = 0) -> torch.Tensor:
        """The buffer PREFIX + name of the model, created (zeros: nothing seen yet) if new:
        [history_len], or [history_len, entries] for a batched GEMM's operand (one history
        per batch entry, Note [Batched float8 GEMMs])."""
        full = PREFIX + name
        if full not in dict(self.model.named_buffers(recurse=False)):
            shape = (self.history_len, entries) if entries else (self.history_len,)
            self.model.register_buffer(full, torch.zeros(shape, device=self.device))
        return self.model.get_buffer(full)


def _create_loaded(model: torch.nn.Module, state_dict, prefix, *args) -> None:
    history = history_of(model)
    for key in state_dict:
        name = key[len(prefix):]
        if history is not None and key.startswith(prefix + PREFIX) and "." not in name:
            saved = state_dict[key]
            history.get(name[len(PREFIX):], saved.shape[1] if saved.dim() == 2 else 0)


def attach_history(model: torch.nn.Module, f8: Optional[Float8Config]):
    """Give `model` its Float8History for delayed scaling; returns the hook handle to remove
    (with the history) when the model is un-prepared, or None when nothing was attached."""
    if f8 is None or f8.scaling != "delayed" or history_of(model) is not None:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    model.__dict__[_ATTR] = Float8History(model, f8.history_len, device)
    return model.register_load_state_dict_pre_hook(_create_loaded)


def detach_history(model: torch.nn.Module, handle) -> None:
    handle.remove()
    model.__dict__.pop(_ATTR, None)


def history_of(model: Optional[torch.nn.Module]) -> Optional[Float8History]:
    return None if model is None else model.__dict__.get(_ATTR)
