"""Checks of what a fused optimizer is built from: its parameter groups and hyperparameters,
with torch.optim's rules but fxamp's errors (named value, valid range), before anything is
flattened."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim.optimizer import ParamsT

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.optim.distributed import is_dtensor
from fxamp.optim.buffers.grouping import check_group_params

__all__ = ["as_param_list", "check_new_group", "check_added_group", "check_hyperparameters",
           "check_has_params", "check_max_grad_norm"]

_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening")


def as_param_list(params: ParamsT, owner: str) -> list:
    """`params` as a list (it may be a generator), refusing an empty one as torch.optim does."""
    if isinstance(params, torch.Tensor):
        return [params]
    params = list(params)
    if not params:
        raise ConfigError(f"{owner} got an empty parameter list: pass model.parameters() or "
                          "param groups [{'params': [...]}, ...]")
    return params


def check_new_group(group: Any, groups: list[dict], owner: str) -> None:
    """A dict of parameters that are each listed once, and in no earlier group."""
    if not isinstance(group, dict) or "params" not in group:
        raise ConfigError(f"{owner}: a param group is a dict with a 'params' entry, not "
                          f"{type(group).__name__}")
    group["params"] = [group["params"]] if isinstance(group["params"], torch.Tensor) \
        else list(group["params"])
    index = len(groups)
    first: dict[int, str] = {id(_tensor_of(p)): f"param group {gi}, position {pi}"
                             for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])}
    for pi, entry in enumerate(group["params"]):
        where = f"param group {index}, position {pi}"
        p = _tensor_of(entry)
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"{owner}: the entry at {where} is a {type(p).__name__}, not a "
                              "parameter tensor")
        if id(p) in first:
            raise ConfigError(f"{owner}: the parameter at {where} (shape {tuple(p.shape)}) is "
                              f"also at {first[id(p)]}; list each parameter once (a flat buffer "
                              "holds one copy of it)")
        first[id(p)] = where


def check_added_group(group: dict, index: int, owner: str, device: torch.device) -> None:
    """A group added after construction (its defaults filled in): hyperparameters, and
    parameters the flat buffers can take."""
    params = [_tensor_of(p) for p in group["params"]]
    check_hyperparameters(group, index, owner)
    check_group_params({"params": params}, index, owner, device)
    if any(is_dtensor(p) for p in params):
        raise ConfigError(f"{owner}: param group {index} holds sharded (DTensor) parameters; "
                          "add_param_group after construction takes unsharded ones only: "
                          "build the optimizer with all the groups under FSDP2")


def _tensor_of(entry: Any) -> Any:
    # torch.optim takes (name, parameter) pairs too.
    return entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry


def check_hyperparameters(group: dict, index: int, owner: str) -> None:
    """torch.optim's ranges: lr, eps, weight_decay, momentum, dampening >= 0; betas in [0, 1)."""
    prefix = "" if index == 0 else f"param group {index}: "
    for key in _NON_NEGATIVE:
        value = group.get(key)
        if value is None or (key == "lr" and isinstance(value, torch.Tensor)):
            continue
        try:
            validation.non_negative(value, key)
        except ConfigError as e:
            raise ConfigError(f"{owner}: {prefix}{e}") from None
    betas = group.get("betas")
    if betas is not None and not _are_betas(betas):
        raise ConfigError(f"{owner}: {prefix}betas={betas!r} must be two numbers in [0, 1)")


def _are_betas(betas: Any) -> bool:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return False
    try:
        return all(0 <= validation.real(b, "betas", "") < 1 for b in betas)
    except ConfigError:
        return False


def check_has_params(groups: list[dict], owner: str) -> None:
    if not any(group["params"] for group in groups):
        raise ConfigError(f"{owner} got {len(groups)} param group(s) with no parameters in any "
                          "of them: pass the model's parameters")


def check_max_grad_norm(value: Any) -> Optional[float]:
    if value is None:
        return None
    return validation.positive_finite(value, "max_grad_norm", " or None (no clipping)")
