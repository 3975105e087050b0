"""Skipped-step reporting for training loops, without a host read per step.

An fxamp optimizer decides to skip a step on the device (Note [Skipping without a host read] in
docs/design.md) and leaves the decision in a 0-dim flag. `SkipMonitor` folds that
flag into device counters after every step (three tiny device ops, no read) and reads them back
once every `every` steps, only if its log level is enabled or a locator is waiting: then it
logs how many steps were skipped since the last read, with the loss scale they left, and runs
the overflow locator once a run of consecutive skips is long enough.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from fxamp.errors import ConfigError
from fxamp.optim import FP16_Optimizer, FusedOptimizer, LossScaler

__all__ = ["SkipMonitor"]

log = logging.getLogger(__name__)

_SKIPPED, _RUN, _LONGEST = 0, 1, 2


def _check_flag(optimizer: Any) -> None:
    if not isinstance(optimizer, (FusedOptimizer, FP16_Optimizer)):
        raise ConfigError(f"{type(optimizer).__name__} has no device overflow flag (found_inf): "
                          "SkipMonitor works with fxamp's optimizers (fxamp.optim.Adam, AdamW, "
                          "SGD, LAMB, FP16_Optimizer, initialize's)")


class SkipMonitor:
    """Count the steps an fxamp optimizer skipped for inf/NaN gradients, and say so.

    Example:
        >>> monitor = SkipMonitor(opt, every=100, locate_after=10, locate=lambda scale:
        ...     fxamp.locate_overflow(model, batch, loss_fn, loss_scale=scale))

    `locate` refers to the loop's `batch` variable, so it runs on the batch of the step being
    checked. Torch optimizers (fxamp's Adam, AdamW, SGD, LAMB) call `update()` from a step
    post-hook; with `FP16_Optimizer`, call `monitor.update()` after each `step()`.

    Args:
        optimizer: an fxamp optimizer (its `found_inf` flag is read).
        scaler: the LossScaler whose scale to report; default: the one passed to `step`, else
            the optimizer's own (`loss_scalers[0]`).
        every: read the counters back every `every` steps (one host read), at most one log
            line each time; 1 reads every step.
        level: the logging level of the line (WARNING by default).
        locate_after: run `locate` once this many consecutive steps were skipped (checked
            at each read, so up to `every` steps late).
        locate: `locate(loss_scale) -> OverflowReport`; its report is logged and kept in
            `reports`.
        logger: where the lines go (default: this module's logger, "fxamp.debug.skips").
    """

    def __init__(self, optimizer: Any, *, scaler: Any = None, every: int = 100,
                 level: int = logging.WARNING, locate_after: Optional[int] = None,
                 locate: Optional[Callable[[float], Any]] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"every={every!r} must be a positive int")
        if locate_after is not None and (locate is None or locate_after < 1):
            raise ConfigError(f"locate_after={locate_after!r} needs a positive count and a "
                              "locate callable")
        self.optimizer, self.scaler, self.every, self.level = optimizer, scaler, every, level
        self.locate_after, self.locate = locate_after, locate
        self.logger = logger or log
        _check_flag(optimizer)
        self._counts = torch.zeros(3, dtype=torch.int64, device=optimizer.found_inf.device)
        self.steps = 0
        """Steps seen so far (a host count, no read)."""
        self.reports: list[Any] = []
        """The locator's reports, oldest first."""
        self._read_at, self._skipped_at_read = 0, 0
        self._step_scaler: Any = None
        hook = getattr(optimizer, "register_step_post_hook", None)
        self._handle = hook(self._after_step) if callable(hook) else None

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        # torch passes the step's own arguments, `self` first: step(scaler) names the scaler.
        scaler = next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, LossScaler)), None)
        self._step_scaler = scaler or self._step_scaler
        self.update()

    def update(self) -> None:
        """Fold the last step's flag into the device counters; read them every `every` steps."""
        flag = self.optimizer.found_inf.to(torch.int64)
        c = self._counts
        run = (c[_RUN] + 1) * flag
        c.copy_(torch.stack([c[_SKIPPED] + flag, run, torch.maximum(c[_LONGEST], run)]))
        self.steps += 1
        if self.steps % self.every == 0 and (self.locate_after is not None
                                             or self.logger.isEnabledFor(self.level)):
            self._read()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far. Reads the device counter."""
        return int(self._counts[_SKIPPED])

    def _scaler(self) -> Any:
        owned = self.optimizer.loss_scalers  # FP16_Optimizer's own, or initialize's
        return self.scaler or self._step_scaler or (owned[0] if owned else None)

    def _read(self) -> None:
        scaler = self._scaler()
        scale = scaler.scale_tensor.to(self._counts.device, torch.float64).reshape(1) \
            if scaler is not None else torch.full((1,), float("nan"), dtype=torch.float64,
                                                  device=self._counts.device)
        skipped, _, longest, scale_now = torch.cat([self._counts.double(), scale]).tolist()
        new, since = int(skipped) - self._skipped_at_read, self.steps - self._read_at
        self._read_at, self._skipped_at_read = self.steps, int(skipped)
        if new:
            self.logger.log(self.level, "fxamp: %d of the last %d optimizer steps skipped for "
                            "inf/nan gradients (%d of %d in all); loss scale now %g", new, since,
                            int(skipped), self.steps, scale_now)
        if self.locate_after is not None and longest >= self.locate_after:
            self._counts[_RUN:].zero_()  # the next locate needs a fresh run of skips
            report = self.locate(scale_now)
            self.reports.append(report)
            self.logger.log(self.level, "fxamp: %d consecutive steps skipped; overflow "
                            "locator:\n%s", int(longest), report)

    def close(self) -> None:
        """Remove the step hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __repr__(self) -> str:
        return (f"SkipMonitor({type(self.optimizer).__name__}, every={self.every}, "
                f"steps={self.steps})")
