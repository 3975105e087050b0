"""Apex amp's entry points for people migrating: initialize and master_params (scale_loss is in
scale_loss.py, the amp state dict in amp_state.py), with no global state: the loss scalers live
on the optimizers `initialize` returns (`set_loss_scalers`), shared by all of them (Apex's
`_amp_state.loss_scalers`)."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from fxamp.arguments import check_compiler, check_model_list
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.optim.apex import amp_state
from fxamp.optim.apex.convert import fused_class, to_fused
from fxamp.optim.apex.fp16_optimizer import FP16_Optimizer
from fxamp.optim.apex.larc import apply_larc
from fxamp.optim.apex.fp16_optimizer import _check_inner as check_wrappable
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.scaling.master_grads import master_params_of
from fxamp.optim.optimizer import FusedOptimizer
from fxamp.model.prepare import CompileSettings, check_model, prepare

__all__ = ["initialize", "master_params"]

log = logging.getLogger(__name__)

Models = Union[torch.nn.Module, Sequence[torch.nn.Module]]
Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def initialize(models: Models, optimizers: Optimizers = None, *, enabled: bool = True,
               opt_level: str = "O1", num_losses: int = 1, verbosity: int = 1,
               compiler: str = "inductor", **overrides: Any):
    """Apex's `amp.initialize`: compile the model(s) for an opt level and return fused
    mixed-precision optimizers in place of the given ones.

    torch's Adam, AdamW and SGD (without amsgrad, maximize or differentiable) become fxamp's
    fused Adam, AdamW and SGD with the same param groups; any other optimizer is wrapped in
    FP16_Optimizer. Build lr schedulers on the returned optimizers.

    Args:
        models: a module or a list of modules; each is compiled with `fxamp.compile`.
        optimizers: a torch optimizer, a list of them, or None (inference).
        enabled: False returns the arguments unchanged.
        opt_level: "O0", "O1", "O2" or "O3".
        num_losses: number of loss scalers, picked by `scale_loss(..., loss_id=k)`.
        verbosity: 0 keeps the INFO log quiet.
        compiler: "inductor" (default) compiles model and optimizer step with Inductor;
            "aot_eager" (debugging, fast tests) runs the model's graphs and the step eagerly.
        **overrides: Apex's property overrides (cast_model_type, keep_batchnorm_fp32,
            master_weights, loss_scale, cast_model_outputs, min_loss_scale, max_loss_scale) and
            fxamp's AmpConfig keywords.

    Returns:
        Mirrors the input: `model, opt`, `[m1, m2], opt`, `model, [o1, o2]`, or the model(s)
        alone when `optimizers` is None.

    Raises:
        ConfigError: bad opt level or override, an optimizer passed twice, a model wrapped in
            DistributedDataParallel.
    """
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    config = AmpConfig.from_opt_level(opt_level, num_losses=num_losses, **overrides)
    check_compiler(compiler, None, None)
    model_list, models_was_list = _as_list(models, torch.nn.Module, "models")
    opt_list, opts_was_list = _as_list(optimizers, object, "optimizers")
    _check_models(model_list, config, compiler)
    _check_optimizers(opt_list)
    if model_list:
        _check_state_formats(opt_list, config, check_model(model_list[0], config).model_dtype)
    # Everything is checked: from here on models and optimizers change.
    compiled = [prepare(m, config, settings=CompileSettings(compiler)).fn for m in model_list]
    inductor = compiler == "inductor"
    scalers = [LossScaler.from_config(config, compile=inductor) for _ in range(num_losses)]
    converted = [_convert(o, config, scalers, inductor) for o in opt_list]
    amp_state.register(converted)  # for amp.state_dict() (Note in amp_state.py)
    (log.info if verbosity else log.debug)(
        "initialize(%s): %d model(s), optimizers %s, %d loss scaler(s)", opt_level,
        len(compiled), [type(o).__name__ for o in converted], num_losses)
    out_models = compiled if models_was_list else compiled[0]
    if optimizers is None:
        return out_models
    return out_models, (converted if opts_was_list else converted[0])


def _as_list(value: Any, kind: type, what: str) -> tuple[list, bool]:
    if value is None:
        return [], False
    if isinstance(value, (list, tuple)):
        return list(value), True
    if kind is torch.nn.Module and not isinstance(value, kind):
        raise ConfigError(f"{what} must be a module or a list of modules, not "
                          f"{type(value).__name__}")
    return [value], False


def _check_models(models: list, config: AmpConfig, compiler) -> None:
    def check_one(model: torch.nn.Module) -> None:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError("it is already wrapped in DistributedDataParallel; call "
                              "initialize first and wrap the returned model afterwards")
        check_model(model, config, compiler)

    check_model_list(models, check_one)


def _check_optimizers(opts: list) -> None:
    owner: dict[int, int] = {}  # parameter id -> optimizer index
    for i, opt in enumerate(opts):
        _check_optimizer(i, opt, opts)
        for group in opt.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), i) != i:
                    raise ConfigError(f"a parameter of shape {tuple(p.shape)} is in both "
                                      f"optimizers[{owner[id(p)]}] and optimizers[{i}]; each "
                                      "parameter can live in one flat buffer only")


def _check_state_formats(opts: list, config: AmpConfig,
                         model_dtype: Optional[torch.dtype]) -> None:
    # What the converted optimizer's own check would refuse once the model is cast, refused
    # before anything changes (state_format.check_params).
    for i, opt in enumerate(opts):
        fmt = getattr(opt, "state_format", None)
        if not isinstance(opt, FusedOptimizer) or fmt.master == "fp32":
            continue
        where = f"optimizers[{i}] ({type(opt).__name__}) has state_format master={fmt.master!r}"
        if config.master_weights is False:
            raise ConfigError(f"{where}, which keeps master weights in the bf16 model, but "
                              f"opt_level {config.opt_level} keeps none (master_weights=False)"
                              "; use O2, or a state_format with master='fp32'")
        if model_dtype == torch.float16:
            raise ConfigError(f"{where}, which makes a bfloat16 model its own master, but "
                              f"opt_level {config.opt_level} casts the model to float16; pass "
                              "cast_model_type=torch.bfloat16, or a state_format with "
                              "master='fp32'")


def _check_optimizer(i: int, opt: Any, opts: list) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optimizers[{i}] is a {type(opt).__name__}, not a torch "
                          "optimizer (pass bare optimizers, not FP16_Optimizer)")
    first = next(j for j, other in enumerate(opts) if other is opt)
    if first != i:
        raise ConfigError(f"optimizers[{first}] and optimizers[{i}] are the same "
                          f"{type(opt).__name__}: an optimizer passed twice would be "
                          "converted twice; pass each optimizer once")
    if not any(group["params"] for group in opt.param_groups):
        raise ConfigError(f"optimizers[{i}] ({type(opt).__name__}) has no parameters")
    if fused_class(opt) is None:  # it will be wrapped: refuse now what the wrapper would
        try:
            check_wrappable(opt)
        except ConfigError as e:
            raise ConfigError(f"optimizers[{i}]: {e}") from None


def _convert(opt: torch.optim.Optimizer, config: AmpConfig, scalers: list[LossScaler],
             compile: bool):
    master_weights = config.master_weights is not False
    native = fused_class(opt)
    if native is not None:
        if _has_state(opt):  # asked first: an fxamp optimizer hands its state over below
            log.warning("%s already has state; initialize starts the converted optimizer "
                        "afresh (load its state_dict afterwards to keep it)", type(opt).__name__)
        new = to_fused(opt, native, master_weights=master_weights, compile=compile)
        if getattr(opt, "larc", None) is not None:  # an fxamp optimizer LARC applied to
            apply_larc(new, opt.larc)
    else:
        log.info("%s has no fused fxamp counterpart: wrapping it in FP16_Optimizer (one host "
                 "read per step unless built with fused=True)", type(opt).__name__)
        new = FP16_Optimizer(opt, static_loss_scale=1.0, compile=compile)
    new.set_loss_scalers(scalers)
    return new


def _has_state(opt: torch.optim.Optimizer) -> bool:
    if isinstance(opt, FusedOptimizer):
        return bool(opt.step_counts.any())
    return bool(opt.state)


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Apex's `amp.master_params`: the tensors the optimizer steps, with unscaled `.grad`.

    For an fxamp optimizer: per-parameter views of the fp32 masters, or of the parameters
    themselves where they have none (fp32 ones, and 16-bit ones at O3), in the param groups'
    order (a parameter the optimizer does not step is yielded itself), whose `.grad` are the
    unscaled gradients in the same dtype. Edits through them, such as `clip_grad_norm_`, reach
    the step while the model's gradients stay as they are; if those change (another backward,
    `model.zero_grad()`), the step computes the master gradients again from them (Note
    [Gathered master gradients]). Call it after the last backward of a step; `max_grad_norm=`
    is the faster way to clip.
    """
    if isinstance(optimizer, FP16_Optimizer):
        yield from optimizer.master_params()
    elif isinstance(optimizer, FusedOptimizer):
        yield from master_params_of(optimizer)
    else:
        for group in optimizer.param_groups:
            yield from group["params"]
