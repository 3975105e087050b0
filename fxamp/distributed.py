"""fxamp under torch.distributed: checkpoints with torch.distributed.checkpoint (DCP), and the
check that a DDP model was wrapped after `fxamp.compile`. See docs/distributed.md.

The step's own agreement across ranks lives with the optimizer (fxamp/optim/distributed.py);
this module holds what users call around the training loop.

# Note [What a distributed checkpoint holds]
`state_dict` gathers the model's state dict (its stored tensors, 16-bit at O2/O3: Note [The
state dict is the live weights] in fxamp/model/cast_model.py), the
fxamp optimizer's (torch.optim's layout plus the fp32 "master_param" of each 16-bit parameter,
and the step count), and the loss scaler's (scale, growth tracker, hysteresis). Under FSDP2 the
parameters, moments and masters are DTensors, so every rank writes its own shard; under DDP they
are replicas, which DCP writes once. `load` reads into the same structure in place and then
hands each part to its owner's `load_state_dict`, model first, so that the masters loaded last
are the ones the optimizer keeps. With the same number of ranks, a resumed run is bit-identical
to an uninterrupted one.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from fxamp.backend import check_ddp_order
from fxamp.errors import ConfigError

__all__ = ["state_dict", "load_state_dict", "save", "load", "check_ddp_order"]

log = logging.getLogger(__name__)


def state_dict(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
               scaler: Any = None) -> dict[str, Any]:
    """{"model": ..., "optimizer": ..., "scaler": ...} for `torch.distributed.checkpoint`; the
    parts not given are left out. Reads the loss scale back from the device."""
    out: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        # DCP loads into what the dict holds: every parameter's state, also one a fresh
        # optimizer has not stepped (Note [State appears when a parameter is stepped])
        from fxamp.optim import checkpoint
        from fxamp.optim.optimizer import FusedOptimizer

        out["optimizer"] = (checkpoint.state_dict(optimizer, every=True)
                            if isinstance(optimizer, FusedOptimizer) else optimizer.state_dict())
    if scaler is not None:
        out["scaler"] = scaler.state_dict()
    return out


def load_state_dict(state: dict[str, Any], model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None) -> None:
    """Load what `state_dict` made (after DCP filled it) into model, optimizer and scaler."""
    for name, owner in (("model", model), ("optimizer", optimizer), ("scaler", scaler)):
        if owner is None:
            continue
        if name not in state:
            raise ConfigError(f"the checkpoint holds {sorted(state)}, not {name!r}; save it "
                              f"with fxamp.distributed.save(..., {name}=...)")
        owner.load_state_dict(state[name])


def save(checkpoint_id: Any, *, model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None,
         **dcp_kwargs: Any) -> None:
    """Save model, fxamp optimizer (with masters) and loss scaler with `dcp.save`, on every rank.

    Args:
        checkpoint_id: the directory (or a DCP storage writer's id).
        model: the model as trained (DDP-wrapped, FSDP2-sharded, or plain).
        optimizer: an fxamp optimizer (or any torch optimizer).
        scaler: a `fxamp.optim.LossScaler`.
        **dcp_kwargs: passed to `torch.distributed.checkpoint.save` (storage_writer, planner,
            process_group).
    """
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict(model, optimizer, scaler), checkpoint_id=checkpoint_id, **dcp_kwargs)
    log.debug("saved %s", checkpoint_id)


def load(checkpoint_id: Any, *, model: torch.nn.Module,
         optimizer: Optional[torch.optim.Optimizer] = None, scaler: Any = None,
         **dcp_kwargs: Any) -> None:
    """Load what `save` wrote into the same kind of model, optimizer and scaler, on every rank
    (Note [What a distributed checkpoint holds]). Build and wrap them as for training first."""
    import torch.distributed.checkpoint as dcp

    _check_scale_shards(checkpoint_id, optimizer, dcp_kwargs)
    state = state_dict(model, optimizer, scaler)
    dcp.load(state, checkpoint_id=checkpoint_id, **dcp_kwargs)
    load_state_dict(state, model, optimizer, scaler)
    log.debug("loaded %s", checkpoint_id)


def _check_scale_shards(checkpoint_id: Any, optimizer: Any, dcp_kwargs: dict) -> None:
    # DCP loads in place, into the optimizer's own buffers: a checkpoint whose 8-bit block
    # scales describe another sharding is refused before that, from its one small entry.
    from fxamp.optim import checkpoint
    from fxamp.optim.optimizer import FusedOptimizer

    if not isinstance(optimizer, FusedOptimizer) or not checkpoint.keeps_codes(optimizer):
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    probe = {"optimizer": {checkpoint.SCALE_SHARDS: -1}}  # -1: the checkpoint has no entry
    kwargs = {k: v for k, v in dcp_kwargs.items() if k != "planner"}
    dcp.load(probe, checkpoint_id=checkpoint_id,
             planner=DefaultLoadPlanner(allow_partial_load=True), **kwargs)
    saved = probe["optimizer"][checkpoint.SCALE_SHARDS]
    checkpoint.check_scale_shards(optimizer, None if saved == -1 else saved)
