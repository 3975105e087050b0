"""A Lightning `Precision` plugin that trains with fxamp: `Trainer(plugins=[Precision("O2")])`.

# Note [fxamp's Lightning plugin]
It does what Lightning's own `MixedPrecision` plugin does with a GradScaler, with fxamp's parts:
`convert_module` compiles the LightningModule in place with fxamp, its call and each of its
layers (the outermost submodules that hold parameters, which a step calls directly), for the
device of the Trainer's strategy, before `configure_optimizers` (so an fxamp optimizer built
there gets the 16-bit weights and keeps fp32 masters). The steps themselves run eagerly, as
under Lightning's autocast: what they call that is not the model (a loss module, a torchmetrics
metric, a parameterless helper) runs in its own dtype on the layers' outputs, under autocast at
O1 (`forward_context`, as Lightning's), in fp32 on fp32 outputs at O2/O3 (Note [A step calls
the model's layers] in docs/design.md); `pre_backward` scales the loss; `optimizer_step`
runs Lightning's closure (forward, backward), unscales with the LossScaler's GradScaler
protocol so that the `on_before_optimizer_step` hooks and `gradient_clip_val` see unscaled
gradients, then
`scaler.step` (skipped on inf/nan; fused and without a host read for fxamp's optimizers) and
`scaler.update()`. As with Lightning's plugin, a skipped step still counts in `global_step`
and step-interval schedulers still step (docs/integrations.md says how to hold them). The scale
and the skipped-step count are logged as device tensors, and the scaler is checkpointed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Generator, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision as LightningPrecision
from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy,
                                          SingleDeviceXLAStrategy, XLAStrategy)

from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.model.prepare import (CompileSettings, backend_of, config_of, prepare,
                                 undo_before_first_call)
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.master_weights import check_master_weights

__all__ = ["Precision"]

_AUTO = "auto"
# DeepSpeed and XLA derive from DDP and the single-device strategy, and are not supported.
_SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)
_UNSUPPORTED_STRATEGIES = (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)


class Precision(LightningPrecision):
    """fxamp's opt levels in a `lightning.Trainer` (Note [fxamp's Lightning plugin]).

    Example:
        >>> trainer = lightning.Trainer(plugins=[Precision("O2", dtype=torch.float16)])

    Args:
        opt_level: "O0" to "O3", as for `fxamp.compile`.
        scaler: "auto" (a `LossScaler.from_config` of the opt level when it resolves to
            float16, none for bfloat16), a LossScaler of your own, or None (no loss scaling).
        compiler, mode, options, dynamic, fullgraph: as for `fxamp.compile`.
        log_scale: log "fxamp/loss_scale" and "fxamp/skipped_steps" at every optimizer step
            (device tensors; Lightning reads them when it logs).
        **overrides: `AmpConfig.from_opt_level` keywords (dtype, keep_batchnorm_fp32, ...).

    Raises:
        ConfigError: a bad opt level, override or scaler (at construction); at `fit` (and
            validate, test, predict), before anything changes: a strategy other than one
            device or DDP (FSDP, DeepSpeed, ...), a LightningModule compiled with
            torch.compile, or one `fxamp.compile` prepared (not its layers); float16
            weights stepped by a torch.optim optimizer (no fp32 masters; the module is then
            put back as it was). Each message names the fix.
    """

    def __init__(self, opt_level: str = "O1", *, scaler: Union[str, LossScaler, None] = _AUTO,
                 compiler: str = "inductor", mode: Optional[str] = None,
                 options: Optional[dict] = None, dynamic: Optional[bool] = None,
                 fullgraph: bool = False, log_scale: bool = True, **overrides: Any) -> None:
        if not (scaler is None or scaler == _AUTO or isinstance(scaler, LossScaler)):
            raise ConfigError(f"scaler={scaler!r} must be 'auto', an fxamp.LossScaler or None")
        # Each layer a step calls is the model Apex casts around (Note [A step calls the model's
        # layers]).
        overrides.setdefault("model_boundary", "modules")
        self.config = AmpConfig.from_opt_level(opt_level, **overrides)
        self._compile_kwargs = dict(compiler=compiler, mode=mode, options=options,
                                    dynamic=dynamic, fullgraph=fullgraph)
        self.scaler: Optional[LossScaler] = None if scaler == _AUTO else scaler
        self._auto_scaler = scaler == _AUTO
        self._pending_state: Optional[dict] = None
        self._compiled_here: Optional["weakref.ref[torch.nn.Module]"] = None
        self.log_scale = log_scale
        self._autocast: Optional[tuple[str, torch.dtype]] = None  # set by convert_module
        self.precision = _precision_name(self.config)

    # ------------------------------------------------------------------ model and optimizers
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Compile the module in place with fxamp, its call and its layers, for the strategy's
        device (O2/O3: its weights become 16-bit here)."""
        _check_strategy(module)
        if config_of(module) is None:
            _check_uncompiled(module)
            settings = CompileSettings(**self._compile_kwargs, layers=True)
            prepare(module, _for_device(self.config, module), settings=settings)
            self._compiled_here = weakref.ref(module)
        else:
            _check_layers_compiled(module)
        config = config_of(module)
        self.precision = _precision_name(config)
        self._autocast = _step_autocast(config)
        if self._auto_scaler and self.scaler is None and _scales(config):
            self.scaler = LossScaler.from_config(config)
        if self.scaler is not None and self._pending_state is not None:
            self.scaler.load_state_dict(self._pending_state)
            self._pending_state = None
        return module

    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Refuse float16 weights that a torch.optim optimizer would step without fp32 masters
        (bfloat16 ones warn once): Note [16-bit weights need fp32 masters]."""
        try:
            for optimizer in optimizers:
                check_master_weights(optimizer, "fxamp.integrations.lightning.Precision")
        except ConfigError:
            # Refused after convert_module cast the weights: the model goes back as it was.
            module = self._compiled_here() if self._compiled_here is not None else None
            if module is not None and undo_before_first_call(module):
                self._compiled_here = None
                if self._auto_scaler:
                    self.scaler = None
            raise
        return model, optimizers, lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Lightning runs each step in it: at O1 the steps' own code runs under autocast, as
        with Lightning's "bf16-mixed" / "16-mixed" (a loss module, a metric: autocast's rules);
        O0, O2 and O3 run it as it is (the layers' floating outputs come back in fp32)."""
        if self._autocast is None:
            yield
            return
        device_type, dtype = self._autocast
        with torch.autocast(device_type, dtype=dtype, cache_enabled=False):
            yield

    # ---------------------------------------------------------------- backward and the step
    # Disabled for Dynamo, as Lightning's own logging is: a compiled step reaches them in manual
    # optimization (Note [Lightning's machinery runs eagerly] in docs/design.md).
    @torch.compiler.disable
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @torch.compiler.disable
    def backward(self, *args: Any, **kwargs: Any) -> None:
        return super().backward(*args, **kwargs)

    @torch.compiler.disable
    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return super().post_backward(tensor, module)

    @torch.compiler.disable
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("LBFGS re-evaluates its closure inside step(), which loss scaling "
                              "cannot skip; use scaler=None (bfloat16) or another optimizer")
        closure_result = closure()
        # A training_step that returned None skipped its backward: nothing to unscale or step.
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            self.scaler.unscale_(optimizer)  # before the hooks and the clipping
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        if self.log_scale:
            _log_scaler(model, self.scaler)
        return output

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
        elif self._auto_scaler and state_dict:
            self._pending_state = dict(state_dict)  # the scaler is made in convert_module


def _check_uncompiled(module: torch.nn.Module) -> None:
    if getattr(module, "_compiler_ctx", None) is not None:
        raise ConfigError(
            f"{type(module).__name__} was compiled with torch.compile, and Lightning runs its "
            "steps with that compile's backend, not fxamp's: pass the LightningModule itself "
            "(lightning.pytorch.utilities.compile.to_uncompiled(model) gives it back); the "
            "plugin compiles it and its layers (compiler='inductor' unless you name another)")


def _check_strategy(module: torch.nn.Module) -> None:
    """Refuse, before anything changes, a strategy the plugin is not tested under: one device
    and DDP (each process a whole model) are; FSDP, DeepSpeed, model parallelism and XLA
    shard or wrap the model in ways fxamp's compiled steps have not been checked against."""
    trainer = getattr(module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or (isinstance(strategy, _SUPPORTED_STRATEGIES)
                            and not isinstance(strategy, _UNSUPPORTED_STRATEGIES)):
        return
    raise ConfigError(
        f"fxamp's Lightning plugin does not support strategy {type(strategy).__name__}: it "
        "trains under one device and DDP (strategy='auto', 'ddp', 'ddp_spawn', ...); for FSDP2 "
        "use fxamp.compile and fxamp.optim directly (docs/distributed.md), or Lightning's own "
        "precision plugins with that strategy")


def _check_layers_compiled(module: torch.nn.Module) -> None:
    settings = backend_of(module).settings
    if not settings.layers or backend_of(module).config.model_boundary != "modules":
        raise ConfigError(
            f"{type(module).__name__} was prepared by fxamp.compile, which compiles its call "
            "but not its layers, so what a step calls directly (self.encoder(x), ...) would "
            "miss fxamp's precision: pass the module uncompiled; the plugin compiles it with "
            "its layers")


def _for_device(config: AmpConfig, module: torch.nn.Module) -> AmpConfig:
    """`config` resolved for the device the Trainer's strategy trains on (the module is still
    on the CPU when Lightning converts it; the weights' device would give CPU's dtype and op
    table to a model that trains on a GPU)."""
    trainer = getattr(module, "_trainer", None)
    if config.device_type is not None or trainer is None:
        return config
    return config.resolve(trainer.strategy.root_device.type)


def _step_autocast(config: AmpConfig) -> Optional[tuple[str, torch.dtype]]:
    """The autocast the steps run under: O1's (its layers' outputs are 16-bit, as autocast's),
    none at O0/O2/O3 (fp32 outputs, or none cast)."""
    if config.opt_level != "O1" or not config.patch_torch_functions:
        return None
    return config.device_type, config.dtype


def _scales(config: AmpConfig) -> bool:
    return config.dtype == torch.float16 and config.loss_scale != 1.0


def _precision_name(config: AmpConfig) -> str:
    """Lightning's name for it (`trainer.precision`); an unresolved dtype reads as bf16 until
    `convert_module` resolves it."""
    if config.opt_level == "O0":
        return "32-true"
    bits = "16" if config.dtype == torch.float16 else "bf16"
    return f"{bits}-true" if config.opt_level == "O3" else f"{bits}-mixed"


def _log_scaler(model: Any, scaler: LossScaler) -> None:
    # Copies: Lightning may keep the tensor until it logs, and the scaler updates its own in
    # place. Device copies, no host read.
    model.log("fxamp/loss_scale", scaler.scale_tensor.clone(), on_step=True, on_epoch=False)
    model.log("fxamp/skipped_steps", scaler.skipped_steps.float(), on_step=True, on_epoch=False)
