"""The transformers Trainer with fxamp doing the mixed precision (docs/integrations.md)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Optional

import torch
import transformers

from fxamp.errors import ConfigError
from fxamp.integrations.accelerate import Accelerator, check_convertible
from fxamp.model.prepare import config_of

__all__ = ["Trainer"]


class Trainer(transformers.Trainer):
    """`transformers.Trainer` on fxamp's Accelerator (fxamp.integrations.accelerate).

    `fp16=True` / `bf16=True` in the TrainingArguments pick fxamp's dtype (neither: fxamp's
    default for the device); `opt_level` the Apex opt level. The model is compiled by fxamp and
    the optimizer (the default AdamW; a torch Adam / AdamW / SGD from `optim=`,
    `optimizer_cls_and_kwargs=` or `optimizers=`; or an fxamp.optim one from those, rebuilt
    over the cast model) becomes fxamp's fused one over the same param groups, before the
    Trainer builds its lr scheduler; a scheduler passed in `optimizers=(optimizer, scheduler)`
    drives it through those groups (Note [Schedulers of a replaced optimizer] in
    fxamp/optim/apex/convert.py). Then the Trainer's `max_grad_norm` clips, and its logged
    `grad_norm` is, the unscaled norm; a step with inf/nan gradients is skipped on the device
    and `optimizer_step_was_skipped` says so, so the lr scheduler does not advance on it;
    checkpoints carry the loss scaler. The model is saved (`save_model`, checkpoints) as the
    user's model had it: its weights in their own dtypes and `config.json`'s `dtype` that of
    the model given, tied weights written once.

    Args:
        opt_level: "O0", "O1", "O2" or "O3".
        amp_options: `fxamp.AmpConfig.from_opt_level` keywords besides dtype.
        compiler: the compiler behind fxamp's passes ("inductor", "aot_eager", "eager").
        *args, **kwargs: those of the next constructor in the MRO: transformers.Trainer's,
            or a subclass's after this one (`class X(Trainer, trl.SFTTrainer)`).

    Raises:
        ConfigError: what fxamp's Accelerator refuses, `torch_compile_backend` other than
            "fxamp" (fxamp compiles the model itself), and an optimizer in `optimizers=` that
            fxamp has no fused counterpart of; raised before the Trainer is built. (One that
            `optim=` or `optimizer_cls_and_kwargs=` names is refused when `train()` builds
            it, before the model changes.)
    """

    def __init__(self, *args: Any, opt_level: str = "O1",
                 amp_options: Optional[dict[str, Any]] = None, compiler: str = "inductor",
                 **kwargs: Any) -> None:
        self._fxamp = dict(opt_level=opt_level, amp_options=amp_options, compiler=compiler)
        # Note [Trainer subclasses]: `class X(Trainer, trl.SFTTrainer)` puts SFTTrainer next in
        # the MRO, so the arguments are bound against the next __init__ (SFTTrainer's
        # peft_config, a user's own keyword, or their **kwargs), never transformers.Trainer's
        # alone; a wrong one raises the TypeError that __init__ would.
        call = _Call(super().__init__, args, kwargs)
        check_convertible((call.get("optimizers") or (None, None))[0])
        training_args = call.get("args")
        if training_args is not None and training_args.torch_compile:
            _check_compile_backend(training_args.torch_compile_backend)
            # The Trainer would hand the name to accelerate's fixed list; fxamp compiles.
            training_args = copy.copy(training_args)
            training_args.torch_compile, training_args.torch_compile_backend = False, None
            call.set("args", training_args)
        super().__init__(*call.bound.args, **call.bound.kwargs)

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
        model = self.model if model is None else model
        if config_of(model) is None:  # the user's model, before fxamp casts it
            self._user_dtypes = UserDtypes.of(model)
        _, self.optimizer = self.accelerator.apply_amp(model, self.optimizer)
        return self.optimizer

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        # Note [Saving the model as the user gave it]: at O2/O3 the model stores 16-bit weights
        # and its state dict is those (Note [The state dict is the live weights]), so
        # save_pretrained would write them, and the dtype it writes into config.json is that of
        # the first weight; `from_pretrained` would then build a 16-bit model from an fp32 one.
        # The weights are written in the dtypes the model had before fxamp (an upcast: exact),
        # each shared storage cast once so that tied weights stay tied and are written once,
        # and config.json gets the model's own dtype back.
        user = getattr(self, "_user_dtypes", None)
        if user is None:
            return super()._save(output_dir, state_dict)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if state_dict is None:
            state_dict = model.state_dict()
        super()._save(output_dir, state_dict=user.cast(state_dict))
        config = getattr(model, "config", None)
        if config is not None and self.args.should_save:
            config.dtype = str(user.model_dtype).removeprefix("torch.")
            config.save_pretrained(output_dir or self.args.output_dir)


@dataclasses.dataclass(frozen=True)
class UserDtypes:
    """The dtypes of a model's floating state-dict entries before fxamp cast it."""

    entries: dict[str, torch.dtype]
    model_dtype: torch.dtype  # transformers' `model.dtype`: its first floating parameter's

    @classmethod
    def of(cls, model: torch.nn.Module) -> "UserDtypes":
        entries = {k: v.dtype for k, v in model.state_dict().items()
                   if isinstance(v, torch.Tensor) and v.is_floating_point()}
        first = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.get_default_dtype())
        return cls(entries, first)

    def cast(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` with each entry in its user dtype; entries that share a tensor (tied
        weights) share its one cast, so save_pretrained still finds them tied."""
        casts: dict[tuple, torch.Tensor] = {}
        out = {}
        for key, value in state_dict.items():
            want = self.entries.get(key)
            if want is None or not isinstance(value, torch.Tensor) or value.dtype == want:
                out[key] = value
                continue
            same = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if same not in casts:
                casts[same] = value.to(want)
            out[key] = casts[same]
        return out


class _Call:
    """A constructor call bound to the signature of `init` (the next `__init__` in the MRO),
    read and changed by parameter name, also where `init` takes them as **kwargs."""

    def __init__(self, init: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        signature = inspect.signature(init)
        self.bound = signature.bind_partial(*args, **kwargs)  # the TypeError init would raise
        self._var_kw = next((n for n, p in signature.parameters.items()
                             if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def _where(self, name: str) -> Optional[dict[str, Any]]:
        arguments = self.bound.arguments
        if name in arguments:
            return arguments
        extra = arguments.get(self._var_kw, {}) if self._var_kw else {}
        return extra if name in extra else None

    def get(self, name: str) -> Any:
        where = self._where(name)
        return None if where is None else where[name]

    def set(self, name: str, value: Any) -> None:
        self._where(name)[name] = value


def _check_compile_backend(backend: Optional[str]) -> None:
    if backend is not None and backend.lower() != "fxamp":
        raise ConfigError(f"torch_compile_backend={backend!r}: fxamp's Trainer compiles the "
                          "model with fxamp's backend (its passes, then Inductor, or the "
                          "compiler= you give it); pass torch_compile_backend='fxamp' or "
                          "leave torch_compile off")
