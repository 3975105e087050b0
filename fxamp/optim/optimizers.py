"""fxamp's Adam, AdamW, SGD and LAMB: torch.optim's (and Apex FusedLAMB's) rules, one fused
compiled step over flat buffers, with loss scaling, fp32 masters and gradient clipping built in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from torch.optim.optimizer import ParamsT

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.optim.functional import algorithms
from fxamp.optim import apex_keywords
from fxamp.optim.distributed import AUTO
from fxamp.optim.buffers.state_format import StateFormat
from fxamp.optim.optimizer import FusedOptimizer

if TYPE_CHECKING:  # torch.distributed may be unavailable
    from torch.distributed import ProcessGroup

__all__ = ["Adam", "AdamW", "SGD", "LAMB"]

_COMMON_ARGS = """
        max_grad_norm: clip the total norm of the unscaled gradients to this value inside the
            step (torch.nn.utils.clip_grad_norm_'s formula); the norm is kept in `grad_norm`.
        master_weights: keep fp32 master copies of float16/bfloat16 parameters (default True).
        compile: compile the step with torch.compile (Inductor); False runs the same functions
            eagerly.
        **apex_options: the keywords Apex's fused optimizer took (FusedAdam: amsgrad,
            adam_w_mode, bias_correction, set_grad_none, capturable; FusedLAMB: amsgrad,
            adam_w_mode, set_grad_none; FusedSGD: wd_after_momentum, materialize_master_grads,
            set_grad_none), accepted with the values fxamp computes and refused with the fix
            otherwise (docs/optimizer.md).
        state_format: how masters and moments are stored: a StateFormat, or a preset name
            ("default": fp32 masters and moments; "low_memory": the bf16 model as its own
            master with an int8 error term and int8 moments, about 7 bytes per parameter with
            the model and its gradient; "compensated"); see docs/optimizer.md.
        process_group: the torch.distributed group whose ranks agree on skipping (and on the
            norm of sharded gradients) inside the step: "auto" (default) takes the default group
            when torch.distributed is initialized with more than one rank; None: no agreement."""


def _check_apex(opt: FusedOptimizer, given: dict[str, Any]) -> None:
    # Before anything is flattened: a refusal leaves the parameters as they were.
    apex_keywords.check(type(opt).__name__, given, type(opt)._apex_table)


def _tuple(betas: object) -> object:
    return tuple(betas) if isinstance(betas, list) else betas  # torch.optim stores a tuple


class Adam(FusedOptimizer):
    __doc__ = f"""torch.optim.Adam (L2 weight decay) as one fused, compiled mixed-precision step.

    Args:
        params: parameters or param groups, as for torch.optim.
        lr, betas, eps, weight_decay: as torch.optim.Adam; per group, and changeable between
            steps (an lr scheduler) without recompiling.{_COMMON_ARGS}
    """

    algorithm = algorithms.ADAM
    _apex_table = apex_keywords.ADAM

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *,
                 max_grad_norm: Optional[float] = None, master_weights: bool = True,
                 compile: bool = True, process_group: Union[ProcessGroup, str, None] = AUTO,
                 state_format: Union[StateFormat, str, None] = None,
                 **apex: bool) -> None:
        _check_apex(self, apex)
        defaults = dict(lr=lr, betas=_tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         master_weights=master_weights, compile=compile,
                         process_group=process_group, state_format=state_format)


class AdamW(Adam):
    __doc__ = f"""torch.optim.AdamW (decoupled weight decay) as one fused, compiled step.

    Args:
        params: parameters or param groups, as for torch.optim.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (weight_decay defaults to 0.01).
            {_COMMON_ARGS}
    """

    algorithm = algorithms.ADAMW
    _apex_table = apex_keywords.ADAMW

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)


class SGD(FusedOptimizer):
    __doc__ = f"""torch.optim.SGD (momentum, dampening, Nesterov, L2 decay) as one fused step.

    Args:
        params: parameters or param groups, as for torch.optim.
        lr, momentum, dampening, weight_decay, nesterov: as torch.optim.SGD. A group keeps a
            momentum buffer only if its momentum is non-zero when the optimizer is built.
            {_COMMON_ARGS}
    """

    algorithm = algorithms.SGD
    _apex_table = apex_keywords.SGD

    def __init__(self, params: ParamsT, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 max_grad_norm: Optional[float] = None, master_weights: bool = True,
                 compile: bool = True, process_group: Union[ProcessGroup, str, None] = AUTO,
                 state_format: Union[StateFormat, str, None] = None,
                 **apex: bool) -> None:
        _check_apex(self, apex)
        if nesterov and (validation.non_negative(momentum, "momentum") <= 0
                         or validation.non_negative(dampening, "dampening") != 0):
            raise ConfigError("nesterov=True needs momentum > 0 and dampening = 0 "
                              f"(got momentum={momentum!r}, dampening={dampening!r})")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         master_weights=master_weights, compile=compile,
                         process_group=process_group, state_format=state_format)


class LAMB(FusedOptimizer):
    __doc__ = f"""Apex FusedLAMB (adam_w_mode=True) as one fused, compiled step.

    The Adam direction plus decoupled weight decay, scaled per parameter tensor by the trust
    ratio ||w|| / ||update|| (applied when weight_decay != 0 or use_nvlamb, as in Apex), after
    global gradient-norm clipping (max_grad_norm=1.0 by default, as in Apex).

    Args:
        params: parameters or param groups, as for torch.optim.
        lr, betas, eps, weight_decay, grad_averaging, use_nvlamb, bias_correction: as Apex's
            FusedLAMB.{_COMMON_ARGS}
    """

    algorithm = algorithms.LAMB
    _apex_table = apex_keywords.LAMB

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, *, grad_averaging: bool = True,
                 use_nvlamb: bool = False, bias_correction: bool = True,
                 max_grad_norm: Optional[float] = 1.0, master_weights: bool = True,
                 compile: bool = True, process_group: Union[ProcessGroup, str, None] = AUTO,
                 state_format: Union[StateFormat, str, None] = None,
                 **apex: bool) -> None:
        _check_apex(self, apex)
        defaults = dict(lr=lr, betas=_tuple(betas), eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, use_nvlamb=use_nvlamb,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         master_weights=master_weights, compile=compile,
                         process_group=process_group, state_format=state_format)
