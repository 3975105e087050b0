"""timm's loss-scaler protocol over fxamp's LossScaler: `loss_scaler = NativeScaler()`.

timm's training script (train.py, `train_one_epoch`) drives loss scaling through one object,
`timm.utils.NativeScaler`: `loss_scaler(loss, optimizer, clip_grad=..., clip_mode=...,
parameters=..., create_graph=..., need_update=...)`, and checkpoints it under its
`state_dict_key`. This class keeps that protocol with an `fxamp.LossScaler` (GradScaler's rule by
default) inside, so the script's one changed line is where it builds the scaler; fxamp's
optimizers then step fused and without a host read, torch.optim ones as under GradScaler.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from fxamp.optim.scaling.loss_scaler import LossScaler

__all__ = ["NativeScaler"]


class NativeScaler:
    """A drop-in for `timm.utils.NativeScaler` (docs/integrations.md, "timm").

    Args:
        **scaler_kwargs: `fxamp.LossScaler` keywords; `semantics` defaults to "torch"
            (GradScaler's rule, as timm's scaler has).
    """

    state_dict_key = "amp_scaler"  # the key timm's CheckpointSaver stores the scaler under

    def __init__(self, **scaler_kwargs: Any) -> None:
        scaler_kwargs.setdefault("semantics", "torch")
        self.scaler = LossScaler(**scaler_kwargs)

    def __call__(self, loss: torch.Tensor, optimizer: Any, clip_grad: Optional[float] = None,
                 clip_mode: str = "norm", parameters: Optional[Iterable[torch.Tensor]] = None,
                 create_graph: bool = False, need_update: bool = True) -> None:
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:  # gradient accumulation: timm steps on the last micro-batch only
            return
        if clip_grad is not None:
            if parameters is None:
                raise ValueError("clip_grad needs the parameters to clip, as timm's "
                                 "NativeScaler does: pass parameters=model.parameters()")
            from timm.utils import dispatch_clip_grad

            self.scaler.unscale_(optimizer)
            dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
