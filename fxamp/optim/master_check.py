"""The guard for 16-bit weights stepped by an optimizer that keeps no fp32 master weights.

# Note [16-bit weights need fp32 masters]
`fxamp.compile(model, opt_level="O2")` (or O3) stores the weights in float16 or bfloat16. A
torch.optim optimizer steps them in place, in that dtype: an update below half a unit in the
last place of a weight (2**-8 of it in bfloat16, 2**-11 in float16) rounds away, so small
learning rates leave many weights unchanged (35 % of a tiny model's weights never moved in 6
AdamW steps), and nothing says so. fxamp's optimizers keep fp32 masters for exactly this. Where
fxamp sees such an optimizer (the GradScaler protocol of a LossScaler, the Lightning plugin) it
refuses float16 weights, as GradScaler refuses to unscale float16 gradients, and warns once per
optimizer for bfloat16 ones (bfloat16 training without masters is a choice some make knowingly).
"""

from __future__ import annotations

import warnings
from typing import MutableSet

import torch

from fxamp.errors import ConfigError

__all__ = ["MasterWeightsWarning", "check_master_weights"]


class MasterWeightsWarning(UserWarning):
    """bfloat16 weights stepped by an optimizer without fp32 masters (Note [16-bit weights need
    fp32 masters] in fxamp/optim/master_check.py)."""


def check_master_weights(optimizer: torch.optim.Optimizer, caller: str,
                         warned: MutableSet[torch.optim.Optimizer]) -> None:
    """Refuse float16 parameters in a torch.optim `optimizer` (it keeps no fp32 masters); warn
    once per optimizer (remembered in `warned`) for bfloat16 ones. fxamp's own optimizers
    (`fuses_loss_scaling`) are never refused: they keep masters unless told not to.

    Raises:
        ConfigError: float16 parameters; the message names them and the fix.
    """
    if getattr(optimizer, "fuses_loss_scaling", False) or optimizer in warned:
        return
    low = [(gi, i, p.dtype) for gi, g in enumerate(optimizer.param_groups)
           for i, p in enumerate(g["params"]) if p.dtype in (torch.float16, torch.bfloat16)]
    if not low:
        return
    name = type(optimizer).__name__
    gi, i, dtype = next((x for x in low if x[2] == torch.float16), low[0])
    what = (f"{caller}: this torch.optim {name} steps {len(low)} {str(dtype)[6:]} parameters "
            f"(param_groups[{gi}]['params'][{i}] first), e.g. weights fxamp.compile(model, "
            f"opt_level='O2') stored in 16 bits, and keeps no fp32 master weights: updates "
            f"smaller than a weight's precision are lost")
    fix = (". Build fxamp.optim.AdamW / Adam / SGD / LAMB over the same parameters (fp32 "
           "masters, fused unscale and skip), or use opt_level='O1' (fp32 weights)")
    if dtype == torch.float16:
        raise ConfigError(what + " and float16 gradients cannot be unscaled in place safely "
                          "(torch.amp.GradScaler refuses them too)" + fix)
    warned.add(optimizer)
    warnings.warn(what + fix, MasterWeightsWarning, stacklevel=3)
