"""The update rules (Adam, AdamW, SGD, LAMB) as pure functions of flat tensors.

Each rule is split the way Note [Hoisting per-step scalars] in docs/design.md asks: `coefs` turns
the per-group hyperparameters and the step count into a few scalars per group (bias corrections,
lr·wd, ...), once per step in the prologue graph; `update` is the elementwise part, which reads
those scalars as 0-dim loads. Both take fp32 (`w`, `g` and the states upcast by the caller) and
return the new values; skipping, casting and writing back are the caller's job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fxamp.optim.buffers.bucket import ALIGN, Bucket

__all__ = ["Algorithm", "ADAM", "ADAMW", "SGD", "LAMB", "tensor_norms", "per_element",
           "chunk_owners"]

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One update rule.

    Attributes:
        name: for messages.
        hyper_keys: the param-group entries read into the hyperparameter tensor, in column order
            ("betas" expands to two columns).
        state_keys: per-parameter state names, as torch.optim calls them.
        coefs: (hyper [G, H] float64, step [G]) -> K per-step scalars, each a [G] column
            (columns, not one stacked [G, K] tensor: Note [One kernel for the per-step
            scalars] in fused_step.py).
        update: (w, g, states, c, *aux) -> (new w, new states); c is one group's K scalars
            (0-dim tensors, indexed like a row).
        aux: bucket -> extra constant tensors the update needs (LAMB's chunk owners).
        has_state: group -> whether its buckets keep state (SGD without momentum does not).
        per_tensor_norms: the update needs whole-parameter norms (LAMB, LARC), which sharded
            parameters do not have locally.
    """

    name: str
    hyper_keys: tuple[str, ...]
    state_keys: tuple[str, ...]
    coefs: Callable[[Tensor, Tensor], tuple[Tensor, ...]]
    update: Callable[..., tuple[Tensor, tuple[Tensor, ...]]]
    aux: Callable[[Bucket], tuple[Any, ...]] = lambda bucket: ()
    has_state: Callable[[dict], bool] = lambda group: True
    per_tensor_norms: bool = False

    def column(self, key: str) -> int:
        """The hyperparameter tensor's column of `key` ("betas" takes two)."""
        columns: list[str] = []
        for name in self.hyper_keys:
            columns.extend((name, name) if name == "betas" else (name,))
        return columns.index(key)

    def hyper_row(self, group: dict) -> tuple[Any, ...]:
        """The group's hyperparameters in column order: floats, or tensors left as they are
        (reading a device tensor as a float would synchronise)."""
        values: list[Any] = []
        for key in self.hyper_keys:
            value = group[key]
            values.extend(value if key == "betas" else (value,))
        return tuple(v if isinstance(v, torch.Tensor) else float(v) for v in values)


# ---------------------------------------------------------------------------------------- Adam
def _adam_coefs(hyper: Tensor, step: Tensor) -> tuple[Tensor, ...]:
    # float64 here, like torch.optim's Python-float scalars: 1 - beta2 rounded from an fp32
    # beta2 would be off by 5e-5 relative.
    lr, b1, b2, eps, wd = hyper.unbind(1)
    step = step.to(hyper.dtype)
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    # columns: 0 decay, 1 step size, 2 sqrt(bc2), 3 eps, 4 1 - beta1, 5 beta2, 6 1 - beta2,
    # 7 weight decay
    return 1 - lr * wd, lr / bc1, bc2.sqrt(), eps, 1 - b1, b2, 1 - b2, wd


def _adam_direction(g: Tensor, m: Tensor, v: Tensor, c: Tensor):
    m = m + c[4] * (g - m)  # torch's lerp for weights below 0.5
    v = v * c[5] + c[6] * (g * g)
    return m, v, m / (v.sqrt() / c[2] + c[3])


def adam_update(w: Tensor, g: Tensor, states, c: Tensor):
    m, v, d = _adam_direction(g + c[7] * w, *states, c)
    return w - c[1] * d, (m, v)


def adamw_update(w: Tensor, g: Tensor, states, c: Tensor):
    m, v, d = _adam_direction(g, *states, c)
    return w * c[0] - c[1] * d, (m, v)


# ----------------------------------------------------------------------------------------- SGD
def _sgd_coefs(hyper: Tensor, step: Tensor) -> tuple[Tensor, ...]:
    lr, momentum, dampening, wd, nesterov = hyper.unbind(1)
    first = (step == 1).to(hyper.dtype).expand_as(lr)
    # columns: 0 lr, 1 momentum, 2 1 - dampening, 3 weight decay, 4 nesterov, 5 first step
    return lr, momentum, 1 - dampening, wd, nesterov, first


def sgd_update(w: Tensor, g: Tensor, states, c: Tensor):
    g = g + c[3] * w
    if not states:  # no group asked for momentum when the optimizer was built
        return w - c[0] * g, ()
    (buf,) = states
    buf = torch.where(c[5] != 0, g, c[1] * buf + c[2] * g)  # torch starts the buffer at g
    d = torch.where(c[4] != 0, g + c[1] * buf, buf)
    d = torch.where(c[1] != 0, d, g)
    return w - c[0] * d, (buf,)


# ---------------------------------------------------------------------------------------- LAMB
def _lamb_coefs(hyper: Tensor, step: Tensor) -> tuple[Tensor, ...]:
    lr, b1, b2, eps, wd, averaging, nvlamb, bias_correction = hyper.unbind(1)
    step = step.to(hyper.dtype)
    inv_bc1 = torch.where(bias_correction != 0, 1 / (1 - b1**step), 1.0)
    inv_bc2 = torch.where(bias_correction != 0, 1 / (1 - b2**step), 1.0)
    trust = ((wd != 0) | (nvlamb != 0)).to(hyper.dtype)
    # columns: 0 lr, 1 beta1, 2 grad coefficient, 3 beta2, 4 1/bc1, 5 1/bc2, 6 eps, 7 wd,
    # 8 apply trust ratio, 9 1 - beta2
    grad_coef = torch.where(averaging != 0, 1 - b1, 1.0)
    return lr, b1, grad_coef, b2, inv_bc1, inv_bc2, eps, wd, trust, 1 - b2


def lamb_update(w: Tensor, g: Tensor, states, c: Tensor, owner: Tensor, n_params: int):
    """Apex FusedLAMB (adam_w_mode): Adam direction plus decay, scaled per parameter tensor by
    ||w|| / ||u||. The per-tensor norms come from sums over ALIGN-element chunks, which never
    straddle two parameters (see bucket.ALIGN), then one index_add over the chunks."""
    m, v = states
    m = m * c[1] + c[2] * g
    v = v * c[3] + c[9] * (g * g)
    u = (m * c[4]) / ((v * c[5]).sqrt() + c[6]) + c[7] * w
    w_norm, u_norm = tensor_norms(w, owner, n_params), tensor_norms(u, owner, n_params)
    ratio = torch.where((w_norm != 0) & (u_norm != 0), w_norm / u_norm, 1.0)
    ratio = torch.where(c[8] != 0, ratio, 1.0)
    return w - c[0] * per_element(ratio, owner, u), (m, v)


def tensor_norms(x: Tensor, owner: Tensor, n_params: int) -> Tensor:
    """The L2 norm of each parameter's slice of the flat `x`: sums over ALIGN-element chunks,
    which never straddle two parameters (see bucket.ALIGN), then one index_add over them."""
    return x.new_zeros(n_params).index_add(0, owner, x.view(-1, ALIGN).square().sum(1)).sqrt()


def per_element(per_param: Tensor, owner: Tensor, x: Tensor) -> Tensor:
    """`x` (flat, or [blocks, ALIGN]) with each parameter's slice multiplied by its entry of
    `per_param`."""
    return (per_param[owner][:, None] * x.view(-1, ALIGN)).view(x.shape)


def chunk_owners(bucket: Bucket) -> tuple[Tensor, int]:
    """Which parameter each ALIGN-element chunk of the bucket belongs to, and how many there
    are: the constants `tensor_norms` needs (LAMB's and LARC's aux)."""
    owner = torch.empty(bucket.grad.numel() // ALIGN, dtype=torch.long)
    bounds = bucket.offsets[1:] + [bucket.grad.numel()]
    for i, (start, end) in enumerate(zip(bucket.offsets, bounds)):
        owner[start // ALIGN:end // ALIGN] = i
    return owner.to(bucket.grad.device), len(bucket.params)


_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
ADAM = Algorithm("Adam", _ADAM_KEYS, ("exp_avg", "exp_avg_sq"), _adam_coefs, adam_update)
ADAMW = Algorithm("AdamW", _ADAM_KEYS, ("exp_avg", "exp_avg_sq"), _adam_coefs, adamw_update)
SGD = Algorithm("SGD", ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
                ("momentum_buffer",), _sgd_coefs, sgd_update,
                has_state=lambda group: group["momentum"] != 0)
LAMB = Algorithm("LAMB", _ADAM_KEYS + ("grad_averaging", "use_nvlamb", "bias_correction"),
                 ("exp_avg", "exp_avg_sq"), _lamb_coefs, lamb_update, chunk_owners,
                 per_tensor_norms=True)
