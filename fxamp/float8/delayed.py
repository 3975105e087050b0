"""Float8 state kept as buffers of the model, updated inside the graph: delayed scaling's amax
histories, and the counter NVFP4's stochastic rounding draws its noise from.

With `Float8Config(scaling="delayed")` a GEMM's input and weight are scaled from the largest amax
of their last `history_len` steps; the compiled graph pushes the current amax into a buffer of
the model (an input mutation, no host sync), named after the GEMM it feeds. Only forwards run
with grad enabled push; the gradient operand is scaled dynamically.

Design (docs/design.md): Note [Delayed scaling lives in the model], Note [Amax histories are
named by what they measure], Note [Eval forwards leave the histories alone], Note [The seed of
NVFP4's stochastic rounding].
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from fxamp.errors import ConfigError
from fxamp.float8.config import Float8Config

__all__ = ["Float8History", "PREFIX", "SEED", "attach_history", "history_of", "history_name",
           "keeps_state"]

PREFIX = "fxamp_float8_"
SEED = "nvfp4_seed"  # the buffer PREFIX + SEED: Note [The seed of NVFP4's stochastic rounding]
_ATTR = "_fxamp_float8_history"
_LEGACY = re.compile(re.escape(PREFIX) + r"g\d+_")


def history_name(module: str, op: str, rank: int, entries: int = 0) -> str:
    """The buffer name (less PREFIX and the `_input`/`_weight` role) of the histories of one
    GEMM (Note [Amax histories are named by what they measure])."""
    module = "root" if module in ("", "<root>") else module
    batch = f"_b{entries}" if entries else ""
    return re.sub(r"\W", "_", f"amax_{module}_{op}{rank}{batch}")


class Float8History:
    """Names and creates the amax-history buffers of one model (Note [Delayed scaling lives
    in the model]): one fp32 buffer of `history_len` per delayed-scaled operand."""

    def __init__(self, model: torch.nn.Module, history_len: int, device: torch.device):
        self.model, self.history_len, self.device = model, history_len, device
        # name -> (GEMM, source line, weight operand)
        self.claimed: dict[str, tuple[tuple[str, str, int], str, Optional[str]]] = {}

    def __getstate__(self) -> dict:
        # A copy retraces its graphs, and claims its names again.
        return {**self.__dict__, "claimed": {}}

    def claim(self, uses: list[tuple[str, tuple[str, str, int], str, Optional[str]]]) -> None:
        """Record that each GEMM (module, op, rank) at its source line, with its right operand
        read from `weight` (a parameter's or buffer's name, None for an activation), uses
        history `name`, for `(name, gemm, line, weight)` in `uses`; refuse two GEMMs under one
        name, before recording any (Note [Amax histories are named by what they measure]).
        Lines and weights are compared where both claims know them: either differing is a
        second GEMM (the weight still tells two GEMMs apart where nodes carry no stack trace,
        or a stale one)."""
        claimed = dict(self.claimed)
        for name, gemm, line, weight in uses:
            seen = claimed.setdefault(name, (gemm, line, weight))
            if (seen[0] != gemm or (line and seen[1] and seen[1] != line)
                    or (weight and seen[2] and seen[2] != weight)):
                raise ConfigError(_shared_refusal(name, seen, (gemm, line, weight)))
        self.claimed = claimed

    def get(self, name: str, entries: int = 0) -> torch.Tensor:
        """The buffer PREFIX + name of the model, created (zeros: nothing seen yet) if new:
        [history_len], or [history_len, entries] for a batched GEMM's operand (one history
        per batch entry, Note [Batched float8 GEMMs])."""
        full = PREFIX + name
        if full not in dict(self.model.named_buffers(recurse=False)):
            shape = (self.history_len, entries) if entries else (self.history_len,)
            self.model.register_buffer(full, torch.zeros(shape, device=self.device))
        return self.model.get_buffer(full)

    def seed(self) -> torch.Tensor:
        """The buffer PREFIX + SEED of the model, an int64 counter (0-dim) that every NVFP4
        GEMM of a training forward reads and advances (Note [The seed of NVFP4's stochastic
        rounding]), created (0) if new."""
        full = PREFIX + SEED
        if full not in dict(self.model.named_buffers(recurse=False)):
            self.model.register_buffer(full, torch.zeros((), dtype=torch.int64,
                                                         device=self.device))
        return self.model.get_buffer(full)

    def remove(self) -> None:
        """Delete every history buffer from the model (un-preparing it)."""
        names = [n for n, _ in self.model.named_buffers(recurse=False) if n.startswith(PREFIX)]
        for name in names:
            delattr(self.model, name)


def _shared_refusal(name: str, first: tuple, second: tuple) -> str:
    return (f"float8 delayed scaling: two GEMMs would share the amax history {name!r}: "
            f"{_gemm_words(first)} and {_gemm_words(second)}. Histories are named by "
            "module, op and rank, and these two have the same in different graphs: a graph "
            f"break between two GEMMs of module {second[0][0]!r}, a GEMM that only one graph "
            "runs (under `if self.training:`), or module paths that differ only by '.' and "
            "'_'. Remove the graph break (fxamp.explain lists them), move one GEMM into a "
            "submodule of its own, add the module to Float8Config(skip_modules=...), or use "
            "scaling='dynamic'")


def _gemm_words(claim: tuple) -> str:
    gemm, line, weight = claim
    return f"{line or gemm}" + (f" (weight {weight!r})" if weight else "")


def _create_loaded(model: torch.nn.Module, state_dict, prefix, *args) -> None:
    history = history_of(model)
    ours = [key for key in state_dict
            if key.startswith(prefix + PREFIX) and "." not in key[len(prefix):]]
    legacy = [key for key in ours if _LEGACY.match(key[len(prefix):])]
    if legacy:
        raise ConfigError(_legacy_refusal(legacy))
    for key in ours if history is not None else ():
        saved = state_dict[key]
        if key[len(prefix + PREFIX):] == SEED:
            continue  # made at preparation where the config draws from it (attach_history)
        history.get(key[len(prefix + PREFIX):], saved.shape[1] if saved.dim() == 2 else 0)


def _legacy_refusal(keys: list[str]) -> str:
    return (f"this state_dict holds float8 amax histories named by trace order ({keys[0]!r}"
            f"{f' and {len(keys) - 1} more' if len(keys) > 1 else ''}), from an fxamp that "
            "gave a graph traced first (an eval pass, too) the training graph's histories: "
            "which GEMM each one measured is not recorded, so they are not loaded (nothing "
            "was). Drop them: model.load_state_dict({k: v for k, v in state.items() if not "
            "k.startswith('fxamp_float8_g')}, strict=False); the histories then restart "
            "from the next steps' amaxes (docs/float8.md, \"Delayed scaling\")")


def is_delayed(f8: Optional[Float8Config]) -> bool:
    """Whether `f8` asks for delayed scaling (the model then keeps amax histories)."""
    return f8 is not None and f8.scaling == "delayed"


def keeps_state(f8: Optional[Float8Config]) -> bool:
    """Whether `f8` keeps state in the model: amax histories, or the stochastic-rounding seed."""
    return is_delayed(f8) or (f8 is not None and f8.nvfp4_stochastic_rounding)


def attach_history(model: torch.nn.Module, f8: Optional[Float8Config]):
    """Give `model` its Float8History where `f8` keeps state; returns the hook handle to remove
    (with the history) when the model is un-prepared, or None when nothing was attached."""
    if not keeps_state(f8) or history_of(model) is not None:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    model.__dict__[_ATTR] = history = Float8History(model, f8.history_len, device)
    if f8.nvfp4_stochastic_rounding:  # in the state_dict from the start, trained or not
        history.seed()
    return model.register_load_state_dict_pre_hook(_create_loaded)


def detach_history(model: torch.nn.Module, handle) -> None:
    """Undo `attach_history`: the hook, the Float8History and the buffers it made (the model
    had none before: they are all made by fxamp, at a load or a trace)."""
    handle.remove()
    history = model.__dict__.pop(_ATTR, None)
    if history is not None:
        history.remove()


def history_of(model: Optional[torch.nn.Module]) -> Optional[Float8History]:
    return None if model is None else model.__dict__.get(_ATTR)
