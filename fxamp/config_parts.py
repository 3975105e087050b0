"""The two parts of an AmpConfig: what the graph passes depend on (`GraphConfig`, the
backend's compile identity) and what the optimizer and its loss scalers depend on
(`ScalerConfig`). `AmpConfig.from_opt_level` composes them from Apex's keywords; a change to a
loss-scale setting never changes a model's compiled graphs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Union

import torch

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.float8.config import Float8Config
from fxamp.policy import LOW_DTYPES, OVERRIDE_CHOICES, PRESETS, NodePolicy
from fxamp.policy.names import check_override_key

__all__ = ["GraphConfig", "ScalerConfig", "OPT_LEVELS", "check_opt_level", "as_dtype",
           "as_bool", "as_loss_scale", "as_model_type"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def as_dtype(value: Any, what: str, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    dtype = _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ConfigError(f"{what}={value!r} is not one of {names}")
    return dtype


def as_model_type(value: Any) -> Union[torch.dtype, bool]:
    # Apex casts the model only `if properties.cast_model_type:`, so False (multi-model and
    # fine-tuning scripts pass it) means "leave the model's dtypes alone" at every level.
    if value is False:
        return False
    if value is True or value in ("True", "False"):
        raise ConfigError(f"cast_model_type={value!r} must be a dtype (torch.float16, "
                          "torch.bfloat16, torch.float32) or False (the bool: leave the model's "
                          "dtypes alone)")
    return as_dtype(value, "cast_model_type", (torch.float32, *LOW_DTYPES))


def as_bool(value: Any, what: str) -> bool:
    # Apex accepts the strings "True"/"False" because its launch scripts pass argv through.
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ConfigError(f"{what}={value!r} must be True, False, 'True' or 'False'")


def as_loss_scale(value: Any) -> Union[float, str]:
    if value == "dynamic" and isinstance(value, str):
        return "dynamic"
    if isinstance(value, str):  # Apex's launch scripts pass "128.0" through from argv
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"loss_scale={value!r} must be a positive number, a numeric "
                              "string or 'dynamic'") from None
    return validation.positive_finite(value, "loss_scale", " or 'dynamic'")


def check_scaler_bounds(min_scale: Any, max_scale: Any) -> None:
    if min_scale is not None:
        validation.positive_finite(min_scale, "min_loss_scale",
                                   " or None (the default floor, 1.0)")
    if max_scale is not None:
        validation.positive_finite(max_scale, "max_loss_scale", " or None (no cap)")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:
        raise ConfigError(f"min_loss_scale={min_scale!r} exceeds max_loss_scale={max_scale!r}; "
                          "the floor must be <= the cap")


def check_opt_level(opt_level: Any) -> str:
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if isinstance(opt_level, str) and opt_level.upper().replace("0", "O", 1) in OPT_LEVELS:
        hint = (" (the prefix is the letter O, not the number zero)" if opt_level[:1] == "0"
                else " (the prefix is an upper-case letter O)")
    raise ConfigError(f"opt_level {opt_level!r} is not one of 'O0', 'O1', 'O2', 'O3'{hint}")


def _digest(config: Any) -> str:
    """A digest that is stable across processes (dtype objects hash by id)."""
    fields = ((f.name, str(getattr(config, f.name))) for f in dataclasses.fields(config))
    return hashlib.sha256(repr(tuple(fields)).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    """What the graph passes, the model's cast and the backend depend on (AmpConfig's
    attributes of the same names document them); the backend keys on this part only."""

    opt_level: str = "O1"
    dtype: Optional[torch.dtype] = None
    cast_model_type: Union[torch.dtype, None, bool] = None
    patch_torch_functions: bool = True
    keep_batchnorm_fp32: Optional[bool] = None
    cast_model_outputs: Optional[torch.dtype] = None
    policy: Optional[str] = None
    custom_policy: Optional[NodePolicy] = None
    op_overrides: tuple[tuple[str, str], ...] = ()
    module_overrides: tuple[tuple[str, str], ...] = ()
    device_type: Optional[str] = None
    float8: Optional[Float8Config] = None
    plan_reasons: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_opt_level(self.opt_level)
        if not isinstance(self.plan_reasons, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p)
                for p in self.plan_reasons):
            raise ConfigError(f"plan_reasons={self.plan_reasons!r} must be a tuple of (module "
                              "path, reason) string pairs (PrecisionPlan.reasons())")
        if self.float8 is not None and not isinstance(self.float8, Float8Config):
            raise ConfigError(f"float8={self.float8!r} must be a fxamp.Float8Config or None")
        if self.float8 is not None and self.opt_level == "O0":
            raise ConfigError("float8 runs GEMMs in float8 on top of a mixed-precision level: "
                              "use opt_level='O1' or 'O2' (O0 is the fp32 baseline)")
        if self.dtype is not None:
            as_dtype(self.dtype, "dtype", LOW_DTYPES)
        self._check_policies()
        self._check_apex_overrides()

    def _check_policies(self) -> None:
        if self.policy is not None and self.policy not in PRESETS:
            raise ConfigError(f"policy={self.policy!r} is not one of {', '.join(PRESETS)} "
                              "or an object with a policy_for(node) method (fxamp.policy."
                              "NodePolicy)")
        if self.custom_policy is not None and not isinstance(self.custom_policy, NodePolicy):
            raise ConfigError(f"custom_policy={self.custom_policy!r} has no policy_for(node) "
                              "method (fxamp.policy.NodePolicy)")
        choices = ", ".join(c.value for c in OVERRIDE_CHOICES)
        for what, pairs in (("op_overrides", self.op_overrides),
                            ("module_overrides", self.module_overrides)):
            for key, choice in pairs:
                if choice not in OVERRIDE_CHOICES:
                    raise ConfigError(f"{what}[{key!r}]={choice!r} is not one of {choices}")
        for key, _ in self.op_overrides:
            check_override_key(key)

    def _check_apex_overrides(self) -> None:
        level = self.opt_level
        if level == "O1":
            if self.cast_model_type not in (None, False, torch.float32):
                raise ConfigError(
                    f"O1 inserts casts around ops rather than casting the model weights, so "
                    f"cast_model_type={self.cast_model_type} is not allowed with O1; "
                    "use O2 or O3 to store the model in a low-precision dtype"
                )
            if self.keep_batchnorm_fp32 is not None:
                raise ConfigError(
                    "keep_batchnorm_fp32 cannot be set with O1: O1 leaves all weights in fp32 "
                    "and the op tables already decide batch_norm's dtype"
                )
        elif self.patch_torch_functions:
            raise ConfigError(
                f"patch_torch_functions=True (per-op casting) is only valid with O1, not {level}"
            )
        if self.cast_model_type in LOW_DTYPES and self.dtype not in (None, self.cast_model_type):
            raise ConfigError(
                f"cast_model_type={self.cast_model_type} conflicts with dtype={self.dtype}: "
                "the model is stored in the dtype it computes in"
            )

    def plan_reason(self, path: str) -> Optional[str]:
        """Why a PrecisionPlan chose what it did for module `path`, or None."""
        return dict(self.plan_reasons).get(path or "<root>")

    @property
    def is_resolved(self) -> bool:
        return None not in (self.dtype, self.policy, self.device_type)

    def resolve(self, device_type: str) -> "GraphConfig":
        """Fill in the device defaults: fp16 + the torch-cuda preset on CUDA, bf16 +
        torch-cpu on CPU (and on other devices)."""
        dtype = self.dtype or (torch.float16 if device_type == "cuda" else torch.bfloat16)
        policy = self.policy or ("torch-cuda" if device_type == "cuda" else "torch-cpu")
        cast_model_type = self.cast_model_type
        if self.opt_level in ("O2", "O3") and cast_model_type is None:
            cast_model_type = dtype
        return dataclasses.replace(self, dtype=dtype, policy=policy, device_type=device_type,
                                   cast_model_type=cast_model_type)

    @property
    def model_dtype(self) -> Optional[torch.dtype]:
        """dtype the model's floating inputs, parameters and buffers are cast to, or None to
        leave them (O1, and `cast_model_type=False`)."""
        return None if self.cast_model_type is False else self.cast_model_type

    @property
    def output_dtype(self) -> Optional[torch.dtype]:
        """dtype floating model outputs are cast to, or None to leave them."""
        if self.cast_model_outputs is not None:
            return self.cast_model_outputs
        if self.cast_model_type is False:  # Apex patched no forward then
            return None
        return torch.float32 if self.opt_level in ("O2", "O3") else None

    def cache_key(self) -> str:
        """A digest that is stable across processes (dtype objects hash by id)."""
        return _digest(self)


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """What the optimizer and its loss scalers depend on (Apex's names): fp32 master weights,
    the loss scale ("dynamic" or a number), its floor and cap, and the number of losses."""

    master_weights: Optional[bool] = None
    loss_scale: Union[float, str] = "dynamic"
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = 2.0**24
    num_losses: int = 1

    def __post_init__(self) -> None:
        if type(self.num_losses) is not int or self.num_losses < 1:
            raise ConfigError(f"num_losses={self.num_losses!r} must be a positive int (1, 2, ...)")
        if self.loss_scale != "dynamic":
            as_loss_scale(self.loss_scale)
        check_scaler_bounds(self.min_loss_scale, self.max_loss_scale)

    def cache_key(self) -> str:
        return _digest(self)
