"""fxamp as a torchtitan 0.3 model-config converter (docs/integrations.md, "torchtitan").

In a config_registry function, as torchtitan's own float8 configs are written:

    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[FxampConverter.Config()])

`convert` returns the model's config as a subclass of its own class (Note [The model's config
builds the fxamp model]); torchtitan's Trainer checks it against the job and builds the model
from it, compiled with fxamp, before it parallelises the model.
"""

# No `from __future__ import annotations`: torchtitan's config tooling (tyro, dataclass
# field types) evaluates annotations; the `fxamp` field's must be a class, not a string.

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan.protocols.model import ModelConfigConverter

from fxamp.errors import ConfigError
from fxamp.integrations.torchtitan.options import (amp_config, check_compile,
                                                   check_float8_checkpointing, device_type)
from fxamp.model.entry import compile as fxamp_compile

__all__ = ["FxampConverter"]

# Parallelisms fxamp's graphs are not tested under in torchtitan (DTensor-sharded weights
# inside the graphs, pipeline stages cut from the compiled model): refused by name.
_UNTESTED = ("tensor_parallel_degree", "context_parallel_degree", "pipeline_parallel_degree",
             "expert_parallel_degree")


class FxampConverter(ModelConfigConverter):
    """torchtitan 0.3's ModelConfigConverter for fxamp: the model is built compiled with fxamp
    at `opt_level` ("O0" or "O1"), in bfloat16, with fxamp's `float8` GEMMs if given.

    Raises:
        ConfigError: O2/O3 or float16 (torchtitan's optimizers keep no fp32 masters and it
            scales no loss), a bad option (when the converter is built); torchtitan's own
            `compile.enable` for the model, tensor/context/pipeline/expert parallelism (when the
            Trainer applies the job to the model's config, before the model is built).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        opt_level: str = "O1"
        """"O0" or "O1" (O2/O3 keep 16-bit weights, which torchtitan's optimizers cannot
        step)."""
        dtype: str = "bfloat16"
        """The low dtype: "bfloat16" (torchtitan has no loss scaling for "float16")."""
        float8: str = ""
        """"" (none), "tensorwise", "rowwise" or "rowwise_with_gw_hp": fxamp's float8
        GEMMs."""
        compiler: str = "inductor"
        """The compiler behind fxamp's passes ("aot_eager" for debugging)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        amp_config(config.opt_level, config.dtype, config.float8, config.compiler,
                   lambda option: f"FxampConverter.Config.{option}")

    def convert(self, model_config: Any) -> Any:
        if isinstance(model_config, _FxampModel):
            raise ConfigError(f"{type(model_config).__qualname__} is already converted by "
                              "FxampConverter: list it once in converters")
        cls = _fxamp_config_class(type(model_config))
        fields = {f.name: getattr(model_config, f.name)
                  for f in dataclasses.fields(model_config) if f.init}
        return cls(**fields, fxamp=self.config)


# Note [The model's config builds the fxamp model]: torchtitan 0.3 builds a model from its
# config tree (`model_config.build()`, on the meta device) and converters rewrite that tree
# before the Trainer sees it. fxamp compiles the whole model, so the converter replaces the
# root: a subclass of the model's own config class (the model class stays the model's: the
# same parameters, state dict and parallelize_fn) with an `fxamp` field, whose
# `update_from_config` also checks the job (the Trainer calls it with the whole job config
# before anything is built) and whose `build` compiles what it built in place. fxamp compiles
# at the first call, after parallelize_fn has wrapped, sharded and materialised the model.
# torchtitan's `@override` cannot do this: the Trainer builds the root config it read before
# the overrides ran, so an override of the root would be silently dropped.
def _check_job(config: Any, options: FxampConverter.Config) -> None:
    check_compile(getattr(config, "compile", None), "leave compile.enable off or pass "
                  "--compile.components loss")
    parallelism = getattr(config, "parallelism", None)
    for name in _UNTESTED:
        degree = getattr(parallelism, name, 1)
        if degree != 1:
            raise ConfigError(f"parallelism.{name}={degree}: fxamp is tested in torchtitan "
                              "with data parallelism (FSDP, HSDP) only; set it to 1")
    checkpointing = getattr(config, "activation_checkpoint", None)
    check_float8_checkpointing(options.float8, None if checkpointing is None else
                               type(checkpointing).__qualname__, "FxampConverter.Config.float8",
                               "pass activation-checkpoint:none")


class _FxampModel:
    """Marks the config classes `_fxamp_config_class` makes."""

    __slots__ = ()


_CLASSES: dict[type, type] = {}


def _fxamp_config_class(base: type) -> type:
    if base in _CLASSES:
        return _CLASSES[base]

    @dataclass(kw_only=True, slots=True)
    class Config(base, _FxampModel):
        fxamp: FxampConverter.Config = dataclasses.field(
            default_factory=FxampConverter.Config)

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            _check_job(config, self.fxamp)  # before the model's own update changes anything
            base.update_from_config(self, config=config, **kwargs)

        def build(self, **kwargs: Any) -> Any:
            options = self.fxamp
            config = amp_config(options.opt_level, options.dtype, options.float8,
                                options.compiler, lambda o: f"FxampConverter.Config.{o}")
            model = base.build(self, **kwargs)
            fxamp_compile(model, config=config.resolve(device_type()), compiler=options.compiler)
            return model

    Config.__name__ = f"Fxamp{base.__name__}"
    Config.__qualname__ = f"Fxamp{base.__qualname__}"
    _CLASSES[base] = Config
    return Config
