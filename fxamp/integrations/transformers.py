"""The transformers Trainer with fxamp doing the mixed precision (docs/integrations.md)."""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Optional

import transformers

from fxamp.errors import ConfigError
from fxamp.integrations.accelerate import Accelerator
from fxamp.optim import FusedOptimizer

__all__ = ["Trainer"]


class Trainer(transformers.Trainer):
    """`transformers.Trainer` on fxamp's Accelerator (fxamp.integrations.accelerate).

    `fp16=True` / `bf16=True` in the TrainingArguments pick fxamp's dtype (neither: fxamp's
    default for the device); `opt_level` the Apex opt level. The model is compiled by fxamp and
    the optimizer (the default AdamW, or a torch Adam / AdamW / SGD from `optimizers=` or
    `optim=`) becomes fxamp's fused one before the lr scheduler is built on it. Then the
    Trainer's `max_grad_norm` clips, and its logged `grad_norm` is, the unscaled norm; a step
    with inf/nan gradients is skipped on the device and `optimizer_step_was_skipped` says so,
    so the lr scheduler does not advance on it; checkpoints carry the loss scaler.

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        amp_options: `fxamp.AmpConfig.from_opt_level` keywords besides dtype.
        compiler: the compiler behind fxamp's passes ("inductor", "aot_eager", "eager").
        *args, **kwargs: transformers.Trainer's.

    Raises:
        ConfigError: what fxamp's Accelerator refuses, and `torch_compile_backend` other than
            "fxamp" (fxamp compiles the model itself); raised before the Trainer is built.
    """

    def __init__(self, *args: Any, opt_level: str = "O1",
                 amp_options: Optional[dict[str, Any]] = None, compiler: str = "inductor",
                 **kwargs: Any) -> None:
        self._fxamp = dict(opt_level=opt_level, amp_options=amp_options, compiler=compiler)
        _check_scheduler(kwargs.get("optimizers", (None, None)))
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and training_args.torch_compile:
            _check_compile_backend(training_args.torch_compile_backend)
            # The Trainer would hand the name to accelerate's fixed list; fxamp compiles.
            training_args = copy.copy(training_args)
            training_args.torch_compile, training_args.torch_compile_backend = False, None
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (args[0], training_args, *args[2:])
        super().__init__(*args, **kwargs)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        self._accelerator_args = args
        return {**args, "mixed_precision": "no"}  # the plain Accelerator the base class builds

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Replaced by fxamp's, built from the same arguments (accelerate's state is shared:
        # both run with mixed_precision "no", fxamp's dtype comes from the Trainer's).
        self.accelerator = Accelerator(**self._accelerator_args, **self._fxamp)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object)

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer, made fxamp's fused one (the model compiled by fxamp first),
        so that the lr scheduler built next steps the optimizer that trains."""
        super().create_optimizer(model)
        _, self.optimizer = self.accelerator.apply_amp(self.model if model is None else model,
                                                      self.optimizer)
        return self.optimizer


def _check_scheduler(optimizers: Any) -> None:
    opt, scheduler = optimizers
    if scheduler is not None and not isinstance(opt, FusedOptimizer):
        raise ConfigError("optimizers=(optimizer, scheduler): the scheduler is built on the "
                          f"{type(opt).__name__} that fxamp replaces by its fused optimizer, "
                          "so it would step nothing; pass optimizers=(optimizer, None) with "
                          "lr_scheduler_type, or build the scheduler on an fxamp.optim optimizer")


def _check_compile_backend(backend: Optional[str]) -> None:
    if backend is not None and backend.lower() != "fxamp":
        raise ConfigError(f"torch_compile_backend={backend!r}: fxamp's Trainer compiles the "
                          "model with fxamp's backend (its passes, then Inductor, or the "
                          "compiler= you give it); pass torch_compile_backend='fxamp' or "
                          "leave torch_compile off")
