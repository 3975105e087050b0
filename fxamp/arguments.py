"""Checks of the entry points' arguments (compile, initialize, explain, the debug tools), all
run before any of them changes a model: a refusal leaves everything as it was."""

from __future__ import annotations

import difflib
from typing import Any, Callable, Optional

import torch

from fxamp import validation
from fxamp._compat import inductor_config_keys, list_mode_options
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError

__all__ = ["entry_config", "check_compiler", "check_compile_flags", "compiler_name", "COMPILERS"]

COMPILERS = ("inductor", "aot_eager", "eager")


def entry_config(config: Any, opt_level: Optional[str], overrides: dict[str, Any],
                 where: str) -> AmpConfig:
    """The AmpConfig an entry point was asked for: `config`, or `opt_level` (default "O1")
    with `overrides`; giving both is refused rather than silently preferring one."""
    if config is None:
        return AmpConfig.from_opt_level("O1" if opt_level is None else opt_level, **overrides)
    if isinstance(config, str):
        raise ConfigError(f"{where}(config={config!r}): config takes an AmpConfig; for an opt "
                          f"level write {where}(opt_level={config!r})")
    if not isinstance(config, AmpConfig):
        raise ConfigError(f"{where}(config=...) takes an AmpConfig (AmpConfig.from_opt_level"
                          f"(...)), not {type(config).__name__}")
    if opt_level is not None or overrides:
        given = ", ".join([f"opt_level={opt_level!r}"] * (opt_level is not None)
                          + [f"{k}=" for k in overrides])
        raise ConfigError(f"{where} got config=<AmpConfig {config.opt_level}> and {given}: pass "
                          "either config= or opt_level= with overrides, not both (build the "
                          "config with AmpConfig.from_opt_level(level, **overrides))")
    return config


def check_compiler(compiler: Any, mode: Any, options: Any) -> None:
    """`compiler` is a known name or a callable; `mode` and `options` are Inductor's own."""
    if not callable(compiler):
        validation.choice(compiler, "compiler", COMPILERS, "or pass a torch.compile backend "
                          "callable")
    if compiler != "inductor" and (mode is not None or options):
        raise ConfigError(f"mode={mode!r} / options={options!r} configure Inductor, but "
                          f"compiler={compiler_name(compiler)}; drop them or use compiler='inductor'")
    if mode is not None:
        _check_mode(mode)
    if options is not None:
        _check_options(options)


def compiler_name(compiler: Any) -> str:
    """How a compiler is named in messages: its string, or a callable's name."""
    return repr(compiler) if isinstance(compiler, str) else getattr(compiler, "__name__",
                                                                    type(compiler).__name__)


def _check_mode(mode: Any) -> None:
    try:
        list_mode_options(mode)
    except (RuntimeError, TypeError, KeyError) as e:
        raise ConfigError(f"mode={mode!r} is not an Inductor mode: {e}") from None


def _check_options(options: Any) -> None:
    if not isinstance(options, dict):
        raise ConfigError(f"options={options!r} must be a dict of Inductor config settings")
    known = inductor_config_keys()
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        close = [k for u in unknown for k in difflib.get_close_matches(u, known, n=2)]
        raise ConfigError(f"options {unknown} are not Inductor config settings (torch."
                          f"_inductor.config){'; did you mean ' + ', '.join(close) if close else ''}")


def check_compile_flags(*, dynamic: Any, fullgraph: Any, enabled: Any = True) -> None:
    validation.choice(dynamic, "dynamic", (None, True, False),
                      "None lets torch.compile decide, as torch.compile(dynamic=...) takes it")
    validation.boolean(fullgraph, "fullgraph")
    validation.boolean(enabled, "enabled")


def check_model_list(models: list, check_one: Callable[[torch.nn.Module], Any]) -> None:
    """Every model passes `check_one` (and no model is listed twice) before any is prepared."""
    seen: dict[int, int] = {}
    for i, model in enumerate(models):
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"models[{i}] is a {type(model).__name__}, not a torch.nn.Module")
        if id(model) in seen:
            raise ConfigError(f"models[{seen[id(model)]}] and models[{i}] are the same "
                              f"{type(model).__name__}; pass each model once")
        seen[id(model)] = i
        try:
            check_one(model)
        except ConfigError as e:
            raise ConfigError(f"models[{i}]: {e}") from None
