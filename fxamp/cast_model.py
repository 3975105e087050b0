"""Store a module's parameters and buffers in the dtype its opt level asks for (O0, O2, O3).

This is the one place fxamp changes a model outside a graph: O2/O3 save memory only if the
weights themselves are 16-bit, which no graph pass can do. Parameters keep their identity
(`param.data` is replaced), so optimizers built earlier still hold them.
"""

from __future__ import annotations

import fnmatch
from typing import Optional

import torch

from fxamp.config import LOW_DTYPES, AmpConfig

__all__ = ["cast_model", "storage_dtype"]

_BATCH_NORM = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)


def _overridden_fp32(name: str, module: torch.nn.Module, config: AmpConfig) -> bool:
    for pattern, choice in config.module_overrides:
        if pattern == type(module).__name__ or fnmatch.fnmatchcase(name, pattern):
            return choice == "fp32"
    return False


def storage_dtype(name: str, module: torch.nn.Module, config: AmpConfig) -> Optional[torch.dtype]:
    """dtype the module's own floating tensors are stored in, or None to leave them."""
    target = config.cast_model_type
    if target in LOW_DTYPES:
        if isinstance(module, _BATCH_NORM) and config.keep_batchnorm_fp32:
            return torch.float32
        if _overridden_fp32(name, module, config):
            return torch.float32
    return target


def _state_dict_in_fp32(module, state_dict, prefix, local_metadata) -> None:
    # Apex O2 returned fp32 weights from model.state_dict(), so checkpoints stay portable.
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.dtype in LOW_DTYPES:
            state_dict[key] = value.float()


def cast_model(model: torch.nn.Module, config: AmpConfig) -> int:
    """Cast floating (non-fp64) parameters and buffers in place; returns how many changed."""
    changed = 0
    for name, module in model.named_modules():
        dtype = storage_dtype(name, module, config)
        if dtype is None:
            continue
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        for tensor in tensors:
            if (tensor is not None and tensor.is_floating_point()
                    and tensor.dtype not in (torch.float64, dtype)):
                tensor.data = tensor.data.to(dtype)
                changed += 1
    if config.cast_model_type in LOW_DTYPES:
        model.register_state_dict_post_hook(_state_dict_in_fp32)
    return changed
