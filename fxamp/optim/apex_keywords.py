"""The keywords Apex's FusedAdam, FusedLAMB and FusedSGD took that torch.optim's do not.

Code moving from `apex.optimizers` passes them, so fxamp's optimizers accept each one with the
values fxamp computes exactly and refuse any other value before anything is flattened, with the
reason and the fix. The table is data: keyword -> (accepted values, what to do otherwise).
"""

from __future__ import annotations

from typing import Any, Mapping

from fxamp.errors import ConfigError

__all__ = ["ADAM", "ADAMW", "LAMB", "SGD", "check"]

_AMSGRAD = ((False,), "Apex's FusedAdam and FusedLAMB did not support it either; "
                      "torch.optim.Adam(amsgrad=True) passed to fxamp.optim.initialize is "
                      "wrapped in FP16_Optimizer")
_SET_GRAD_NONE = ((True, False), "")  # the gradients live in the flat buffer: zeroed in place
_CAPTURABLE = ((False,), "fxamp's step never reads a device value on the host already; CUDA "
                         "graph capture of it is not supported: drop the argument")
_BIAS_CORRECTION = ((True,), "Adam without bias correction has no fused version; use "
                             "fxamp.optim.LAMB(bias_correction=False) or keep the default")

ADAM: Mapping[str, tuple[tuple[Any, ...], str]] = {
    "amsgrad": _AMSGRAD,
    "adam_w_mode": ((False,), "FusedAdam's adam_w_mode=True (its default) is decoupled weight "
                              "decay: use fxamp.optim.AdamW"),
    "bias_correction": _BIAS_CORRECTION,
    "set_grad_none": _SET_GRAD_NONE,
    "capturable": _CAPTURABLE,
}
ADAMW = {**ADAM, "adam_w_mode": ((True,), "adam_w_mode=False is Adam's L2 weight decay: use "
                                          "fxamp.optim.Adam")}
LAMB = {
    "amsgrad": _AMSGRAD,
    "adam_w_mode": ((True,), "FusedLAMB's L2 mode (weight decay added to the gradient) has no "
                             "fused version; keep adam_w_mode=True"),
    "set_grad_none": _SET_GRAD_NONE,
}
SGD = {
    "wd_after_momentum": ((False,), "FusedSGD's weight decay after the momentum has no fused "
                                    "version; keep the default (torch.optim.SGD's order)"),
    "materialize_master_grads": ((True, False), ""),  # how Apex stored master grads
    "set_grad_none": _SET_GRAD_NONE,
}


def check(owner: str, given: Mapping[str, Any],
          table: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
    """Refuse unknown keywords (TypeError, as Python would) and values fxamp does not compute.

    Raises:
        TypeError: a keyword that neither torch.optim nor Apex took.
        ConfigError: a known keyword with an unsupported value; names the value and the fix.
    """
    for key, value in given.items():
        if key not in table:
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}")
        accepted, fix = table[key]
        if not isinstance(value, bool):
            raise ConfigError(f"{owner}: {key}={value!r} must be True or False")
        if value not in accepted:
            raise ConfigError(f"{owner}: {key}={value!r} is not supported: {fix}")
