"""The part of an AmpConfig the graph passes, the model's cast and the backend depend on (the
backend's compile identity)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from fxamp.config.keywords import as_dtype, check_opt_level, digest
from fxamp.errors import ConfigError
from fxamp.float8.config import Float8Config
from fxamp.policy import LOW_DTYPES, OVERRIDE_CHOICES, PRESETS, NodePolicy
from fxamp.policy.names import check_override_key

__all__ = ["GraphConfig"]

_BOUNDARIES = ("call", "modules")


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    """What the graph passes, the model's cast and the backend depend on; the backend keys on
    this part only. Built by `AmpConfig.from_opt_level`; each field is also an attribute of
    the AmpConfig (`config.opt_level` is `config.graph.opt_level`).

    Attributes:
        opt_level: "O0" … "O3".
        dtype: the low-precision dtype (float16 or bfloat16); None until `resolve` picks the
            device default (float16 on CUDA, bfloat16 on CPU).
        cast_model_type: the dtype parameters and buffers are stored in, or None to leave them
            (at O2/O3 None becomes `dtype` when resolved); False leaves them at every level and
            casts neither inputs nor outputs (Apex's `cast_model_type=False`).
        patch_torch_functions: O1's per-op casting (kept under Apex's name).
        keep_batchnorm_fp32: O2/O3: keep BatchNorm parameters, buffers and math in fp32.
        cast_model_outputs: dtype floating outputs are cast to, or False to leave them as
            computed; None means fp32 at O1/O2/O3 (Note [O1's outputs are fp32]) and unchanged
            at O0 and, at O1, where `model_boundary` is "modules".
        policy: op-table preset, "torch-cuda", "torch-cpu" or "apex"; None picks the torch
            preset of the device.
        custom_policy: a `fxamp.policy.NodePolicy` consulted before the preset (from_opt_level
            takes it as `policy=`), or None.
        op_overrides: (op, policy) pairs; op is an ATen overload or packet name like
            "aten.softmax" or "aten.softmax.int" (checked against this torch build).
        module_overrides: (module-path pattern or module class name, policy) pairs.
        device_type: the compute device ("cpu", "cuda"); only its tensors are cast. None until
            `resolve`.
        float8: a Float8Config to run the model's GEMMs in float8 on top of O1/O2/O3
            (docs/float8.md), or None.
        plan_reasons: (module path, reason) pairs a PrecisionPlan gave for its choices
            (docs/planner.md); explain() prints each with the decisions of its module.
        model_boundary: where O0/O2/O3 cast floating inputs to the model dtype and outputs to
            `cast_model_outputs`: "call" (Apex's: the model's call, and the graphs' fp32
            inputs), or "modules" (each call of a module holding parameters made from outside
            the model's modules, and no graph input: Note [A step calls the model's layers];
            the Lightning plugin's).
    """

    opt_level: str = "O1"
    dtype: Optional[torch.dtype] = None
    cast_model_type: Union[torch.dtype, None, bool] = None
    patch_torch_functions: bool = True
    keep_batchnorm_fp32: Optional[bool] = None
    cast_model_outputs: Union[torch.dtype, None, bool] = None
    policy: Optional[str] = None
    custom_policy: Optional[NodePolicy] = None
    op_overrides: tuple[tuple[str, str], ...] = ()
    module_overrides: tuple[tuple[str, str], ...] = ()
    device_type: Optional[str] = None
    float8: Optional[Float8Config] = None
    plan_reasons: tuple[tuple[str, str], ...] = ()
    model_boundary: str = "call"

    def __post_init__(self) -> None:
        check_opt_level(self.opt_level)
        if self.model_boundary not in _BOUNDARIES:
            raise ConfigError(f"model_boundary={self.model_boundary!r} is not one of "
                              f"{', '.join(map(repr, _BOUNDARIES))}")
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
        if self.cast_model_outputs is False:
            return None
        if self.cast_model_outputs is not None:
            return self.cast_model_outputs
        if self.cast_model_type is False:  # Apex patched no forward then
            return None
        if self.opt_level == "O1":
            # Note [O1's outputs are fp32]: Apex's O1 patched torch's functions everywhere, so
            # a loss computed outside the model (timm's criterion, a plain loop's
            # nn.CrossEntropyLoss) ran its log_softmax in fp32, as it does under autocast.
            # fxamp's casts are in the model's graph only: a 16-bit output would reach such a
            # loss as is, a float16 loss whose scaled gradient (GradScaler's first scale,
            # 2**16, is inf in float16) overflows by construction. The output is cast to fp32
            # instead (as accelerate's convert_outputs_to_fp32 does for its autocast), at the
            # cost of autocast's own cast inside the loss. Where the steps run under autocast
            # (model_boundary "modules", the Lightning plugin) autocast's rules apply to the
            # loss, and the layers' outputs stay 16-bit, as autocast's.
            return torch.float32 if self.model_boundary == "call" else None
        return torch.float32 if self.opt_level in ("O2", "O3") else None

    def cache_key(self) -> str:
        """A digest that is stable across processes (dtype objects hash by id)."""
        return digest(self)
