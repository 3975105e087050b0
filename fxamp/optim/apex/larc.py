"""LARC (layer-wise adaptive rate clipping) as Apex's `apex.parallel.LARC` computed it, inside
the fused step.

Apex's LARC wrapped any optimizer and, before its step, rewrote each parameter's gradient:
when both norms are non-zero, `adaptive_lr = trust_coefficient * |w| / (|g| + |w| * wd +
eps)`, with `clip=True` clipped to the group's lr (`min(adaptive_lr / lr, 1)`), and
`g = (g + wd * w) * adaptive_lr`; it then stepped the optimizer with its weight decay set to 0
(the decay is in the gradient) and put the decay back. Here the same is a rule around the
optimizer's own (`larc_algorithm`): one extra pair of per-parameter norms over the flat
buffers (`algorithms.tensor_norms`, as LAMB's trust ratio), on the fp32 masters and the
unscaled, clipped gradients, as Apex's amp handed them to LARC. The group's `weight_decay`
stays what the user set; the rule reads it, and hands the inner rule 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from fxamp import validation
from fxamp.errors import ConfigError
from fxamp.optim.functional.algorithms import Algorithm, chunk_owners, per_element, tensor_norms
from fxamp.optim.apex.convert import fused_class, to_fused
from fxamp.optim.buffers.bucket import Bucket
from fxamp.optim.optimizer import FusedOptimizer

__all__ = ["LARC", "LARCSettings", "apply_larc", "larc_algorithm"]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class LARCSettings:
    """Apex LARC's three arguments (read-only: changing them would need a new step)."""

    trust_coefficient: float = 0.02
    clip: bool = True
    eps: float = 1e-8


def LARC(optimizer: Any, trust_coefficient: float = 0.02, clip: bool = True,  # noqa: N802
         eps: float = 1e-8) -> FusedOptimizer:
    """Apex's `apex.parallel.LARC(optimizer, trust_coefficient, clip, eps)`: the optimizer,
    stepping with LARC's per-parameter learning rate inside its fused step.

    Apex's call shape: `optimizer = LARC(optimizer)`, then `initialize(model, optimizer, ...)`
    (which keeps LARC on the optimizer it returns). An fxamp optimizer is changed in place and
    returned; torch's SGD, Adam and AdamW are converted to fxamp's first, as `initialize`
    converts them. The result is the fxamp optimizer itself (`opt.larc` holds the settings),
    so lr schedulers, state dicts, `scale_loss` and `master_params` work on it directly.

    Args:
        optimizer: an fxamp SGD, Adam, AdamW or LAMB, or torch's SGD, Adam or AdamW.
        trust_coefficient: the trust coefficient (Apex's default 0.02).
        clip: True: each parameter's lr is min(lr, local lr); False: lr * local lr.
        eps: added to the denominator of the local lr.

    Raises:
        ConfigError: an optimizer fxamp has no fused version of, one already stepping with
            LARC or holding sharded parameters, or a bad setting; nothing changes then.
    """
    settings = LARCSettings(
        validation.positive_finite(trust_coefficient, "trust_coefficient"),
        validation.boolean(clip, "clip"),
        validation.non_negative(eps, "eps"))
    cls = fused_class(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None
    if cls is None:
        raise ConfigError(
            f"LARC({type(optimizer).__name__}): LARC runs inside fxamp's fused step, which "
            "has the SGD, Adam, AdamW and LAMB rules (fxamp.optim's, or torch.optim's SGD, "
            "Adam and AdamW without amsgrad/maximize); use one of those")
    _check_can_apply(optimizer)
    if not isinstance(optimizer, FusedOptimizer):
        optimizer = to_fused(optimizer, cls, master_weights=True, compile=True)
    apply_larc(optimizer, settings)
    return optimizer


def _check_can_apply(opt: Any) -> None:
    if getattr(opt, "larc", None) is not None:
        raise ConfigError(f"this {type(opt).__name__} already steps with LARC ({opt.larc}); "
                          "apply LARC once")
    if isinstance(opt, FusedOptimizer) and any(b.sharded for b in opt.buckets):
        raise ConfigError(f"LARC({type(opt).__name__}): LARC's per-parameter norms need whole "
                          "parameters, which sharded (DTensor) parameters do not have locally")


def apply_larc(opt: FusedOptimizer, settings: LARCSettings) -> None:
    """Make `opt` step with LARC (checked first; nothing changes on a refusal)."""
    _check_can_apply(opt)
    opt.set_algorithm(larc_algorithm(opt.algorithm, settings))
    opt.larc = settings


@functools.lru_cache(maxsize=None)
def larc_algorithm(inner: Algorithm, settings: LARCSettings) -> Algorithm:
    """`inner` with Apex's LARC gradient rewrite in front and its weight decay set to 0; the
    same object for equal arguments, so that LARC optimizers of equal settings are one kind of
    compiled step (Note [One compiled step per kind] in docs/design.md)."""
    return dataclasses.replace(
        inner, name=f"LARC({inner.name})", per_tensor_norms=True,
        coefs=functools.partial(_coefs, inner=inner.coefs, lr_col=inner.column("lr"),
                                wd_col=inner.column("weight_decay")),
        update=functools.partial(_update, inner=inner.update, settings=settings),
        aux=functools.partial(_aux, inner=inner.aux))


def _coefs(hyper: Tensor, step: Tensor, *, inner, lr_col: int,
           wd_col: int) -> tuple[Tensor, ...]:
    # columns: 0 lr, 1 weight decay, then the inner rule's, computed with weight decay 0
    keep = torch.arange(hyper.shape[1], device=hyper.device) != wd_col
    inner_coefs = inner(torch.where(keep, hyper, 0.0), step)
    return hyper[:, lr_col], hyper[:, wd_col], *(c.to(hyper.dtype) for c in inner_coefs)


def _update(w: Tensor, g: Tensor, states, c: Tensor, owner: Tensor, n_params: int,
            *inner_aux: Any, inner, settings: LARCSettings):
    lr, wd = c[0], c[1]
    w_norm, g_norm = tensor_norms(w, owner, n_params), tensor_norms(g, owner, n_params)
    local = settings.trust_coefficient * w_norm / (g_norm + w_norm * wd + settings.eps)
    if settings.clip:
        local = torch.clamp(local / lr, max=1.0)  # so that lr * local = min(local, lr)
    applies = (w_norm != 0) & (g_norm != 0)  # Apex left the gradient alone otherwise
    decayed = g + per_element(torch.where(applies, wd, 0.0), owner, w)
    g = per_element(torch.where(applies, local, 1.0), owner, decayed)
    return inner(w, g, states, c[2:], *inner_aux)


def _aux(bucket: Bucket, *, inner) -> tuple[Any, ...]:
    return (*chunk_owners(bucket), *inner(bucket))
