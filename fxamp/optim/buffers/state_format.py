"""StateFormat: how a fused optimizer stores its master weights and moments (issue 14).

A frozen, validated, hashable config, with named presets (`StateFormat.from_preset`), passed
to the optimizers as `state_format=`. The encodings themselves are codecs.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from fxamp.errors import ConfigError

__all__ = ["StateFormat", "as_state_format", "check_params"]

MASTERS = ("fp32", "kahan", "int8_error", "stochastic")
MOMENTS = ("fp32", "bf16", "int8")
_MASTER_BYTES = {"fp32": 4, "kahan": 2, "int8_error": 1, "stochastic": 0}
_MOMENT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 2 / 64}  # int8: a bf16 scale per 64


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """Storage of the master weights and the optimizer's moments.

    Attributes:
        master: for bfloat16 parameters: "fp32" (an fp32 master copy, the default), or the
            model is its own master, with what bf16 drops kept in a bf16 compensation buffer
            ("kahan"), an int8 error term ("int8_error", FlashOptim's 24-bit master) or
            nowhere, rounding each update stochastically ("stochastic"). float32 parameters
            are their own master whatever this says; float16 parameters need "fp32".
        moments: "fp32" (default), "bf16", or "int8" (block-wise quantised, a bf16 scale per
            64 elements, companded; Note [8-bit moments] in docs/design.md).
        seed: the seed of the stochastic rounding's counter-based random bits.
    """

    master: str = "fp32"
    moments: str = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.master not in MASTERS:
            raise ConfigError(f"StateFormat master={self.master!r} is not one of {MASTERS}")
        if self.moments not in MOMENTS:
            raise ConfigError(f"StateFormat moments={self.moments!r} is not one of {MOMENTS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**32:
            raise ConfigError(f"StateFormat seed={self.seed!r} must be an int in [0, 2**32)")

    @classmethod
    def from_preset(cls, name: str) -> "StateFormat":
        """"default" (fp32 master and moments), "low_memory" (int8_error master, int8
        moments: the recommended one) or "compensated" (kahan master, bf16 moments)."""
        if name not in PRESETS:
            raise ConfigError(f"state format preset {name!r} is not one of {sorted(PRESETS)}")
        return PRESETS[name]

    def bytes_per_param(self, n_moments: int = 2) -> float:
        """Bytes per bf16 parameter kept between steps: model 2 + gradient 2 + master +
        moments (int8 moments count their scales). The flat weights are the model's own
        memory (Note [Parameters own their storage] in fxamp/optim/buffers/flat.py)."""
        return 4 + _MASTER_BYTES[self.master] + n_moments * _MOMENT_BYTES[self.moments]


PRESETS = {"default": StateFormat(), "low_memory": StateFormat("int8_error", "int8"),
           "compensated": StateFormat("kahan", "bf16")}


def as_state_format(value: Any) -> StateFormat:
    if value is None:
        return PRESETS["default"]
    if isinstance(value, StateFormat):
        return value
    if isinstance(value, str):
        return StateFormat.from_preset(value)
    raise ConfigError(f"state_format={value!r}: give a StateFormat or a preset name "
                      f"{sorted(PRESETS)}")


def check_params(fmt: StateFormat, param_groups: Sequence[dict], master_weights: bool,
                 owner: str) -> None:
    """Refuse what a 16-bit master format cannot hold, before anything is flattened."""
    if fmt.master == "fp32":
        return
    if not master_weights:
        raise ConfigError(f"{owner}: state_format master={fmt.master!r} keeps master weights "
                          "in the bf16 model; master_weights=False asks for none. Drop one")
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            if p.requires_grad and p.dtype == torch.float16:
                raise ConfigError(
                    f"{owner}: parameter {pi} of param group {gi} is float16, but state_format "
                    f"master={fmt.master!r} makes a bfloat16 model its own master; float16's "
                    "5 exponent bits cannot hold the updates. Use master='fp32' with an fp16 "
                    "model, or a bfloat16 model (opt_level O2 with dtype=torch.bfloat16)")
