"""fxamp as a torchtitan 0.2 model converter (0.2's `register_model_converter`).

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

from fxamp.errors import ConfigError
from fxamp.integrations.torchtitan.options import (amp_config, check_compile,
                                                   check_float8_checkpointing, device_type)
from fxamp.model.entry import compile as fxamp_compile

__all__ = ["Fxamp", "FxampConverter", "JobConfig"]


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
        config = amp_config(options.opt_level, options.dtype, options.float8, options.compiler,
                            lambda option: f"fxamp.{option}")
        check_compile(getattr(job_config, "compile", None), "pass --compile.components loss, "
                      "or leave compile.enable off")
        mode = getattr(getattr(job_config, "activation_checkpoint", None), "mode", "none")
        check_float8_checkpointing(options.float8, None if mode == "none" else mode,
                                   "fxamp.float8", "pass --activation_checkpoint.mode none")
        # torchtitan builds the model on the meta device and converts it there
        self.config = config.resolve(device_type())
        self.compiler = options.compiler

    def convert(self, model: torch.nn.Module) -> None:
        fxamp_compile(model, config=self.config, compiler=self.compiler)

    def post_optimizer_hook(self, model: Any) -> None:
        """Nothing: fxamp's float8 scales are computed in the graph."""


register_model_converter(FxampConverter, "fxamp")
