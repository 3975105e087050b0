"""Apex's FP16_Optimizer over any torch optimizer, with the scale and overflow on the device.

The wrapped optimizer steps on flat fp32 masters, one per (param group, dtype), exactly as
Apex's flattened FP16_Optimizer did; the model's parameters and gradients are views into flat
buffers (see flat.py). Gradients are unscaled into the masters' `.grad` by one compiled pass
that also sets the overflow flag. A torch optimizer built with `fused=True` skips on that flag on
the device; any other one is skipped after one host read per step, as in Apex.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from fxamp.errors import ConfigError
from fxamp.optim.scaling import exits
from fxamp.optim.functional import fused_step
from fxamp.optim.scaling import scaled_graphs
from fxamp.optim.distributed import is_dtensor
from fxamp.optim.buffers.flat import FlatBucket
from fxamp.optim.buffers.grouping import flatten_param_groups
from fxamp.optim.scaling.folding import GradientFolding
from fxamp.optim.scaling.loss_scaler import LossScaler

__all__ = ["FP16_Optimizer"]

log = logging.getLogger(__name__)


class MasterSlot(NamedTuple):
    """One flat bucket of the model's 16-bit parameters and the fp32 master Parameter the
    wrapped optimizer steps over it (sharing `bucket.weights`' storage)."""

    bucket: FlatBucket
    master: torch.nn.Parameter


class FP16_Optimizer:
    """Wrap `init_optimizer` with fp32 master weights and static or dynamic loss scaling.

    Args:
        init_optimizer: a torch optimizer built on the model's parameters, before its first
            step. Its param groups are changed to hold the flat fp32 masters.
        static_loss_scale: the scale when `dynamic_loss_scale` is False.
        dynamic_loss_scale: use a dynamic LossScaler (Apex's rule unless dynamic_loss_args
            says otherwise).
        dynamic_loss_args: keyword arguments of LossScaler, e.g. {"growth_interval": 500,
            "semantics": "torch"}; Apex's "scale_window" and "init_scale" are accepted too.
        verbose: log the groups ingested at INFO (Apex printed them).
        compile: compile the unscale pass with torch.compile.

    Use `optimizer.backward(loss)` instead of `loss.backward()`, then `optimizer.step()`.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[dict] = None,
                 verbose: bool = False, *, compile: bool = True) -> None:
        _check_inner(init_optimizer)
        if any(is_dtensor(p) for g in init_optimizer.param_groups for p in g["params"]):
            raise ConfigError("FP16_Optimizer does not step sharded (DTensor, FSDP2) parameters; "
                              "use fxamp.optim.AdamW, Adam or SGD, which step their local shards")
        self.optimizer = init_optimizer
        scaler = _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args, compile)
        buckets = flatten_param_groups(init_optimizer.param_groups, master_weights=True,
                                       owner="FP16_Optimizer")
        self._slots = [MasterSlot(b, self._master_param(b)) for b in buckets]
        for gi, group in enumerate(init_optimizer.param_groups):
            group["params"] = [s.master for s in self._slots if s.bucket.group_index == gi]
        device = self._slots[0].master.device if self._slots else torch.device("cpu")
        self.found_inf = torch.zeros((), dtype=torch.bool, device=device)
        """Whether the last step was skipped, as a 0-dim device tensor."""
        fns = fused_step.compiled() if compile else fused_step.eager
        self.folding = GradientFolding(fns.fold_grads, device, fns.unscale_grads)
        """Which scale the gradients carry and what was folded (folding.py)."""
        self.folding.set_loss_scalers([scaler], "FP16_Optimizer")
        (log.info if verbose else log.debug)(
            "FP16_Optimizer: %d flat masters over %d groups", len(self._slots),
            len(init_optimizer.param_groups))

    @staticmethod
    def _master_param(bucket) -> torch.nn.Parameter:
        # Parameter(t) shares t's storage: stepping the master updates bucket.master, or the
        # model's fp32 parameters directly when the bucket has no separate master.
        master = torch.nn.Parameter(bucket.weights, requires_grad=True)
        master.grad = torch.zeros_like(bucket.weights)
        return master

    # ------------------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """Scale `loss`, run its backward and (by default) unscale into the master grads."""
        self.before_backward(self.loss_scaler)
        self.loss_scaler.scale(loss).backward(retain_graph=retain_graph)
        self.after_backward(self.loss_scaler)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Add the model's gradients, unscaled, to the masters' `.grad` and zero them; record
        overflow. Runs at most once per backward."""
        exits.resolve_exit_of(self)
        if self.folding.unscaled is not None:  # the masters' .grad hold them already
            self.folding.fold_unscaled(*self._fold_buffers())
        if self.folding.raw_scaler is None:
            return
        self.folding.fold(self.folding.raw_scaler, *self._fold_buffers(), owner=self)

    # What scale_loss and its exits (exits.py) call.
    def before_backward(self, scaler: LossScaler) -> None:
        """A backward with `scaler` is about to add to the gradients: resolve the exit they
        wait in, and fold them if they carry another scaler's scale."""
        exits.resolve_exit_of(self)
        scaled_graphs.release_dropped(
            self, lambda: [p for s in self._slots for p in s.bucket.params])
        if self.folding.unscaled is not None or self.folding.carries_other(scaler):
            self.update_master_grads()

    def after_backward(self, scaler: LossScaler) -> None:
        """The raw gradients now carry `scaler`'s scale."""
        self.folding.raw_scaler = scaler

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """Resolve a scale_loss exit into `flag` (Note [Apex's scale_loss exits])."""
        self.folding.fold_exit(scaler, flag, *self._fold_buffers(), owner=self)

    def unscale_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """A scale_loss exit: the masters' `.grad` get the unscaled sum and the model's `.grad`
        its rounding (Note [.grad after a scale_loss exit] in docs/design.md)."""
        raws, accs = self._fold_buffers()
        self.folding.unscale_exit(scaler, flag, raws, accs, (True,) * len(raws), owner=self)

    def agree_exit_flag_(self, flag: torch.Tensor) -> None:
        """Nothing to agree on: FP16_Optimizer steps one process's parameters."""

    def _fold_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for slot in self._slots:
            slot.bucket.sync_from_params()
        return [s.bucket.grad for s in self._slots], [s.master.grad for s in self._slots]

    # ---------------------------------------------------------------------------------- step
    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the masters' gradients; returns their total norm, or -1 on overflow (Apex).
        Reads the overflow flag and the norm back to the host."""
        self.update_master_grads()
        if self.overflow:
            return -1.0
        return float(torch.nn.utils.clip_grad_norm_([s.master for s in self._slots], max_norm,
                                                   norm_type))

    @property
    def overflow(self) -> bool:
        """Whether the gradients so far (or of the last step) overflowed. Reads the device."""
        self._refresh_overflow()
        return bool(self.found_inf.item())

    def _refresh_overflow(self) -> None:
        if not self.folding.folds_nothing():
            self.found_inf.copy_(self.folding.found())

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step the wrapped optimizer on the masters unless the gradients overflowed, copy the
        masters to the model, and advance the loss scale."""
        loss = None
        if closure is not None:
            if any(s.dynamic for s in self.loss_scalers):
                raise ConfigError("FP16_Optimizer.step(closure) cannot be used with dynamic loss "
                                  "scaling: call optimizer.backward(loss) and then step()")
            with torch.enable_grad():
                loss = closure()
        self.update_master_grads()
        self._refresh_overflow()
        with torch.no_grad():
            for slot in self._slots:
                slot.bucket.sync_from_params()
            self._step_inner()
            for slot in self._slots:
                slot.bucket.write_back()  # the masters into the model's weights
        self.folding.finish_step()
        return loss

    def _step_inner(self) -> None:
        inner = self.optimizer
        if getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = None, self.found_inf.float()
            inner.step()  # torch's fused kernels skip on found_inf themselves
        elif self.found_inf.item():
            log.info("gradient overflow: skipping step, loss scale %s", self.loss_scaler)
        else:
            inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's and the masters' gradients (in place: they are flat buffers, and the
        flat fp32 master steps as one tensor, as Apex's `flat_master=True`: a parameter without
        a gradient steps with a zero one; `set_to_none` is ignored)."""
        exits.resolve_exit_of(self)  # it still moves the scale (Note [Apex's scale_loss exits])
        for bucket, master in self._slots:
            bucket.zero_grad(set_to_none=False)
            master.grad.zero_()
        self.folding.raw_scaler = None
        self.folding.finish_step()

    # ------------------------------------------------------------------------- Apex surface
    @property
    def loss_scaler(self) -> LossScaler:
        """The scaler `backward` scales by: the first of `loss_scalers`."""
        return self.folding.loss_scalers[0]

    @property
    def loss_scalers(self) -> tuple[LossScaler, ...]:
        """Its own scaler, or the scalers `initialize` gave it (`loss_id`s of scale_loss)."""
        return self.folding.loss_scalers

    def set_loss_scalers(self, scalers: Sequence[LossScaler]) -> None:
        """Step with these scalers instead of its own (what `initialize` does; the first
        becomes `loss_scaler`).

        Raises:
            ConfigError: not a non-empty list of LossScaler.
        """
        self.folding.set_loss_scalers(scalers, "FP16_Optimizer")

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.get_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.set_scale(value)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def master_params(self) -> list[torch.Tensor]:
        """Per-parameter fp32 views of the masters, with `.grad` views of the master grads."""
        out = []
        for bucket, master in self._slots:
            for view, grad in zip(bucket.views(master.data), bucket.views(master.grad)):
                view.grad = grad
                out.append(view)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Scaler, wrapped optimizer and masters; loadable with torch.load(weights_only=True)."""
        return {"loss_scaler": self.loss_scaler.state_dict(),
                "dynamic_loss_scale": self.loss_scaler.dynamic,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_masters": [s.master.detach() for s in self._slots]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for (bucket, master), saved in zip(self._slots, state_dict["fp32_masters"]):
                master.copy_(saved)
                bucket.write_back()  # the loaded masters into the model's weights

    def __repr__(self) -> str:
        return f"FP16_Optimizer({type(self.optimizer).__name__}, {self.loss_scaler})"


def _check_inner(opt: Any) -> None:
    if not isinstance(opt, torch.optim.Optimizer) or hasattr(opt, "buckets"):
        raise ConfigError(f"FP16_Optimizer wraps a plain torch optimizer, not "
                          f"{type(opt).__name__}; fxamp's own optimizers already keep masters "
                          "and a loss scale")
    if opt.state:
        raise ConfigError(f"wrap the {type(opt).__name__} before its first step: it already has "
                          "state for the model's parameters, and the wrapper steps on new flat "
                          "masters")


def _make_scaler(static: float, dynamic: bool, args: Optional[dict],
                 compile: bool) -> LossScaler:
    if not dynamic:
        return LossScaler(static, compile=compile)
    args = dict(args or {})
    if "scale_window" in args:  # Apex's name
        args["growth_interval"] = args.pop("scale_window")
    if "scale_factor" in args:
        factor = float(args.pop("scale_factor"))
        args.setdefault("growth_factor", factor)
        args.setdefault("backoff_factor", 1 / factor)
    return LossScaler("dynamic", compile=compile, **args)
