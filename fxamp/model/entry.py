"""`fxamp.compile`: the user's entry point, its arguments and precision plans, onto `prepare`
(prepare.py)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from fxamp.arguments import check_compile_flags, entry_config
from fxamp.backend import Compiler
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.model.prepare import CompileSettings, prepare
from fxamp.planner.plan import PrecisionPlan

__all__ = ["compile"]


def compile(model: torch.nn.Module, *, opt_level: Optional[str] = None,
            config: Optional[AmpConfig] = None,
            enabled: bool = True, compiler: Compiler = "inductor", mode: Optional[str] = None,
            options: Optional[dict] = None, dynamic: Optional[bool] = None,
            fullgraph: bool = False, plan: Optional[PrecisionPlan] = None,
            **overrides: Any) -> torch.nn.Module:
    """Apply an Apex opt level to `model` as compiler passes and compile it with Inductor.

    Like `apex.amp.initialize`, this prepares the model in place and returns it: at O0 the
    parameters are stored in fp32, at O2/O3 in the low dtype (O2 keeps BatchNorm, and any
    module overridden to fp32, in fp32), and `model.compile(backend=fxamp.backend(...))`
    makes every call run the transformed graph, with floating inputs cast to the model dtype
    and outputs to fp32 (or `cast_model_outputs`) at O0/O2/O3, as Apex did.

    Args:
        model: a module with floating-point parameters, not yet wrapped in DDP.
        opt_level: "O0", "O1", "O2" or "O3" (letter O); O1 unless given.
        config: a ready AmpConfig instead of opt_level + overrides.
        enabled: False returns `model` untouched.
        compiler, mode, options: the inner compiler and Inductor's mode / options.
        dynamic, fullgraph: passed to torch.compile.
        plan: a `fxamp.plan` PrecisionPlan to apply (docs/planner.md): its 16-bit dtype, its
            fp32 module overrides and its float8 filter, at `opt_level` (O1 unless given).
        **overrides: `AmpConfig.from_opt_level` keywords: dtype, keep_batchnorm_fp32,
            cast_model_type, master_weights, loss_scale, cast_model_outputs, policy,
            op_overrides, module_overrides, ...

    Returns:
        The same module object, compiled.

    Raises:
        ConfigError: for a bad level, override, argument or model; the model is then left
            unchanged. A refusal at the first call (a banned op, say) restores the model as it
            was, so that it can be compiled again with the fix.
    """
    if plan is not None:
        config = _plan_config(model, plan, config, opt_level, overrides)
        opt_level, overrides = None, {}
    config = entry_config(config, opt_level, overrides, "fxamp.compile")
    settings = CompileSettings(compiler, mode, options, dynamic, fullgraph)
    settings.backend(config)  # checks compiler, mode and options before `enabled` is honoured
    check_compile_flags(dynamic=dynamic, fullgraph=fullgraph, enabled=enabled)
    if not enabled:
        return model
    return prepare(model, config, settings=settings).fn


def _plan_config(model: Any, plan: Any, config: Optional[AmpConfig], opt_level: Optional[str],
                 overrides: dict[str, Any]) -> AmpConfig:
    if not isinstance(plan, PrecisionPlan):
        raise ConfigError(f"plan= takes a fxamp.plan(...) PrecisionPlan (or PrecisionPlan."
                          f"from_json(text)), not {type(plan).__name__}")
    if config is not None:
        raise ConfigError("fxamp.compile got plan= and config=: pass one (plan.to_config(...) "
                          "is the config a plan makes)")
    if isinstance(model, torch.nn.Module):
        plan.check_model(model)
    return plan.to_config(opt_level=opt_level or "O1", **overrides)
