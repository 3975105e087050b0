"""FusedOptimizer: flat buffers, a loss scale and one compiled step for any update rule.

The step is `prologue` + one `update` per bucket from fused_step.py, compiled once per kind and
shared by every optimizer of the process (Note [One compiled step per kind]). Nothing in `step`
reads a device value: hyperparameters go to the device only when they change (an lr scheduler
costs one scalar fill per group per step), and whether the step was skipped stays on the device
until `last_step_skipped()`. Buckets and states: buffers/device_state.py; folding gradients
of several losses and Apex's scale_loss exits: folded_steps.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from torch.optim.optimizer import ParamsT

from fxamp.errors import ConfigError
from fxamp.optim import checkpoint, distributed, param_checks, param_groups
from fxamp.optim.buffers import state_buffers
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.buffers.device_state import DeviceState
from fxamp.optim.buffers.grouping import flatten_param_groups
from fxamp.optim.buffers.state_format import StateFormat, as_state_format
from fxamp.optim.buffers.state_format import check_params as check_state_params
from fxamp.optim.folded_steps import FoldedSteps, check_scaler_arg
from fxamp.optim.functional import fused_step
from fxamp.optim.functional.algorithms import Algorithm
from fxamp.optim.scaling import exits, scaled_graphs
from fxamp.optim.scaling.folding import GradientFolding
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.scaling.master_grads import MasterGrads

if TYPE_CHECKING:  # larc.py imports this module; torch.distributed may be unavailable
    from torch.distributed import ProcessGroup

    from fxamp.optim.apex.larc import LARCSettings

__all__ = ["FusedOptimizer"]

log = logging.getLogger(__name__)


class FusedOptimizer(FoldedSteps, torch.optim.Optimizer):
    """Base of fxamp's Adam, AdamW, SGD and LAMB; subclasses set `algorithm` and the defaults.

    Every parameter with `requires_grad` becomes a view into a flat buffer per (group, dtype),
    its `.grad` too; 16-bit ones get fp32 masters when `master_weights` is set. As torch.optim,
    the step leaves a parameter whose `.grad` is None alone, bit for bit (Note [A parameter
    without a gradient] in flat.py); its group's step count still advances.

    Under torch.distributed (`process_group`, "auto" by default: the default group when it is
    initialized with more than one rank) every rank's step agrees on the overflow flag, and on
    the gradient norm of sharded (FSDP2) parameters, inside the compiled step; DTensor
    parameters are stepped on their local shards. See docs/distributed.md.
    """

    algorithm: Algorithm
    larc: Optional[LARCSettings] = None  # once fxamp.optim.LARC applied them
    handed_over = False  # see hand_over
    fuses_loss_scaling = True  # a LossScaler's GradScaler protocol hands it the scaler

    def __init__(self, params: ParamsT,
                 defaults: dict[str, Any], *, max_grad_norm: Optional[float] = None,
                 master_weights: bool = True, compile: bool = True,
                 process_group: Union[ProcessGroup, str, None] = distributed.AUTO,
                 state_format: Union[StateFormat, str, None] = None) -> None:
        self._device_state: Optional[DeviceState] = None
        owner = type(self).__name__
        super().__init__(param_checks.as_param_list(params, owner), defaults)
        param_checks.check_has_params(self.param_groups, owner)
        self.max_grad_norm = param_checks.check_max_grad_norm(max_grad_norm)
        self.master_weights = master_weights
        self.state_format = as_state_format(state_format)
        """How masters and moments are stored (StateFormat; docs/optimizer.md)."""
        check_state_params(self.state_format, self.param_groups, master_weights, owner)
        fp32_masters = master_weights and self.state_format.master == "fp32"
        self._fns = fused_step.compiled() if compile else fused_step.eager
        self._unit = LossScaler(1.0, compile=compile)  # for unscale_ without any scaler
        buckets = flatten_param_groups(self.param_groups, master_weights=fp32_masters,
                                       owner=owner)
        self._init_group(process_group, buckets)
        self._left_out = param_groups.left_out(self.param_groups, buckets)
        device = next(p for g in self.param_groups for p in g["params"]).device
        self._device_state = DeviceState(device, self.state_format, fp32_masters=fp32_masters)
        self._device_state.add_groups(self.param_groups, 0, self.algorithm, buckets)
        self.found_inf = torch.zeros((), dtype=torch.bool, device=device)
        """Whether the last step was skipped, as a 0-dim device tensor."""
        self.grad_norm = torch.full((), float("nan"), device=device)
        """Total norm of the unscaled gradients at the last step (only with max_grad_norm)."""
        self.folding = GradientFolding(self._fns.fold_grads, device, self._fns.unscale_grads)
        """Which scale the gradients carry and what was folded (folding.py)."""
        self.master_grads = MasterGrads(self._fns.gather_grads)  # see master_params
        checkpoint.expose_state(self)

    def _init_group(self, process_group: Union[ProcessGroup, str, None],
                    buckets: list[Bucket]) -> None:
        owner = type(self).__name__
        sharded = [p for b in buckets if b.sharded for p in b.params]
        if sharded and self.algorithm.per_tensor_norms:
            raise ConfigError(f"{owner}: {self.algorithm.name}'s per-parameter trust ratio needs "
                              "whole-parameter norms, which sharded (DTensor) parameters do not "
                              "have locally; use AdamW, Adam or SGD with FSDP2")
        self._group = distributed.resolve_group(process_group, sharded, owner)
        if self._group is not None:
            log.debug("%s: agreeing on overflow over %d ranks; sharded buckets %s", owner,
                      torch.distributed.get_world_size(self._group),
                      tuple(b.sharded for b in buckets))

    def set_algorithm(self, algorithm: Algorithm) -> None:
        """Step with another rule of the same hyperparameters and states (LARC around this
        one); the compiled step recompiles once."""
        self.algorithm = algorithm
        self._device_state.set_algorithm(algorithm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's add_param_group, also after construction (unfreezing layers while
        fine-tuning): the group's parameters get flat buffers, fp32 masters and zeroed states
        of their own, and its step count starts at 0. Everything is checked first: a refused
        group leaves the optimizer as it was.

        Raises:
            ConfigError: a parameter already optimized, a bad hyperparameter, a parameter that
                cannot be flattened or lies on another device; the message names it.
        """
        owner, index = type(self).__name__, len(self.param_groups)
        param_checks.check_new_group(param_group, self.param_groups, owner)
        if self._device_state is None:  # torch.optim.Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            param_checks.check_hyperparameters(self.param_groups[-1], index, owner)
            return
        param_checks.check_added_group({**self.defaults, **param_group}, index, owner,
                                       self._device_state.device)
        check_state_params(self.state_format, [*self.param_groups, param_group],
                           self.master_weights, owner)
        super().add_param_group(param_group)  # its own checks fail before it appends
        new = self._device_state.add_groups(self.param_groups, index, self.algorithm)
        self._left_out = param_groups.left_out(self.param_groups, self.buckets)
        self.master_grads.drop()
        checkpoint.expose_state(self)  # every entry: the step counts are a new tensor
        log.debug("%s: param group %d added with %d buckets", owner, index, len(new))

    def hand_over(self) -> None:
        """Free the buffers and states once another optimizer steps these param groups (Note
        [Schedulers of a replaced optimizer] in convert.py); `step` refuses from then on."""
        state, self.handed_over = self._device_state, True
        state.remove_hooks()
        self._device_state = DeviceState(state.device, state.fmt, fp32_masters=state.fp32_masters)
        self.state.clear()
        self.held_state = {}
        self.master_grads.drop()

    @property
    def step_counts(self) -> torch.Tensor:
        """The step count of each param group, one device tensor (each parameter's "step" in
        `state` and the state dict is a view of its group's entry)."""
        return self._device_state.step_count

    @property
    def bucket_states(self) -> list[state_buffers.BucketState]:
        """The optimizer states of each bucket, in `buckets` order."""
        return [s.state for s in self._device_state.slots]

    @property
    def buckets(self) -> list[Bucket]:
        """The flat buffers, one per (param group, dtype)."""
        return self._device_state.buckets

    @torch.no_grad()
    def step(self, scaler: Optional[LossScaler] = None, *,
             closure: Optional[Callable[[], Any]] = None) -> Any:
        """Unscale, check, clip, update, skip on overflow and advance the loss scale, fused.

        Args:
            scaler: the LossScaler whose scale the gradients carry. The one the last
                `fxamp.optim.scale_loss` used comes first, then this one, then the first of
                `loss_scalers` (Note [Which scaler a step divides by] in folding.py). None of
                them: the gradients are unscaled (no overflow check unless `max_grad_norm`).
            closure: torch.optim's closure, re-evaluating the loss; not with a dynamic scale.

        Returns:
            The closure's loss, or None.
        """
        if callable(scaler) and not isinstance(scaler, LossScaler):
            scaler, closure = None, scaler  # torch.optim's positional closure
        check_scaler_arg(scaler, "step")
        param_groups.check_not_handed_over(self.handed_over, type(self).__name__)
        param_groups.check_left_out(self._left_out, type(self).__name__)
        exits.resolve_unless_step_takes_exit(self)  # Note [Apex's scale_loss exits]
        exits.hand_exit_to_step(self)
        given, scaler = scaler, self.folding.scaler_to_divide_by(scaler)
        # What came since a fold is folded by the scaler it carries or the one given, never by
        # initialize's first scaler (rule 3 of Note [Which scaler a step divides by]).
        pending = scaler if given is not None or self.folding.raw_scaler is not None else None
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, self._flat_params(), "step")
        loss = self._call_closure(closure, scaler)
        state = self._device_state
        if not state.slots:
            return loss
        state.sync_hyper(self.param_groups, self.algorithm)
        state.sync_from_params()
        gathered = self.master_grads.current(self.buckets, scaler)
        unscaled = self.folding.unscaled is not None
        if gathered is not None:
            self._step_from_gathered(gathered.scaler or self._unit, gathered.found)
        elif unscaled:
            self._step_from_unscaled()
        elif not self.folding.folds_nothing():
            self._step_from_folded(pending)
        else:
            self._fused_step(state.grads(), scaler,
                             check=scaler is not None or self.max_grad_norm is not None)
        checkpoint.publish_stepped(self)  # Note [State appears when a parameter is stepped]
        # Unscaled gradients stay in .grad (the gathered path took them): another backward into
        # them must fold them first.
        self.folding.raw_scaler = self._unit if unscaled and gathered is None else None
        return loss

    @property
    def loss_scalers(self) -> tuple[LossScaler, ...]:
        """The scalers `fxamp.optim.scale_loss` picks by `loss_id` (set by `initialize`); the
        first is the one `step()` divides by when no other applies (Note [Which scaler a
        step divides by] in folding.py). Empty for an optimizer built directly."""
        return self.folding.loss_scalers

    def set_loss_scalers(self, scalers: Sequence[LossScaler]) -> None:
        """Give this optimizer the scalers of Apex's `loss_id`s (what `initialize` does with
        its `num_losses` scalers, shared by all the optimizers it returns).

        Raises:
            ConfigError: not a non-empty list of LossScaler.
        """
        self.folding.set_loss_scalers(scalers, type(self).__name__)

    def _call_closure(self, closure: Optional[Callable[[], Any]],
                      scaler: Optional[LossScaler]) -> Any:
        if closure is None:
            return None
        if scaler is not None and scaler.dynamic:
            raise ConfigError(
                "step(closure) cannot be used with dynamic loss scaling: the closure's backward "
                "would run before the step decides the scale (Apex refuses closures too); run "
                "the backward yourself and call step(scaler)")
        with torch.enable_grad():
            return closure()

    def _fused_step(self, grads: Sequence[torch.Tensor], scaler: Optional[LossScaler], *,
                    check: bool, found_in: Optional[torch.Tensor] = None) -> None:
        state = self._device_state
        scale_state = None if scaler is None else scaler.state_tensors(state.device)
        if scaler is not None:
            scaler.scaled_graphs.mark_done(self)
        step_state = fused_step.StepState(state.hyper, state.step_count, self.found_inf,
                                          self.grad_norm)
        coefs = self._fns.prologue(
            grads, step_state, scaler_state=scale_state, found_in=found_in,
            coefs_fn=self.algorithm.coefs, check=check,
            max_norm=state.max_norm(self.max_grad_norm),
            rule=None if scaler is None else scaler.rule, **self._dist_kwargs())
        unsigned, stochastic = state_buffers.rounding(self.algorithm.state_keys, self.state_format)
        for slot, grad in zip(state.slots, grads):
            self._fns.update(slot.update_args(grad), coefs[slot.bucket.group_index],
                             update_fn=self.algorithm.update, unsigned=unsigned,
                             stochastic=stochastic)
            slot.bucket.publish()

    def _dist_kwargs(self) -> dict[str, Any]:
        # Left out without a group, so the single-process call is exactly what it was.
        if self._group is None:
            return {}
        return dict(group=self._group, sharded=self._device_state.sharded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradients; with `set_to_none` (torch's default) every `.grad` is None
        until a backward reaches it (Note [A parameter without a gradient] in flat.py). A
        scale_loss exit no step took still moves the scale (Note [Apex's scale_loss exits])."""
        exits.resolve_exit_of(self)
        for bucket in self.buckets:
            bucket.zero_grad(set_to_none)
        self.master_grads.drop()
        scaled_graphs.release_pending(self)
        self.folding.raw_scaler = None
        self.folding.finish_step()

    def _flat_params(self) -> list[torch.Tensor]:
        return self._device_state.flat_params()

    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for inf/nan gradients. Reads the device flag."""
        return bool(self.found_inf.item())

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout plus fp32 "master_param"s; views of the live buffers."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load fxamp's or torch.optim's state dict into the existing flat buffers."""
        checkpoint.load_state_dict(self, state_dict)
