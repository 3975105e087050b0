"""torch.amp.GradScaler's protocol on a LossScaler: per-optimizer states, `unscale_`, `step`.

# Note [GradScaler's protocol]
Code written for GradScaler (`scaler.scale(loss).backward(); scaler.unscale_(opt); clip;
scaler.step(opt); scaler.update()`) drives a LossScaler unchanged. As in GradScaler, each
optimizer goes READY -> (UNSCALED) -> STEPPED between two `update()`s and skips on the
overflow of its own gradients; the scale moves once, at `update()`, by the OR of the flags of
every optimizer unscaled or stepped since the last one, so several optimizers (or several
`step`s of one loss) all divide by the same scale.
- fxamp's optimizers (`fuses_loss_scaling`): `unscale_` is `fxamp.optim.unscale_` and `step`
  is their fused step, both given `held(scaler)`, the same scale tensors with a rule that does
  not move them (`ScaleRule.moves=False`). The step stays one compiled graph pair without a
  host read; the flag it leaves on the device (`opt.found_inf`) is what `update()` ORs, and
  `update()` moves the scale in one more small compiled graph, still without a host read.
- torch.optim optimizers: what GradScaler does: torch's unscale kernel per device and dtype
  into a found_inf flag, one host read of that flag in `step` (skip if set), `opt.step()`.
  Their parameters must not be float16 (GradScaler refuses to unscale float16 gradients:
  `check_master_weights` names the fix), and bfloat16 ones warn once.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional

import torch

from fxamp._compat import unscale_and_check_
from fxamp.errors import ConfigError
from fxamp.optim.functional.fused_step import inverse
from fxamp.master_weights import check_master_weights
from fxamp.optim.scaling.scale_round import ScaleRound

if TYPE_CHECKING:
    from fxamp.optim.scaling.loss_scaler import LossScaler

__all__ = ["OptState", "OptimizerStates", "held"]


# Where an optimizer is between two `update()`s: GradScaler's own enum (READY: nothing done
# since the last update(); UNSCALED: unscale_(opt) ran, .grad holds the unscaled gradients;
# STEPPED: step(opt) ran or skipped the step), so that code comparing a stage with torch's
# (Lightning's tests do) reads fxamp's scaler as it reads GradScaler.
OptState = torch.amp.grad_scaler.OptState


@dataclasses.dataclass
class _Record:
    stage: OptState = OptState.READY
    found: Optional[torch.Tensor] = None  # 0-dim bool device flag of the optimizer's gradients


class OptimizerStates:
    """Each optimizer's OptState and overflow flag since the last `update()` (GradScaler's
    `_per_optimizer_states`)."""

    def __init__(self) -> None:
        self._records: dict[int, _Record] = {}

    def stage(self, optimizer: Any) -> OptState:
        return self._records.get(id(optimizer), _Record()).stage

    def unscale_(self, scaler: "LossScaler", optimizer: Any) -> None:
        fused = _check_optimizer(optimizer, "unscale_")
        stage = self.stage(optimizer)
        if stage is not OptState.READY:
            raise ConfigError(f"scaler.unscale_(optimizer) was called on this "
                              f"{type(optimizer).__name__} after {_DONE[stage]} since the last "
                              "scaler.update(); call unscale_ at most once per step, before "
                              "step()")
        if fused:
            flag = _unscale_fused(scaler, optimizer)
        else:
            check_master_weights(optimizer, "scaler.unscale_")
            flag = _unscale_torch(scaler, optimizer)
        self._records[id(optimizer)] = _Record(OptState.UNSCALED, flag)

    def step(self, scaler: "LossScaler", optimizer: Any, args: tuple,
             kwargs: dict[str, Any]) -> Any:
        fused = _check_optimizer(optimizer, "step")
        if "closure" in kwargs or (fused and args):
            raise ConfigError(
                "scaler.step(optimizer, closure) is not supported, as in GradScaler: a closure's "
                "backward would run after the step decided whether to skip. Run the forward and "
                "scaler.scale(loss).backward() yourself, then call scaler.step(optimizer)")
        if self.stage(optimizer) is OptState.STEPPED:
            raise ConfigError(f"scaler.step(optimizer) was called twice on this "
                              f"{type(optimizer).__name__} since the last scaler.update(); call "
                              "scaler.update() once after the steps of each iteration")
        if fused:
            optimizer.step(held(scaler, optimizer.folding.device))
            self._records[id(optimizer)] = _Record(OptState.STEPPED, optimizer.found_inf.clone())
            return None
        if self.stage(optimizer) is OptState.READY:
            self.unscale_(scaler, optimizer)
        record = self._records[id(optimizer)]
        record.stage = OptState.STEPPED
        if bool(record.found):  # a host read, as GradScaler's
            return None
        return optimizer.step(*args, **kwargs)

    def pop_found(self, device: torch.device, *, needed: bool) -> Optional[torch.Tensor]:
        """Whether any optimizer unscaled or stepped since the last `update()` saw inf/nan (a
        0-dim device flag; None if none was); every optimizer is READY again.

        Raises:
            ConfigError: `needed` and no optimizer was unscaled or stepped.
        """
        flags = [r.found.reshape(()).to(device) for r in self._records.values()
                 if r.found is not None]
        if needed and not self._records:
            raise ConfigError(
                "scaler.update() found no scaler.step(optimizer) or scaler.unscale_(optimizer) "
                "since the last update(), so no overflow to move the scale by (after "
                "opt.step(scaler), fxamp's own form, the scale moved in the step already)")
        self._records = {}
        return torch.stack(flags).any() if flags else None


_DONE = {OptState.UNSCALED: "unscale_()", OptState.STEPPED: "step()"}


def _check_optimizer(optimizer: Any, call: str) -> bool:
    """Whether `optimizer` is one of fxamp's fused optimizers; refuse what is no optimizer."""
    if getattr(optimizer, "fuses_loss_scaling", False):
        return True
    if isinstance(optimizer, torch.optim.Optimizer):
        return False
    hint = ""
    if getattr(optimizer, "loss_scalers", None):  # FP16_Optimizer: it scales its own loss
        hint = ("; FP16_Optimizer holds its own loss scaler: use optimizer.backward(loss) and "
                "optimizer.step()")
    raise ConfigError(f"scaler.{call}(optimizer) takes a torch.optim.Optimizer or an fxamp "
                      f"optimizer (fxamp.optim.AdamW, ...), not {type(optimizer).__name__}"
                      f"{hint}")


def _unscale_fused(scaler: "LossScaler", optimizer: Any) -> torch.Tensor:
    view = held(scaler, optimizer.folding.device)
    optimizer.unscale_in_place_(view)
    return view.scale_round.found.clone()  # this unscale_'s overflow, before the step clears it


def _unscale_torch(scaler: "LossScaler", optimizer: Any) -> Optional[torch.Tensor]:
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise ConfigError("scaler.unscale_: sparse gradients are not supported; "
                                      "use torch.amp.GradScaler for sparse embeddings")
                by_device[p.grad.device][p.grad.dtype].append(p.grad)
    if not by_device:
        return None
    flags = []
    for device, by_dtype in by_device.items():
        inv_scale = inverse(scaler.state_tensors(device)[0]).reshape(1)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for grads in by_dtype.values():
            unscale_and_check_(grads, found, inv_scale)
        flags.append(found)
    home = scaler.scale_tensor.device
    return torch.stack([f.to(home) for f in flags]).any()


def held(scaler: "LossScaler", device: torch.device) -> "LossScaler":
    """`scaler`'s tensors (shared, not copied) under a rule that never moves them, for a fused
    step driven by GradScaler's protocol: `update()` moves the scale (see the Note)."""
    scaler.state_tensors(device)
    view = copy.copy(scaler)
    view.rule = scaler.rule._replace(moves=False)
    view.scale_round = ScaleRound()  # nothing pending or folded on the held view
    return view
