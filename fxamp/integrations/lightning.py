"""A Lightning `Precision` plugin that trains with fxamp: `Trainer(plugins=[Precision("O2")])`.

# Note [fxamp's Lightning plugin]
It does what Lightning's own `MixedPrecision` plugin does with a GradScaler, with fxamp's parts:
`convert_module` compiles the LightningModule in place with `fxamp.compile` (before
`configure_optimizers`, so an fxamp optimizer built there gets the 16-bit weights and keeps
fp32 masters); `pre_backward` scales the loss; `optimizer_step` runs Lightning's closure
(forward, backward), unscales with the LossScaler's GradScaler protocol so that the
`on_before_optimizer_step` hooks and `gradient_clip_val` see unscaled gradients, then
`scaler.step` (skipped on inf/nan; fused and without a host read for fxamp's optimizers) and
`scaler.update()`. As with Lightning's plugin, a skipped step still counts in `global_step`
and step-interval schedulers still step (docs/integrations.md says how to hold them). The scale
and the skipped-step count are logged as device tensors, and the scaler is checkpointed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.precision import Precision as LightningPrecision

import fxamp
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError
from fxamp.model.prepare import undo_before_first_call
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.master_check import check_master_weights

__all__ = ["Precision"]

_AUTO = "auto"


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
        ConfigError: a bad opt level, override or scaler (at construction); at `fit`, float16
            weights stepped by a torch.optim optimizer (no fp32 masters), with the fix.
    """

    def __init__(self, opt_level: str = "O1", *, scaler: Union[str, LossScaler, None] = _AUTO,
                 compiler: str = "inductor", mode: Optional[str] = None,
                 options: Optional[dict] = None, dynamic: Optional[bool] = None,
                 fullgraph: bool = False, log_scale: bool = True, **overrides: Any) -> None:
        if not (scaler is None or scaler == _AUTO or isinstance(scaler, LossScaler)):
            raise ConfigError(f"scaler={scaler!r} must be 'auto', an fxamp.LossScaler or None")
        self.config = AmpConfig.from_opt_level(opt_level, **overrides)
        self._compile_kwargs = dict(compiler=compiler, mode=mode, options=options,
                                    dynamic=dynamic, fullgraph=fullgraph)
        self.scaler: Optional[LossScaler] = None if scaler == _AUTO else scaler
        self._auto_scaler = scaler == _AUTO
        self._pending_state: Optional[dict] = None
        self._compiled_here: Optional["weakref.ref[torch.nn.Module]"] = None
        self._warned: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.log_scale = log_scale
        self.precision = _precision_name(self.config)

    # ------------------------------------------------------------------ model and optimizers
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """`fxamp.compile` the module in place (O2/O3: its weights become 16-bit here)."""
        if fxamp.config_of(module) is None:
            fxamp.compile(module, config=self.config, **self._compile_kwargs)
            self._compiled_here = weakref.ref(module)
        config = fxamp.config_of(module)
        self.precision = _precision_name(config)
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
                check_master_weights(optimizer, "fxamp.integrations.lightning.Precision",
                                     self._warned)
        except ConfigError:
            # Refused after convert_module cast the weights: the model goes back as it was.
            module = self._compiled_here() if self._compiled_here is not None else None
            if module is not None and undo_before_first_call(module):
                self._compiled_here = None
                if self._auto_scaler:
                    self.scaler = None
            raise
        return model, optimizers, lr_schedulers

    # ---------------------------------------------------------------- backward and the step
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

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
