"""accelerate's Accelerator with fxamp doing the mixed precision (docs/integrations.md).

accelerate's own fp16 path assumes torch's GradScaler: `clip_grad_norm_` unscales only through
it (and only when accelerate itself runs fp16 autocast), and a step counts as skipped when
GradScaler did not call `optimizer.step`. fxamp's step is always called, and skips inside the
compiled graph. This subclass keeps accelerate's autocast and GradScaler off and gives the
methods a training loop calls fxamp's meaning: the prepared fxamp optimizers report their
skipped steps as accelerate's optimizer wrappers do (its prepared lr schedulers hold on them),
and schedulers built on the torch optimizers fxamp replaced drive the fused ones (Note
[Schedulers of a replaced optimizer] in fxamp/optim/apex/convert.py).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from fxamp.arguments import check_compiler
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.optim import FusedOptimizer, LossScaler, initialize, master_params, unscale_
from fxamp.optim.apex.convert import fused_class
from fxamp.model.prepare import config_of

__all__ = ["Accelerator", "FusedAcceleratedOptimizer", "check_convertible"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "no": None}


class Accelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` whose `prepare` applies an fxamp opt level.

    `prepare(model, optimizer, ...)` compiles each model with fxamp (in place) and replaces each
    torch Adam, AdamW or SGD by fxamp's fused counterpart (same param groups), whose step
    unscales, skips on inf/nan and moves the loss scale without a host read. Afterwards:
    `backward` scales the loss, `clip_grad_norm_` clips (and returns the norm of) the unscaled
    fp32 master gradients, `unscale_gradients` unscales `.grad` in place,
    `optimizer_step_was_skipped` reads the step's overflow flag (one host read), prepared lr
    schedulers (built before or after `prepare`) step the fused optimizer and hold on a
    skipped step, as with accelerate's GradScaler, and `save_state` / `load_state` carry the
    loss scaler (`accelerator.scaler`). The model's floating outputs come back in fp32, as
    accelerate's own mixed precision gives them (`convert_outputs_to_fp32`) and as fxamp's
    levels do (Note [O1's outputs are fp32]; `cast_model_outputs` in `amp_options` to change
    it).

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        amp_options: `fxamp.AmpConfig.from_opt_level` keywords (keep_batchnorm_fp32, float8,
            loss_scale, ...), besides dtype.
        compiler: the compiler behind fxamp's passes: "inductor", or "aot_eager" / "eager".
        **kwargs: accelerate.Accelerator's. `mixed_precision` ("fp16", "bf16"; "no" or unset:
            fxamp's default for the device) picks fxamp's dtype; accelerate itself then runs
            with mixed_precision "no". `dynamo_backend` may be "fxamp" (what fxamp does anyway).

    Raises:
        ConfigError: a bad opt level or option, mixed_precision "fp8" (use
            amp_options={"float8": ...}), another dynamo backend, FSDP or DeepSpeed; raised
            before accelerate's state is created.
    """

    def __init__(self, *, opt_level: str = "O1", amp_options: Optional[dict[str, Any]] = None,
                 compiler: str = "inductor", **kwargs: Any) -> None:
        amp_options = dict(amp_options or {})
        dtype = _dtype(kwargs.pop("mixed_precision", None), amp_options)
        if dtype is not None:
            amp_options["dtype"] = dtype
        _check_dynamo(kwargs.pop("dynamo_backend", None), kwargs.get("dynamo_plugin"))
        if kwargs.get("dynamo_plugin") is None:
            kwargs["dynamo_backend"] = "no"  # over ACCELERATE_DYNAMO_BACKEND=fxamp
        _check_sharding(kwargs)
        check_compiler(compiler, None, None)
        self.amp_config = AmpConfig.from_opt_level(opt_level, **amp_options)
        """The fxamp config `prepare` applies."""
        self._amp = dict(opt_level=opt_level, compiler=compiler, **amp_options)
        self._loss_scaler = LossScaler.from_config(self.amp_config,
                                                   compile=compiler == "inductor")
        super().__init__(mixed_precision="no", **kwargs)  # everything is checked

    def prepare(self, *args: Any, device_placement: Optional[list[bool]] = None) -> Any:
        """accelerate's `prepare`, with fxamp's opt level applied first to the models not yet
        compiled by fxamp and to the optimizers (`apply_amp`). lr schedulers built on the
        optimizers given, passed in the same call or later, drive the ones it returns."""
        args = self.apply_amp(*args)
        return super().prepare(*args, device_placement=device_placement)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: Optional[bool] = None) -> AcceleratedOptimizer:
        # Note [fxamp's optimizers step themselves]: AcceleratedOptimizer given a scaler calls
        # `scaler.step(opt)` and decides "skipped" by whether opt.step ran; fxamp's step always
        # runs and skips on the device. Without one, `opt.step()` divides by the scale its
        # gradients carry (the optimizer's loss scaler), and the wrapper asks fxamp's
        # optimizer whether its step was skipped (as accelerate's DeepSpeed wrapper does).
        if isinstance(optimizer, FusedOptimizer):
            if device_placement is None:
                device_placement = self.device_placement
            prepared = FusedAcceleratedOptimizer(optimizer, device_placement=device_placement)
            self._optimizers.append(prepared)
            return prepared
        held, self.scaler = self.scaler, None
        try:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        finally:
            self.scaler = held

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """accelerate's, with a scheduler built on a torch optimizer fxamp replaced paired with
        the fused optimizer that took its param groups (accelerate pairs by identity)."""
        prepared = super().prepare_scheduler(scheduler)
        bound = getattr(scheduler, "optimizer", None)
        if isinstance(prepared, AcceleratedScheduler) and prepared.optimizers is self._optimizers:
            owners = [o for o in self._optimizers
                      if getattr(bound, "param_groups", None) is o.optimizer.param_groups]
            if len(owners) == 1:
                prepared.optimizers = owners
        return prepared

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the `.grad` of fxamp's optimizers' parameters by the loss scale, in place
        (`fxamp.optim.unscale_`); other optimizers as accelerate does."""
        for opt in _inner(self._optimizers if optimizer is None else optimizer):
            if isinstance(opt, FusedOptimizer):
                unscale_(opt)
        super().unscale_gradients(optimizer)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip the unscaled gradients; returns their total norm (inf or nan on a step that
        overflowed, which the step then skips). For the parameters of fxamp's optimizers the
        norm and the clipping are those of the fp32 master gradients the step applies."""
        parameters = list(parameters)
        owners = _owners(parameters, _inner(self._optimizers))
        if owners is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        masters = [m for opt in owners for m in master_params(opt)]
        return torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type=norm_type)

    def apply_amp(self, *args: Any) -> tuple:
        """`args` with fxamp's opt level applied, without accelerate's preparation: models not
        yet compiled by fxamp are compiled (in place), torch Adam / AdamW / SGD become fxamp's
        fused optimizers over the same param groups, and so do fxamp optimizers built on a
        model compiled here (rebuilt over its cast, moved parameters, as `initialize` does);
        those get this accelerator's loss scaler. What `prepare` does first; the Trainer calls
        it before building its lr scheduler."""
        models = [a for a in args if isinstance(a, torch.nn.Module) and config_of(a) is None]
        compiled_here = {id(p) for m in models for p in m.parameters()}
        opts = [a for a in args if isinstance(a, torch.optim.Optimizer)
                and not isinstance(a, AcceleratedOptimizer)
                and (not isinstance(a, FusedOptimizer) or _steps_any(a, compiled_here))]
        for opt in opts:
            check_convertible(opt)
        if self.device_placement:  # the flat buffers are built where the parameters live
            for model in models:
                model.to(self.device)
        converted: dict[int, FusedOptimizer] = {}
        if models or opts:  # everything is checked by initialize before it changes anything
            converted = dict(zip(map(id, opts), initialize(models, opts, **self._amp)[1]))
        out = tuple(converted.get(id(a), a) for a in args)
        for opt in out:
            if isinstance(opt, FusedOptimizer):
                opt.set_loss_scalers([self._loss_scaler])
                self.scaler = self._loss_scaler
        return out


class FusedAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's wrapper of an fxamp optimizer: `step_was_skipped` is whether its last step
    was skipped for inf/nan gradients (one host read of its device flag), which accelerate's
    `optimizer_step_was_skipped` and its prepared lr schedulers ask after each step."""

    @property
    def step_was_skipped(self) -> bool:
        return self.optimizer.last_step_skipped()


def check_convertible(opt: Any) -> None:
    """Refuse a torch optimizer that fxamp has no fused counterpart of (by name), before
    anything changes."""
    if (isinstance(opt, torch.optim.Optimizer) and not isinstance(opt, AcceleratedOptimizer)
            and fused_class(opt) is None):
        raise ConfigError(f"{type(opt).__name__} has no fused fxamp counterpart: pass "
                          "torch.optim.Adam, AdamW or SGD (no amsgrad, maximize or "
                          "differentiable), or an fxamp.optim optimizer")


def _steps_any(opt: torch.optim.Optimizer, param_ids: set[int]) -> bool:
    return any(id(p) in param_ids for g in opt.param_groups for p in g["params"])


def _dtype(mixed_precision: Optional[str], amp_options: dict[str, Any]) -> Any:
    if mixed_precision is None:
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if str(mixed_precision) not in _DTYPES:
        raise ConfigError(f"mixed_precision={mixed_precision!r}: fxamp's Accelerator takes "
                          f"'fp16', 'bf16' or 'no' (fxamp's default dtype); for float8 pass "
                          "amp_options={'float8': 'tensorwise'} with fp16 or bf16")
    dtype = _DTYPES[str(mixed_precision)]
    given = amp_options.get("dtype")
    if dtype is not None and given is not None and given != dtype:
        raise ConfigError(f"mixed_precision={mixed_precision!r} and amp_options dtype={given}"
                          " disagree: give one of them")
    return dtype


def _check_dynamo(backend: Any, plugin: Any) -> None:
    if plugin is not None and str(plugin.backend.value).lower() != "no":
        backend = plugin.backend.value
    if backend is None:
        backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
    name = str(getattr(backend, "value", backend)).lower()
    if name not in ("no", "fxamp"):
        raise ConfigError(f"dynamo_backend={name!r}: fxamp compiles the model with its own "
                          "backend (its passes, then the compiler= you give it, Inductor by "
                          "default); pass dynamo_backend='fxamp' or leave it unset")


def _check_sharding(kwargs: dict[str, Any]) -> None:
    for key, env in (("fsdp_plugin", "ACCELERATE_USE_FSDP"),
                     ("deepspeed_plugin", "ACCELERATE_USE_DEEPSPEED")):
        if kwargs.get(key) is not None or os.environ.get(env, "false").lower() == "true":
            raise ConfigError(f"fxamp's Accelerator does not drive {key.split('_')[0]}: wrap "
                              "the model in FSDP2 yourself (docs/distributed.md) or use "
                              "accelerate.Accelerator without fxamp")


def _inner(optimizers: Any) -> list[Any]:
    if not isinstance(optimizers, (list, tuple)):
        optimizers = [optimizers]
    out = []
    for opt in optimizers:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        out.append(opt)
    return out


def _owners(parameters: list[torch.Tensor], optimizers: list[Any]) -> Optional[list[Any]]:
    """The fxamp optimizers that step `parameters`, when they step all of them."""
    fused = [o for o in optimizers if isinstance(o, FusedOptimizer)]
    owner = {id(p): o for o in fused for g in o.param_groups for p in g["params"]}
    wanted = [p for p in parameters if p.requires_grad]
    if not wanted or any(id(p) not in owner for p in wanted):
        return None
    return list({id(owner[id(p)]): owner[id(p)] for p in wanted}.values())

