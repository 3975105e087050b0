"""The parameters of a FusedOptimizer's param groups that no flat buffer holds.

A group added after construction (unfreezing layers while fine-tuning) is laid out like the
first ones (`DeviceState.add_groups` in buffers/device_state.py). A parameter that was frozen
when its group was flattened is in no buffer: if it later gets a gradient, torch.optim would
step it, so the step refuses rather than leave it untrained. An optimizer that handed its
groups over to another (`FusedOptimizer.hand_over`) holds none of them and refuses to step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fxamp.errors import ConfigError
from fxamp.optim.buffers.bucket import Bucket

__all__ = ["left_out", "check_left_out", "check_not_handed_over"]


def left_out(groups: Sequence[dict], buckets: Sequence[Bucket]
             ) -> list[tuple[int, int, torch.Tensor]]:
    """(group index, position, parameter) of each parameter no bucket holds."""
    held = {id(p) for b in buckets for p in b.params}
    return [(gi, pi, p) for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])
            if id(p) not in held]


def check_not_handed_over(handed_over: bool, owner: str) -> None:
    """Refuse a step of an optimizer whose param groups another one steps (hand_over)."""
    if handed_over:
        raise ConfigError(f"this {owner} was replaced by the optimizer that fxamp.initialize (or "
                          "fxamp's accelerate or transformers integration) built over the same "
                          "param groups; step that one")


def check_left_out(left: Sequence[tuple[int, int, torch.Tensor]], owner: str) -> None:
    """Refuse a step while a parameter no bucket holds (`left_out`) has a gradient (see the
    module doc)."""
    for gi, pi, p in left:
        if p.requires_grad and p.grad is not None:
            raise ConfigError(
                f"{owner}: parameter {pi} of param group {gi} (shape "
                f"{tuple(p.shape)}) had requires_grad=False when the optimizer was built, so "
                "its flat buffers do not hold it, and it now has a gradient. Leave frozen "
                "parameters out of the optimizer and add them with "
                "add_param_group({'params': [...]}) when unfreezing, or build the optimizer "
                "after unfreezing")
