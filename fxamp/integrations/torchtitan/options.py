"""What fxamp can run under torchtitan, checked the same way for torchtitan 0.2 and 0.3."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fxamp.arguments import check_compiler
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError

__all__ = ["LEVELS", "amp_config", "check_compile", "check_float8_checkpointing", "device_type"]

# torchtitan's optimizers are torch.optim's: they keep no fp32 master weights, so only the levels
# that keep the weights in fp32 train correctly under them.
LEVELS = ("O0", "O1")


def amp_config(opt_level: Any, dtype: Any, float8: Any, compiler: Any,
               name: Callable[[str], str]) -> AmpConfig:
    """The (unresolved) AmpConfig of these options, or a ConfigError that calls each option
    `name(option)` (how the user spelled it: "fxamp.opt_level", "FxampConverter.Config(opt_level")."""
    if opt_level not in LEVELS:
        raise ConfigError(f"{name('opt_level')}={opt_level!r}: torchtitan steps the model with "
                          "torch.optim optimizers, which keep no fp32 master weights, so only "
                          f"{', '.join(LEVELS)} (fp32 weights) train correctly; use O1 (FSDP's "
                          "mixed_precision_param keeps bf16 copies for the GEMMs)")
    if str(dtype).replace("torch.", "") not in ("bfloat16", "bf16"):
        raise ConfigError(f"{name('dtype')}={dtype!r}: torchtitan scales no loss, and float16 "
                          "gradients overflow without it; use bfloat16")
    check_compiler(compiler, None, None)
    # The model's output is the hidden state that torchtitan's loss hands to lm_head and
    # upcasts itself, and FSDP's MixedPrecisionPolicy leaves outputs alone: fxamp leaves them
    # too, instead of O1's fp32 outputs (an fp32 copy lm_head would cast back).
    return AmpConfig.from_opt_level(opt_level, dtype="bfloat16", float8=float8 or None,
                                    cast_model_outputs=False)


def check_compile(compile_config: Any, fix: str) -> None:
    """Refuse torchtitan's own torch.compile of the model: fxamp compiles it."""
    if compile_config is not None and compile_config.enable and \
            "model" in compile_config.components:
        raise ConfigError("compile.enable with 'model' in compile.components: fxamp compiles "
                          f"the model itself (its passes, then its compiler); {fix}")


def check_float8_checkpointing(float8: str, checkpointing: Any, name: str, fix: str) -> None:
    """Refuse float8 with activation checkpointing (`checkpointing`: its kind, None for off):
    fxamp's float8 pass leaves the GEMMs of checkpointed bodies alone, so float8 would not
    run where it was asked for."""
    if float8 and checkpointing is not None:
        raise ConfigError(f"{name}={float8!r} with activation checkpointing ({checkpointing}): "
                          "fxamp's float8 pass does not rewrite the GEMMs inside checkpointed "
                          f"bodies, so the checkpointed blocks would stay bf16; {fix}, or "
                          "leave float8 off")


def device_type() -> str:
    """The device torchtitan will compute on: the accelerator's (torchtitan's own choice), else
    the CPU (a CUDA build without a GPU names "cuda" unless asked for an available one)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return "cpu" if accelerator is None else accelerator.type
