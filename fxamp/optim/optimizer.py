"""FusedOptimizer: flat buffers, a loss scale and one compiled step for any update rule.

The step is `prologue` + `update` from fused_step.py, compiled for each optimizer (Note [One
compiled step per optimizer]). Nothing in `step` reads a device value: hyperparameters go to
the device only when they change (an lr scheduler costs one scalar fill per group per step), and
whether the step was skipped stays on the device until `last_step_skipped()`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from fxamp.errors import ConfigError
from fxamp.optim import checkpoint, distributed, param_checks, param_groups
from fxamp.optim.buffers import state_buffers
from fxamp.optim.functional import fused_step
from fxamp.optim.scaling import exits, scaled_graphs
from fxamp.optim.functional.algorithms import Algorithm
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.buffers.flat import flatten_param_groups
from fxamp.optim.scaling.folding import GradientFolding
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.optim.scaling.master_grads import MasterGrads
from fxamp.optim.buffers.state_format import as_state_format
from fxamp.optim.buffers.state_format import check_params as check_state_params

__all__ = ["FusedOptimizer"]

log = logging.getLogger(__name__)


class FusedOptimizer(torch.optim.Optimizer):
    """Base of fxamp's Adam, AdamW, SGD and LAMB; subclasses set `algorithm` and the defaults.

    Every parameter with `requires_grad` becomes a view into a flat buffer per (group, dtype);
    16-bit parameters get fp32 masters when `master_weights` is set. Every such parameter takes
    part in every step: one that got no gradient steps with a zero gradient (as in Apex's
    FP16_Optimizer and DeepSpeed), where torch.optim would skip it. Freeze parameters with
    `requires_grad=False` before building the optimizer to leave them out.

    Under torch.distributed (`process_group`, "auto" by default: the default group when it is
    initialized with more than one rank) every rank's step agrees on the overflow flag, and on
    the gradient norm of sharded (FSDP2) parameters, inside the compiled step; DTensor
    parameters are stepped on their local shards. See docs/distributed.md.
    """

    algorithm: Algorithm
    larc: Optional[Any] = None  # LARCSettings once fxamp.optim.LARC applied them
    fuses_loss_scaling = True  # a LossScaler's GradScaler protocol hands it the scaler

    def __init__(self, params: Any, defaults: dict[str, Any], *,
                 max_grad_norm: Optional[float] = None, master_weights: bool = True,
                 compile: bool = True, process_group: Any = distributed.AUTO,
                 state_format: Any = None) -> None:
        self._buckets: Optional[list[Bucket]] = None
        owner = type(self).__name__
        super().__init__(param_checks.as_param_list(params, owner), defaults)
        param_checks.check_has_params(self.param_groups, owner)
        self.max_grad_norm = param_checks.check_max_grad_norm(max_grad_norm)
        self.master_weights = master_weights
        self.state_format = as_state_format(state_format)
        """How masters and moments are stored (StateFormat; docs/optimizer.md)."""
        check_state_params(self.state_format, self.param_groups, master_weights, owner)
        self._fp32_masters = master_weights and self.state_format.master == "fp32"
        self._fns = fused_step.compiled() if compile else fused_step.eager
        self._unit = LossScaler(1.0, compile=compile)  # for unscale_ without any scaler
        self._buckets = flatten_param_groups(
            self.param_groups, master_weights=self._fp32_masters, owner=owner)
        self._init_group(process_group)
        self._left_out = param_groups.left_out(self.param_groups, self._buckets)
        device = next(p for g in self.param_groups for p in g["params"]).device
        self._init_device_state(device)
        self.folding = GradientFolding(self._fns.fold_grads, device, self._fns.unscale_grads)
        """Which scale the gradients carry and what was folded (folding.py)."""
        self.master_grads = MasterGrads(self._fns.gather_grads)  # see master_params
        checkpoint.expose_state(self)

    def _init_group(self, process_group: Any) -> None:
        owner = type(self).__name__
        sharded = [p for b in self._buckets if b.sharded for p in b.params]
        if sharded and self.algorithm.per_tensor_norms:
            raise ConfigError(f"{owner}: {self.algorithm.name}'s per-parameter trust ratio needs "
                              "whole-parameter norms, which sharded (DTensor) parameters do not "
                              "have locally; use AdamW, Adam or SGD with FSDP2")
        self._group = distributed.resolve_group(process_group, sharded, owner)
        self._sharded = tuple(b.sharded for b in self._buckets)
        if self._group is not None:
            log.debug("%s: agreeing on overflow over %d ranks; sharded buckets %s", owner,
                      torch.distributed.get_world_size(self._group), self._sharded)

    def _init_device_state(self, device: torch.device) -> None:
        rows = [self.algorithm.hyper_row(g) for g in self.param_groups]
        self._hyper_seen: list[tuple] = rows
        self._hyper = param_groups.hyper_tensor(rows, device)
        # One step count per param group: a group added later starts at 0, as torch.optim's
        # per-parameter steps (and Apex FusedAdam's per-group one) do.
        self._step_count = torch.zeros(len(rows), dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.bool, device=device)
        """Whether the last step was skipped, as a 0-dim device tensor."""
        self.grad_norm = torch.full((), float("nan"), device=device)
        """Total norm of the unscaled gradients at the last step (only with max_grad_norm)."""
        self._bucket_states = [self._new_states(b) for b in self._buckets]
        self._aux = [self.algorithm.aux(b) for b in self._buckets]
        self._device = device

    def _new_states(self, bucket: Bucket) -> state_buffers.BucketState:
        keys = self.algorithm.state_keys
        if not self.algorithm.has_state(self.param_groups[bucket.group_index]):
            keys = ()
        return state_buffers.BucketState(bucket, self.state_format, keys)

    def set_algorithm(self, algorithm: Algorithm) -> None:
        """Step with another rule of the same hyperparameters and states (LARC around this
        one); the compiled step recompiles once."""
        self.algorithm = algorithm
        self._aux = [algorithm.aux(b) for b in self._buckets]

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
        if self._buckets is None:  # torch.optim.Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            param_checks.check_hyperparameters(self.param_groups[-1], index, owner)
            return
        param_checks.check_added_group({**self.defaults, **param_group}, index, owner,
                                       self._device)
        check_state_params(self.state_format, [*self.param_groups, param_group],
                           self.master_weights, owner)
        super().add_param_group(param_group)  # its own checks fail before it appends
        param_groups.add_buckets(self, index)

    @property
    def step_counts(self) -> torch.Tensor:
        """The step count of each param group, one device tensor (each parameter's "step" in
        `state` and the state dict is a view of its group's entry)."""
        return self._step_count

    @property
    def bucket_states(self) -> list[state_buffers.BucketState]:
        """The optimizer states of each bucket, in `buckets` order."""
        return self._bucket_states

    @property
    def buckets(self) -> list[Bucket]:
        """The flat buffers, one per (param group, dtype)."""
        return self._buckets

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
        _check_scaler_arg(scaler, "step")
        param_groups.check_left_out(self)
        exits.resolve_unless_step_takes_exit(self)  # Note [Apex's scale_loss exits]
        exits.hand_exit_to_step(self)
        # Note [Which scaler a step divides by]; `pending` folds what came since a fold.
        pending = self.folding.scaler_carried(scaler)
        scaler = self.folding.scaler_to_divide_by(scaler)
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, self._flat_params(), "step")
        loss = self._call_closure(closure, scaler)
        if not self._buckets:
            return loss
        self._sync_hyper()
        for bucket in self._buckets:
            bucket.sync_from_params()
        gathered = self.master_grads.current(self._buckets, scaler)
        unscaled = self.folding.unscaled is not None
        if gathered is not None:
            self._step_from_gathered(gathered.scaler or self._unit, gathered.found)
        elif unscaled:
            self._step_from_unscaled()
        elif not self.folding.folds_nothing():
            self._step_from_folded(pending)
        else:
            self._fused_step([b.grad for b in self._buckets], scaler,
                             check=scaler is not None or self.max_grad_norm is not None)
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

    def _call_closure(self, closure, scaler: Optional[LossScaler]) -> Any:
        if closure is None:
            return None
        if scaler is not None and scaler.dynamic:
            raise ConfigError(
                "step(closure) cannot be used with dynamic loss scaling: the closure's backward "
                "would run before the step decides the scale (Apex refuses closures too); run "
                "the backward yourself and call step(scaler)")
        with torch.enable_grad():
            return closure()

    def _fused_step(self, grads, scaler: Optional[LossScaler], *, check: bool,
                    found_in: Optional[torch.Tensor] = None) -> None:
        scale_state = None if scaler is None else scaler.state_tensors(self._device)
        if scaler is not None:
            scaler.scaled_graphs.mark_done(self)
        state = fused_step.StepState(self._hyper, self._step_count, self.found_inf,
                                     self.grad_norm)
        coefs = self._fns.prologue(
            grads, state, scaler_state=scale_state, found_in=found_in,
            coefs_fn=self.algorithm.coefs, check=check, max_norm=self.max_grad_norm,
            rule=None if scaler is None else scaler.rule, **self._dist_kwargs())
        b = self._buckets
        bs = self._bucket_states
        unsigned, stochastic = state_buffers.rounding(self.algorithm.state_keys,
                                                      self.state_format)
        self._fns.update(
            [s.weights(x) for x, s in zip(b, bs)], grads, states=[s.states for s in bs],
            models=[None if x.master is None else x.param for x in b], coefs=coefs,
            groups=tuple(x.group_index for x in b), aux=self._aux, update_fn=self.algorithm.update,
            masters=tuple(s.master for s in bs), seed=self.state_format.seed,
            unsigned=unsigned, stochastic=stochastic)
        for bucket in b:
            bucket.write_back()

    def _dist_kwargs(self) -> dict[str, Any]:
        # Left out without a group, so the single-process call is exactly what it was.
        return {} if self._group is None else dict(group=self._group, sharded=self._sharded)

    def _sync_hyper(self) -> None:
        # Only changed values go to the device, each as a fill (never a blocking copy); tensor
        # values (torch's tensor lr) are copied every step, device to device.
        for gi, group in enumerate(self.param_groups):
            row, seen = self.algorithm.hyper_row(group), self._hyper_seen[gi]
            if all(type(a) is type(b) is float and a == b for a, b in zip(row, seen)):
                continue
            for k, (value, old) in enumerate(zip(row, seen)):
                if isinstance(value, torch.Tensor):
                    self._hyper[gi, k].copy_(value, non_blocking=True)
                elif type(old) is not float or value != old:
                    self._hyper[gi, k].fill_(value)
            self._hyper_seen[gi] = row

    # ------------------------------------------------------------------ several losses / Apex
    def unscale_(self, scaler: Optional[LossScaler] = None) -> None:
        """Fold the gradients so far, divided by `scaler`'s scale, into fp32 buffers.

        Needed only when gradients from losses with different scalers meet in one step, or to
        read unscaled gradients (`fxamp.optim.master_params`); `step` folds the rest and skips
        if any folded scaler saw an overflow. Each scaler then moves by its own overflow.
        """
        _check_scaler_arg(scaler, "unscale_")
        exits.resolve_exit_of(self)
        self._settle_unscaled()
        folding = self.folding
        if scaler is None and folding.raw_scaler is None and not folding.folds_nothing():
            return  # everything since the last backward is folded already
        scaler = scaler or folding.scaler_to_divide_by()  # Note [Which scaler a step divides by]
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, self._flat_params(), "unscale_")
            scaler = self._unit
        folding.fold(scaler, *self._fold_buffers(), owner=self)

    def _fold_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for b in self._buckets:
            if b.acc is None:
                b.acc = torch.zeros(b.grad.shape, dtype=torch.float32, device=self._device)
            b.sync_from_params()
        return [b.grad for b in self._buckets], [b.acc for b in self._buckets]

    # What scale_loss and its exits (exits.py) call.
    def before_backward(self, scaler: LossScaler) -> None:
        """A backward with `scaler` is about to add to the gradients: resolve the exit they
        wait in, and fold them if they carry another scaler's scale."""
        exits.resolve_exit_of(self)
        scaled_graphs.release_dropped(self, self._flat_params)
        self._settle_unscaled()
        if self.folding.raw_scaler is self._unit and self._all_grads_dropped():
            self.folding.raw_scaler = None  # `model.zero_grad()` dropped the unscaled ones
        if self.folding.carries_other(scaler):
            self.unscale_(self.folding.raw_scaler)

    def after_backward(self, scaler: LossScaler) -> None:
        """The raw gradients now carry `scaler`'s scale."""
        self.folding.raw_scaler = scaler

    def fold_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """Resolve a scale_loss exit into `flag` (Note [Apex's scale_loss exits])."""
        self.folding.fold_exit(scaler, flag, *self._fold_buffers(), owner=self)

    def unscale_exit(self, scaler: LossScaler, flag: torch.Tensor) -> None:
        """A scale_loss exit: unscale `.grad` in place, overflow into `flag` (Note [.grad after
        a scale_loss exit] in folding.py)."""
        raws, accs, keep = [], [], []
        for b in self._buckets:
            b.sync_from_params()
            if b.master is not None and b.acc is None:
                b.acc = torch.zeros(b.grad.shape, dtype=torch.float32, device=self._device)
            raws.append(b.grad)
            accs.append(b.acc)
            keep.append(b.master is not None)
        self.folding.unscale_exit(scaler, flag, raws, accs, tuple(keep), owner=self)
        self.folding.raw_scaler = self._unit

    def _settle_unscaled(self) -> None:
        if self.folding.unscaled is not None:
            self.folding.fold_unscaled(*self._fold_buffers())

    def _all_grads_dropped(self) -> bool:
        return all(p.grad is None for p in self._flat_params())

    def _step_from_unscaled(self) -> None:
        # Note [.grad after a scale_loss exit]: the kept fp32 sums, or .grad as written since.
        buckets = self._buckets
        unscaled = self.folding.unscaled
        edited = unscaled.absorb_edits([b.grad for b in buckets], [b.acc for b in buckets])
        grads = [b.acc if keep else b.grad for b, keep in zip(buckets, unscaled.keep)]
        self._fused_step(grads, None, check=edited or self.max_grad_norm is not None,
                         found_in=self.folding.found())
        for b, keep in zip(buckets, unscaled.keep):
            if keep:
                b.acc.zero_()
        self.folding.finish_step()

    def agree_exit_flag_(self, flag: torch.Tensor) -> None:
        """OR an exit's flag over this optimizer's process group, if it has one."""
        if self._group is not None:
            distributed.agree_flags_([flag], self._group)

    def unscale_in_place_(self, scaler: Optional[LossScaler] = None) -> None:
        """`fxamp.optim.unscale_`: resolve a pending scale_loss exit, fold what still carries a
        scale, and move the unscaled sum back into `.grad`; a no-op once done."""
        _check_scaler_arg(scaler, "unscale_")
        exits.resolve_exit_of(self)
        if self.folding.raw_scaler is self._unit:
            return  # done already, and no backward through scale_loss since
        carried = self.folding.scaler_to_divide_by(scaler)
        if carried is not None or self.folding.folds_nothing():
            self.unscale_(carried)
        self._unfold()

    def _unfold(self) -> None:
        # The folded fp32 sum goes back into the raw gradients, which then carry no scale.
        for b in self._buckets:
            b.grad.copy_(b.acc)
            b.acc.zero_()
        self.folding.raw_scaler = self._unit

    def gather_master_grads(self) -> None:
        """Compute the unscaled master gradients that `fxamp.optim.master_params` yields, from
        the raw ones and the scale they carry (Note [Gathered master gradients])."""
        param_groups.check_left_out(self)
        exits.resolve_unless_step_takes_exit(self)
        scaler = self.folding.scaler_to_divide_by()
        if scaler is None:
            scaled_graphs.check_no_pending_scale(self, self._flat_params(), "master_params")
        for bucket in self._buckets:
            bucket.sync_from_params()
        sources = None
        unscaled = self.folding.unscaled
        if unscaled is not None:  # Note [.grad after a scale_loss exit]: unscaled already
            b = self._buckets
            unscaled.absorb_edits([x.grad for x in b], [x.acc for x in b])
            sources = [x.acc if keep else x.grad for x, keep in zip(b, unscaled.keep)]
        self.master_grads.gather(self._buckets, scaler, self._unit, self._device, sources)

    def _step_from_gathered(self, scaler: LossScaler, found: torch.Tensor) -> None:
        # The gathered gradients hold the folded ones and the raw ones, unscaled.
        self.folding.record_fold(scaler, self, found=found)
        self._fused_step(self.master_grads.buffers, None, check=True,
                         found_in=self.folding.found())
        for b in self._buckets:
            b.grad.zero_()  # taken, as a fold takes them
            if b.acc is not None:
                b.acc.zero_()
        self.master_grads.drop()
        self.folding.finish_step()

    def _step_from_folded(self, pending: Optional[LossScaler]) -> None:
        if pending is not None:
            self.unscale_(pending)
        if self._group is not None:  # each scaler then moves by the flag all ranks agree on
            distributed.agree_flags_(self.folding.folded_flags(), self._group)
        self._fused_step([b.acc for b in self._buckets], None, check=True,
                         found_in=self.folding.found())
        for b in self._buckets:
            b.acc.zero_()
        self.folding.finish_step()

    # ------------------------------------------------------------------------------ plumbing
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradients in place; `set_to_none` is accepted and ignored, because the
        `.grad` views must stay in the flat buffer. A scale_loss exit whose gradients no step
        took still moves the scale, as in Apex (Note [Apex's scale_loss exits])."""
        exits.resolve_exit_of(self)
        for bucket in self._buckets:
            bucket.zero_grad()
        self.master_grads.drop()
        scaled_graphs.release_pending(self)
        self.folding.raw_scaler = None
        self.folding.finish_step()

    def _flat_params(self) -> list[torch.Tensor]:
        return [p for b in self._buckets for p in b.params]

    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for inf/nan gradients. Reads the device flag."""
        return bool(self.found_inf.item())

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout (per-parameter "step" and states, "param_groups") plus each
        16-bit parameter's fp32 "master_param"; values are views of the live buffers."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load fxamp's or torch.optim's state dict (masters come from the parameters when the
        dict has none) into the existing flat buffers."""
        checkpoint.load_state_dict(self, state_dict)


def _check_scaler_arg(scaler: Any, call: str) -> None:
    if scaler is None or isinstance(scaler, LossScaler):
        return
    hint = ""
    if isinstance(scaler, torch.amp.GradScaler):
        hint = ("; build fxamp.optim.LossScaler(semantics='torch') instead (its "
                "load_state_dict takes the GradScaler's state_dict())")
    raise ConfigError(f"{call}(scaler) takes an fxamp.optim.LossScaler (or nothing), not "
                      f"{type(scaler).__name__}{hint}")
