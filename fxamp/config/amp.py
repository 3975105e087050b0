"""AmpConfig: Apex's opt levels as a frozen, validated, hashable configuration.

`AmpConfig.from_opt_level("O2", keep_batchnorm_fp32=False)` reproduces `apex.amp.initialize`'s
property table and its override checks. A config is complete once `resolve(device_type)` has
filled in the defaults that depend on the device (the low-precision dtype and the op-policy
preset); only resolved configs reach the graph passes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Optional, Union

import torch

from fxamp.config.graph import GraphConfig
from fxamp.config.keywords import (as_bool, as_dtype, as_loss_scale, as_model_type, as_outputs,
                                   check_opt_level)
from fxamp.config.scaler import ScalerConfig
from fxamp.errors import ConfigError
from fxamp.float8.config import as_float8_config
from fxamp.policy import LOW_DTYPES, NodePolicy
from fxamp.policy.names import override_key

__all__ = ["AmpConfig"]

# Apex amp's opt-level table (https://nvidia.github.io/apex/amp.html). `None` for
# cast_model_type means "the low-precision dtype" for O2/O3; O0 casts to fp32; O1 leaves the
# weights alone.
_PRESETS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type="low", patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="low", patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


class PartField:
    """A read-only attribute of AmpConfig: the field of the same name of its `graph` or
    `scaler` part, where it is documented."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = f"`config.{self.part}.{name}`."

    def __get__(self, config: Optional["AmpConfig"], owner: Optional[type] = None) -> Any:
        if config is None:
            return self
        return getattr(getattr(config, self.part), self.name)


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Everything the fxamp passes and optimizers need to know, validated at construction.

    Build one with `AmpConfig.from_opt_level`.

    Attributes:
        graph: what the model's graphs depend on, the backend's compile identity (a
            GraphConfig, whose docstring documents each field).
        scaler: what the optimizer and its loss scalers depend on (a ScalerConfig, likewise).

    Every field of the two parts is also an attribute of the config, read-only:
    `config.opt_level` is `config.graph.opt_level`, `config.loss_scale` is
    `config.scaler.loss_scale`.
    """

    graph: GraphConfig = GraphConfig()
    scaler: ScalerConfig = ScalerConfig()

    def __post_init__(self) -> None:
        if self.graph.opt_level == "O1" and self.scaler.master_weights is not None:
            raise ConfigError(
                "master_weights cannot be set with O1: O1 keeps the model's weights in "
                "fp32, so they are their own master weights"
            )

    # The parts' fields by name (not dataclass fields: no annotation). tests/test_config.py
    # checks that every field of both parts is here.
    opt_level = PartField("graph")
    dtype = PartField("graph")
    cast_model_type = PartField("graph")
    patch_torch_functions = PartField("graph")
    keep_batchnorm_fp32 = PartField("graph")
    cast_model_outputs = PartField("graph")
    policy = PartField("graph")
    custom_policy = PartField("graph")
    op_overrides = PartField("graph")
    module_overrides = PartField("graph")
    device_type = PartField("graph")
    float8 = PartField("graph")
    plan_reasons = PartField("graph")
    model_boundary = PartField("graph")
    master_weights = PartField("scaler")
    loss_scale = PartField("scaler")
    min_loss_scale = PartField("scaler")
    max_loss_scale = PartField("scaler")
    num_losses = PartField("scaler")

    @classmethod
    def from_opt_level(
        cls,
        opt_level: str = "O1",
        *,
        dtype: Any = None,
        cast_model_type: Any = None,
        patch_torch_functions: Optional[bool] = None,
        keep_batchnorm_fp32: Any = None,
        master_weights: Optional[bool] = None,
        loss_scale: Any = None,
        cast_model_outputs: Any = None,
        policy: Union[str, NodePolicy, None] = None,
        op_overrides: Optional[Mapping[Any, str]] = None,
        module_overrides: Optional[Mapping[Any, str]] = None,
        min_loss_scale: Optional[float] = None,
        max_loss_scale: float = 2.0**24,
        num_losses: int = 1,
        float8: Any = None,
        plan_reasons: tuple[tuple[str, str], ...] = (),
        model_boundary: str = "call",
    ) -> "AmpConfig":
        """The preset of an Apex opt level with Apex-style overrides (any non-None value wins).

        `policy` is a preset name or a `fxamp.policy.NodePolicy` (stored as `custom_policy`,
        with the device's preset behind it).

        Raises:
            ConfigError: for an unknown level or an override that Apex refuses, with the
                reason and the valid choices in the message.
        """
        preset = dict(_PRESETS[check_opt_level(opt_level)])
        low = None if dtype is None else as_dtype(dtype, "dtype", LOW_DTYPES)
        if cast_model_type is not None:
            preset["cast_model_type"] = as_model_type(cast_model_type)
            if low is None and preset["cast_model_type"] in LOW_DTYPES:
                low = preset["cast_model_type"]
        elif opt_level == "O1":
            preset["cast_model_type"] = None
        if patch_torch_functions is not None:
            preset["patch_torch_functions"] = as_bool(patch_torch_functions,
                                                       "patch_torch_functions")
        if keep_batchnorm_fp32 is not None:
            preset["keep_batchnorm_fp32"] = as_bool(keep_batchnorm_fp32, "keep_batchnorm_fp32")
        if master_weights is not None:
            preset["master_weights"] = as_bool(master_weights, "master_weights")
        if loss_scale is not None:
            preset["loss_scale"] = as_loss_scale(loss_scale)
        if preset["cast_model_type"] == "low":
            preset["cast_model_type"] = low  # filled in by resolve() when still None
        if opt_level == "O1":
            # Apex compares the *override*, not the preset value, for these two.
            preset["keep_batchnorm_fp32"] = keep_batchnorm_fp32
            preset["master_weights"] = master_weights
        graph = GraphConfig(
            opt_level=opt_level,
            dtype=low,
            cast_model_type=preset["cast_model_type"],
            patch_torch_functions=preset["patch_torch_functions"],
            keep_batchnorm_fp32=preset["keep_batchnorm_fp32"],
            cast_model_outputs=None if cast_model_outputs is None else as_outputs(
                cast_model_outputs),
            policy=None if isinstance(policy, NodePolicy) else policy,
            custom_policy=policy if isinstance(policy, NodePolicy) else None,
            op_overrides=_freeze_overrides(op_overrides),
            module_overrides=_freeze_overrides(module_overrides),
            float8=as_float8_config(float8),
            plan_reasons=tuple(plan_reasons),
            model_boundary=model_boundary,
        )
        scaler = ScalerConfig(master_weights=preset["master_weights"],
                              loss_scale=preset["loss_scale"], min_loss_scale=min_loss_scale,
                              max_loss_scale=max_loss_scale, num_losses=num_losses)
        return cls(graph, scaler)

    @property
    def is_resolved(self) -> bool:
        return self.graph.is_resolved

    def resolve(self, device_type: str) -> "AmpConfig":
        """Fill in the device defaults: fp16 + the torch-cuda preset on CUDA, bf16 +
        torch-cpu on CPU (and on other devices)."""
        return dataclasses.replace(self, graph=self.graph.resolve(device_type))

    @property
    def model_dtype(self) -> Optional[torch.dtype]:
        """dtype the model's floating inputs, parameters and buffers are cast to, or None."""
        return self.graph.model_dtype

    @property
    def output_dtype(self) -> Optional[torch.dtype]:
        """dtype floating model outputs are cast to, or None to leave them."""
        return self.graph.output_dtype

    def cache_key(self) -> str:
        """A digest of both parts, stable across processes (the backend keys on
        `graph.cache_key()` alone)."""
        parts = self.graph.cache_key() + self.scaler.cache_key()
        return hashlib.sha256(parts.encode()).hexdigest()[:16]


def _freeze_overrides(overrides: Optional[Mapping[Any, str]]) -> tuple[tuple[str, str], ...]:
    if not overrides:
        return ()
    items = []  # in the caller's order: the first matching entry wins
    for key, choice in overrides.items():
        key = key.__name__ if isinstance(key, type) else override_key(key)
        items.append((key, choice))
    return tuple(items)
