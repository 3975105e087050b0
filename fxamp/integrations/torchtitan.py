"""fxamp as a torchtitan model converter (torchtitan 0.2's `register_model_converter`).

    --job.custom_config_module fxamp.integrations.torchtitan --model.converters fxamp
    --fxamp.opt_level O1 --fxamp.dtype bfloat16 [--fxamp.float8 tensorwise]

Importing this module (torchtitan does, for `custom_config_module`) registers the converter
"fxamp" and adds the `[fxamp]` section to the job config. See docs/integrations.md.
"""

# No `from __future__ import annotations`: torchtitan (tyro) evaluates the dataclass field
# types in its own namespace, where a string "Fxamp" is not defined.

from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.protocols.model_converter import register_model_converter

from fxamp.arguments import check_compiler
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.model.entry import compile as fxamp_compile

__all__ = ["Fxamp", "FxampConverter", "JobConfig"]

# torchtitan's optimizers are torch.optim's: they keep no fp32 masters, so only the levels
# that keep the weights in fp32 train correctly under them.
_LEVELS = ("O0", "O1")


@dataclass
class Fxamp:
    """The `[fxamp]` section of a torchtitan job config."""

    opt_level: str = "O1"
    """"O0" or "O1" (O2/O3 keep 16-bit weights, which torchtitan's optimizers cannot step)."""
    dtype: str = "bfloat16"
    """The low dtype: "bfloat16" (torchtitan has no loss scaling for "float16")."""
    float8: str = ""
    """"" (none), "tensorwise", "rowwise" or "rowwise_with_gw_hp": fxamp's float8 GEMMs."""
    compiler: str = "inductor"
    """The compiler behind fxamp's passes ("aot_eager" for debugging)."""


@dataclass
class JobConfig:
    """What `--job.custom_config_module fxamp.integrations.torchtitan` merges into
    torchtitan's JobConfig."""

    fxamp: Fxamp = field(default_factory=Fxamp)


class FxampConverter:
    """torchtitan's ModelConverter: `convert(model)` compiles the model with fxamp, in place
    (on the meta device, before parallelisation; fxamp compiles at the first call).

    Raises:
        ConfigError: O2/O3, float16, a bad option, or torchtitan's own `compile.enable` for the
            model (fxamp compiles it); raised when torchtitan builds its converters.
    """

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        options = getattr(job_config, "fxamp", None)
        if options is None:
            raise ConfigError("the job config has no [fxamp] section: pass --job."
                              "custom_config_module fxamp.integrations.torchtitan")
        _check(options, job_config)
        config = AmpConfig.from_opt_level(options.opt_level, dtype=options.dtype,
                                          float8=options.float8 or None)
        # torchtitan builds the model on the meta device and converts it there: the device it
        # will compute on is the accelerator's (torchtitan's own choice), else the CPU; a CUDA
        # build without a GPU names "cuda" unless asked for an available one.
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        self.config = config.resolve("cpu" if accelerator is None else accelerator.type)
        self.compiler = options.compiler

    def convert(self, model: torch.nn.Module) -> None:
        fxamp_compile(model, config=self.config, compiler=self.compiler)

    def post_optimizer_hook(self, model: Any) -> None:
        """Nothing: fxamp's float8 scales are computed in the graph."""


def _check(options: Fxamp, job_config: Any) -> None:
    if options.opt_level not in _LEVELS:
        raise ConfigError(f"fxamp.opt_level={options.opt_level!r}: torchtitan steps the model "
                          "with torch.optim optimizers, which keep no fp32 master weights, so "
                          f"only {', '.join(_LEVELS)} (fp32 weights) train correctly; use O1 "
                          "(FSDP's mixed_precision_param keeps bf16 copies for the GEMMs)")
    if str(options.dtype).replace("torch.", "") not in ("bfloat16", "bf16"):
        raise ConfigError(f"fxamp.dtype={options.dtype!r}: torchtitan scales no loss, and "
                          "float16 gradients overflow without it; use bfloat16")
    check_compiler(options.compiler, None, None)
    compile_cfg = getattr(job_config, "compile", None)
    if compile_cfg is not None and compile_cfg.enable and "model" in compile_cfg.components:
        raise ConfigError("compile.enable with 'model' in compile.components: fxamp compiles "
                          "the model itself (its passes, then fxamp.compiler); pass --compile."
                          "components loss, or leave compile.enable off")


register_model_converter(FxampConverter, "fxamp")
