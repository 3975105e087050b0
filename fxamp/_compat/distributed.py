"""DDP's and FSDP2's internals, functional collectives."""

from __future__ import annotations

from typing import Any, Optional

import torch

def fsdp_module_class() -> Optional[type]:
    """FSDP2's `FSDPModule` (every `fully_shard`-ed module is one), or None without
    torch.distributed. Checked on 2.11.0, 2.13.0, 2.14.1."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def unsharded_class(cls: Any) -> Any:
    """The class `fully_shard` derived `cls` from (it swaps a module's class for a new
    `FSDP<Name>(FSDPModule, <Name>)`), or `cls` itself. Checked on 2.11.0, 2.13.0, 2.14.1."""
    fsdp = fsdp_module_class()
    if fsdp is None or not isinstance(cls, type) or cls is fsdp or not issubclass(cls, fsdp):
        return cls
    return next((base for base in cls.__bases__ if base is not fsdp), cls)


def active_ddp_module() -> Optional[torch.nn.Module]:
    """The DistributedDataParallel whose forward Dynamo is tracing now, if any.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    getter = getattr(ddp_type, "_get_active_ddp_module", None)
    return None if getter is None else getter()


def ddp_bucket_dtypes(ddp: torch.nn.Module) -> Optional[set[torch.dtype]]:
    """The dtypes DDP's reducer reduces gradients in (None before it has buckets).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_get_zeros_like_grad_buckets"):
        return None
    return {b.buffer().dtype for b in reducer._get_zeros_like_grad_buckets()}


def functional_all_reduce(tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """An all-reduce Dynamo traces into the graph (no host sync, no in-place collective).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch.distributed._functional_collectives import all_reduce

    return all_reduce(tensor, op, group)
