"""torch.optim internals: what an lr scheduler records about its optimizer."""

from __future__ import annotations

import torch

# The flag the wrapper an LRScheduler puts around `optimizer.step` sets, and that the
# scheduler's first `step()` reads to warn that it ran before `optimizer.step()` ("Detected
# call of `lr_scheduler.step()` before `optimizer.step()`"). Checked on 2.11.0, 2.13.0, 2.14.1.
SCHEDULER_SAW_STEP_ATTR = "_opt_called"


def mark_stepped_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Tell the lr schedulers built on `optimizer` that an optimizer step ran, as their wrapper
    of `optimizer.step` does. Checked on 2.11.0, 2.13.0, 2.14.1."""
    setattr(optimizer, SCHEDULER_SAW_STEP_ATTR, True)
