"""Apex opt levels as a frozen, validated, hashable configuration.

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

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.float8.config import Float8Config, as_float8_config
from fxamp.policy import LOW_DTYPES, OVERRIDE_CHOICES, PRESETS, NodePolicy
from fxamp.policy.names import check_override_key, override_key

__all__ = ["AmpConfig", "OPT_LEVELS"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")

# Apex's table (../shared/reference/AMP_SEMANTICS.md). `None` for cast_model_type means
# "the low-precision dtype" for O2/O3; O0 casts to fp32; O1 leaves the weights alone.
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

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def _as_dtype(value: Any, what: str, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    dtype = _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ConfigError(f"{what}={value!r} is not one of {names}")
    return dtype


def _as_model_type(value: Any) -> Union[torch.dtype, bool]:
    # Apex casts the model only `if properties.cast_model_type:`, so False (multi-model and
    # fine-tuning scripts pass it) means "leave the model's dtypes alone" at every level.
    if value is False:
        return False
    if value is True or value in ("True", "False"):
        raise ConfigError(f"cast_model_type={value!r} must be a dtype (torch.float16, "
                          "torch.bfloat16, torch.float32) or False (the bool: leave the model's "
                          "dtypes alone)")
    return _as_dtype(value, "cast_model_type", (torch.float32, *LOW_DTYPES))


def _as_bool(value: Any, what: str) -> bool:
    # Apex accepts the strings "True"/"False" because its launch scripts pass argv through.
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ConfigError(f"{what}={value!r} must be True, False, 'True' or 'False'")


def _as_loss_scale(value: Any) -> Union[float, str]:
    if value == "dynamic" and isinstance(value, str):
        return "dynamic"
    if isinstance(value, str):  # Apex's launch scripts pass "128.0" through from argv
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"loss_scale={value!r} must be a positive number, a numeric "
                              "string or 'dynamic'") from None
    return validation.positive_finite(value, "loss_scale", " or 'dynamic'")


def _check_scaler_bounds(min_scale: Any, max_scale: Any) -> None:
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


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Everything the fxamp passes and optimizers need to know, validated at construction.

    Build one with `AmpConfig.from_opt_level`; the constructor takes already-resolved values.

    Attributes:
        opt_level: "O0" … "O3".
        dtype: the low-precision dtype (float16 or bfloat16); None until `resolve` picks the
            device default (float16 on CUDA, bfloat16 on CPU).
        cast_model_type: the dtype parameters and buffers are stored in, or None to leave them
            (at O2/O3 None becomes `dtype` when resolved); False leaves them at every level and
            casts neither inputs nor outputs (Apex's `cast_model_type=False`).
        patch_torch_functions: O1's per-op casting (kept under Apex's name).
        keep_batchnorm_fp32: O2/O3: keep BatchNorm parameters, buffers and math in fp32.
        master_weights: keep fp32 master copies of low-precision parameters in the optimizer.
        loss_scale: a positive number or "dynamic".
        cast_model_outputs: dtype floating outputs are cast to; None means fp32 at O2/O3 and
            unchanged at O0/O1.
        policy: op-table preset, "torch-cuda", "torch-cpu" or "apex"; None picks the torch
            preset of the device.
        custom_policy: a `fxamp.policy.NodePolicy` consulted before the preset (from_opt_level
            takes it as `policy=`), or None.
        op_overrides: (op, policy) pairs; op is an ATen overload or packet name like
            "aten.softmax" or "aten.softmax.int" (checked against this torch build).
        module_overrides: (module-path pattern or module class name, policy) pairs.
        min_loss_scale, max_loss_scale, num_losses: loss-scaler settings (Apex names).
        device_type: the compute device ("cpu", "cuda"); only its tensors are cast.
        float8: a Float8Config to run the model's GEMMs in float8 on top of O1/O2/O3
            (docs/float8.md), or None.
    """

    opt_level: str = "O1"
    dtype: Optional[torch.dtype] = None
    cast_model_type: Union[torch.dtype, None, bool] = None
    patch_torch_functions: bool = True
    keep_batchnorm_fp32: Optional[bool] = None
    master_weights: Optional[bool] = None
    loss_scale: Union[float, str] = "dynamic"
    cast_model_outputs: Optional[torch.dtype] = None
    policy: Optional[str] = None
    op_overrides: tuple[tuple[str, str], ...] = ()
    module_overrides: tuple[tuple[str, str], ...] = ()
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = 2.0**24
    num_losses: int = 1
    device_type: Optional[str] = None
    float8: Optional[Float8Config] = None
    custom_policy: Optional[NodePolicy] = None

    def __post_init__(self) -> None:
        check_opt_level(self.opt_level)
        if self.float8 is not None and not isinstance(self.float8, Float8Config):
            raise ConfigError(f"float8={self.float8!r} must be a fxamp.Float8Config or None")
        if self.float8 is not None and self.opt_level == "O0":
            raise ConfigError("float8 runs GEMMs in float8 on top of a mixed-precision level: "
                              "use opt_level='O1' or 'O2' (O0 is the fp32 baseline)")
        if self.dtype is not None:
            _as_dtype(self.dtype, "dtype", LOW_DTYPES)
        self._check_policies()
        if type(self.num_losses) is not int or self.num_losses < 1:
            raise ConfigError(f"num_losses={self.num_losses!r} must be a positive int (1, 2, ...)")
        if self.loss_scale != "dynamic":
            _as_loss_scale(self.loss_scale)
        _check_scaler_bounds(self.min_loss_scale, self.max_loss_scale)
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
            if self.master_weights is not None:
                raise ConfigError(
                    "master_weights cannot be set with O1: O1 keeps the model's weights in "
                    "fp32, so they are their own master weights"
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
    ) -> "AmpConfig":
        """The preset of an Apex opt level with Apex-style overrides (any non-None value wins).

        `policy` is a preset name or a `fxamp.policy.NodePolicy` (stored as `custom_policy`,
        with the device's preset behind it).

        Raises:
            ConfigError: for an unknown level or an override that Apex refuses, with the
                reason and the valid choices in the message.
        """
        preset = dict(_PRESETS[check_opt_level(opt_level)])
        low = None if dtype is None else _as_dtype(dtype, "dtype", LOW_DTYPES)
        if cast_model_type is not None:
            preset["cast_model_type"] = _as_model_type(cast_model_type)
            if low is None and preset["cast_model_type"] in LOW_DTYPES:
                low = preset["cast_model_type"]
        elif opt_level == "O1":
            preset["cast_model_type"] = None
        if patch_torch_functions is not None:
            preset["patch_torch_functions"] = _as_bool(patch_torch_functions,
                                                       "patch_torch_functions")
        if keep_batchnorm_fp32 is not None:
            preset["keep_batchnorm_fp32"] = _as_bool(keep_batchnorm_fp32, "keep_batchnorm_fp32")
        if master_weights is not None:
            preset["master_weights"] = _as_bool(master_weights, "master_weights")
        if loss_scale is not None:
            preset["loss_scale"] = _as_loss_scale(loss_scale)
        if preset["cast_model_type"] == "low":
            preset["cast_model_type"] = low  # filled in by resolve() when still None
        if opt_level == "O1":
            # Apex compares the *override*, not the preset value, for these two.
            preset["keep_batchnorm_fp32"] = keep_batchnorm_fp32
            preset["master_weights"] = master_weights
        return cls(
            opt_level=opt_level,
            dtype=low,
            cast_model_outputs=None if cast_model_outputs is None else _as_dtype(
                cast_model_outputs, "cast_model_outputs", (torch.float32, *LOW_DTYPES)),
            policy=None if isinstance(policy, NodePolicy) else policy,
            custom_policy=policy if isinstance(policy, NodePolicy) else None,
            op_overrides=_freeze_overrides(op_overrides),
            module_overrides=_freeze_overrides(module_overrides),
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            num_losses=num_losses,
            float8=as_float8_config(float8),
            **preset,
        )

    @property
    def is_resolved(self) -> bool:
        return None not in (self.dtype, self.policy, self.device_type)

    def resolve(self, device_type: str) -> "AmpConfig":
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
        fields = ((f.name, str(getattr(self, f.name))) for f in dataclasses.fields(self))
        return hashlib.sha256(repr(tuple(fields)).encode()).hexdigest()[:16]


def _freeze_overrides(overrides: Optional[Mapping[Any, str]]) -> tuple[tuple[str, str], ...]:
    if not overrides:
        return ()
    items = []  # in the caller's order: the first matching entry wins
    for key, choice in overrides.items():
        key = key.__name__ if isinstance(key, type) else override_key(key)
        items.append((key, choice))
    return tuple(items)
