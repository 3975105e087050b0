"""Compiled mixed-precision optimizers, loss scaling and Apex-style entry points.

`Adam`, `AdamW`, `SGD` and `LAMB` step flat buffers with one compiled graph pair (unscale,
overflow check, clipping, update, skip, master -> model copy, loss-scale update; no host read);
`LARC` puts Apex's trust-ratio learning rates into their step;
`LossScaler` holds a static or dynamic scale on the device and speaks torch.amp.GradScaler's
protocol; `initialize`, `scale_loss`,
`unscale_`, `master_params`, `FP16_Optimizer` and the amp state dict helpers mirror Apex.
"""

from fxamp.optim.apex.amp_state import amp_state_dict, load_amp_state_dict, load_state_dict, state_dict
from fxamp.optim.apex.amp import initialize, master_params
from fxamp.optim.apex.fp16_optimizer import FP16_Optimizer
from fxamp.optim.apex.larc import LARC
from fxamp.optim.scaling.loss_scaler import LossScaler
from fxamp.master_weights import MasterWeightsWarning, check_master_weights
from fxamp.optim.optimizer import FusedOptimizer
from fxamp.optim.optimizers import LAMB, SGD, Adam, AdamW
from fxamp.optim.apex.scale_loss import scale_loss, unscale_
from fxamp.optim.scaling.scaler_protocol import OptState
from fxamp.optim.buffers.state_format import StateFormat

__all__ = [
    "Adam",
    "AdamW",
    "SGD",
    "LAMB",
    "LARC",
    "FP16_Optimizer",
    "FusedOptimizer",
    "LossScaler",
    "OptState",
    "MasterWeightsWarning",
    "check_master_weights",
    "StateFormat",
    "initialize",
    "scale_loss",
    "unscale_",
    "master_params",
    "amp_state_dict",
    "load_amp_state_dict",
    "state_dict",
    "load_state_dict",
]
