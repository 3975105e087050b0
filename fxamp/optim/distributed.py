"""What the fused step needs from torch.distributed: the process group it agrees over, and the
two reductions it traces into its prologue graph.

# Note [Agreeing on overflow across ranks]
Under DDP or FSDP2 every rank runs its own optimizer step. If one rank saw an inf and skipped
while another applied its update, the replicas (DDP) would drift apart and the loss scales would
differ from then on. So the prologue reduces, over the optimizer's process group:
- the overflow flag, MAX of 0/1 (a float, which every backend reduces), always: a rank whose
  shard (FSDP2) or whose local gradients (an injected or a pre-reduction overflow under DDP) are
  not finite makes every rank skip, and each rank's loss scale then moves by the same flag;
- the squared gradient norm, SUM, only over sharded (DTensor) buckets and only when clipping:
  FSDP2's gradient shards are disjoint, so the squares add up to the global norm. DDP's reduced
  gradients are replicas, whose norm every rank already has; summing them would count it N times.
Both are functional collectives (`torch.distributed._functional_collectives.all_reduce`) traced
into the compiled prologue, so the flag and the norm stay on the device: no host read, and on
CUDA the collective is ordered on the stream like any other kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.distributed as dist

from fxamp._compat import functional_all_reduce
from fxamp.errors import ConfigError

if TYPE_CHECKING:  # torch.distributed may be unavailable (then ProcessGroup is missing)
    from torch.distributed import ProcessGroup

__all__ = ["AUTO", "resolve_group", "is_dtensor", "agree_found", "global_squared_norm",
           "agree_flags_"]

AUTO = "auto"
"""`process_group=AUTO` (the default): the default group when torch.distributed is initialized
with more than one rank, else no agreement at all (the single-process step is unchanged)."""


def is_dtensor(t: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def resolve_group(process_group: Union[ProcessGroup, str, None],
                  sharded_params: Sequence[torch.Tensor], owner: str) -> Optional[ProcessGroup]:
    """The group the step agrees over, or None; checks it against the sharded parameters.

    Raises:
        ConfigError: a value that is not a ProcessGroup, None or "auto"; sharded parameters with
            no group while more than one rank runs; a DTensor on a mesh that is not 1-D.
    """
    group = _pick_group(process_group, owner)
    for p in sharded_params:
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ConfigError(f"{owner}: a parameter of shape {tuple(p.shape)} is a DTensor on a "
                              f"{mesh.ndim}-D device mesh; only 1-D meshes (FSDP2's "
                              "fully_shard over one group) are supported")
        if group is None and mesh.size() > 1:
            raise ConfigError(f"{owner}: process_group=None, but parameters are sharded over "
                              f"{mesh.size()} ranks: the overflow flag and the gradient norm must "
                              "be reduced over them; leave process_group='auto' or pass the group")
        if group is not None and mesh.size() != dist.get_world_size(group):
            raise ConfigError(f"{owner}: parameters are sharded over {mesh.size()} ranks but "
                              f"process_group has {dist.get_world_size(group)}; pass the mesh's "
                              "group (mesh.get_group())")
    return group


def _pick_group(process_group: object, owner: str) -> Optional[ProcessGroup]:
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != AUTO:
            raise ConfigError(f"{owner}: process_group={process_group!r} is not 'auto', None or "
                              "a torch.distributed ProcessGroup")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise ConfigError(f"{owner}: process_group={process_group!r} is not 'auto', None or a "
                          "torch.distributed ProcessGroup")
    return None if dist.get_world_size(process_group) < 2 else process_group


def agree_found(found: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The overflow flag OR-ed over the group (a traced all-reduce, no host read)."""
    return functional_all_reduce(found.float(), "max", group) != 0


def global_squared_norm(grads: Sequence[torch.Tensor], sharded: Sequence[bool],
                        group: ProcessGroup) -> torch.Tensor:
    """Sum of squares of all gradients: the sharded buckets' part summed over the group, the
    replicated buckets' part (identical on every rank) added once."""
    squares = [g.float().square().sum() for g in grads]
    local = sum(s for s, shard in zip(squares, sharded) if shard)
    replicated = sum(s for s, shard in zip(squares, sharded) if not shard)
    return functional_all_reduce(local, "sum", group) + replicated


def agree_flags_(flags: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """OR each 0-dim bool flag over the group in place (eager; one collective for all)."""
    if not flags:
        return
    stacked = torch.stack([f.float() for f in flags])
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    for flag, value in zip(flags, stacked.unbind()):
        flag.copy_(value != 0)
