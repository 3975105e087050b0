"""nn.Module internals (own tensors, the compiled-call slot, norm bases), autocast targets."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# The targets pre-dispatch tracing records for `with torch.autocast(...)` regions.
# Checked on 2.11.0, 2.13.0, 2.14.1.
ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast

# Base classes of BatchNorm1d/2d/3d (and SyncBatchNorm) and InstanceNorm1d/2d/3d.
# Checked on 2.11.0, 2.13.0, 2.14.1.
NORM_MODULE_TYPES = (torch.nn.modules.batchnorm._BatchNorm,
                     torch.nn.modules.instancenorm._InstanceNorm)

# The slot `nn.Module.compile` fills and `nn.Module.__call__` runs instead of `_call_impl`
# (hooks included). Checked on 2.11.0, 2.13.0, 2.14.1.
COMPILED_CALL_ATTR = "_compiled_call_impl"


def call_impl(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module(*args, **kwargs)` with its hooks but without its compiled call (which would call
    back into the caller). Checked on 2.11.0, 2.13.0, 2.14.1."""
    return module._call_impl(*args, **kwargs)


def set_compiled_call(module: torch.nn.Module, fn: Callable) -> None:
    """Make `module(...)` run `fn`, as `module.compile()` makes it run its compiled forward.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    setattr(module, COMPILED_CALL_ATTR, fn)


def own_tensors(module: torch.nn.Module) -> list[Optional[torch.Tensor]]:
    """The module's own (not its children's) parameters and buffers, None entries included.
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    return list(module._parameters.values()) + list(module._buffers.values())
