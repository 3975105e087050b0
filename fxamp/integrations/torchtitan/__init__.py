"""fxamp in torchtitan (docs/integrations.md, "torchtitan"), for the torchtitan installed:

- 0.3: `FxampConverter`, a model-config converter (config_converter.py), listed in a
  config_registry function's `model_registry(..., converters=[FxampConverter.Config()])`;
- 0.2: the model converter registered as "fxamp", with its `[fxamp]` job-config section
  (model_converter.py; importing this package registers it, as `--job.custom_config_module
  fxamp.integrations.torchtitan` does).
"""

import importlib
import importlib.metadata
import importlib.util

if importlib.util.find_spec("torchtitan.protocols.model_converter") is not None:
    from fxamp.integrations.torchtitan.model_converter import Fxamp, FxampConverter, JobConfig

    __all__ = ["Fxamp", "FxampConverter", "JobConfig"]
elif hasattr(importlib.import_module("torchtitan.protocols.model"), "ModelConfigConverter"):
    from fxamp.integrations.torchtitan.config_converter import FxampConverter

    __all__ = ["FxampConverter"]
else:
    raise ImportError(f"fxamp.integrations.torchtitan supports torchtitan 0.2 "
                      "(register_model_converter) and 0.3 (ModelConfigConverter); torchtitan "
                      f"{importlib.metadata.version('torchtitan')} has neither")
