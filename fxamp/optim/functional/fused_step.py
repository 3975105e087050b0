"""The fused mixed-precision step as two pure functions of flat tensors, compiled once per kind.

`prologue` reduces over the gradients once (overflow flag, the norm when clipping), advances the
step count and the loss scale and turns the hyperparameters into a row of per-step scalars for
each bucket; `update` makes one elementwise pass over one bucket's gradients, weights and states.
A skipped step is a select inside `update`. Every optimizer of the process shares the compiled
functions (`compiled()`), one graph per kind of call, whatever the sizes.

Design (docs/design.md): Note [Hoisting per-step scalars], Note [Skipping without a host read],
Note [One compiled step per kind].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from fxamp._compat import fuse_unrelated_options, recompute_pointwise_options
from fxamp.optim import distributed
from fxamp.optim.functional import codecs
from fxamp.optim.functional.kinds import CompiledPerKind
from fxamp.optim.functional.scale_rule import (ScaleRule, after_step,
                                               forget_compiled_update, scale_is_valid)

__all__ = ["prologue", "update", "fold_grads", "gather_grads", "unscale_grads", "inverse",
           "compiled", "forget_compiled", "eager", "StepFns", "StepState", "BucketArgs"]

Tensor = torch.Tensor
# Columns the prologue appends to every group's row of scalars.
STEP, GRAD_SCALE, SKIP = -3, -2, -1


class StepState(NamedTuple):
    """An optimizer's device state that `prologue` reads and writes, besides its buffers."""

    hyper: Tensor  # [groups, K] hyperparameters, one row per param group (Algorithm.hyper_row)
    step: Tensor  # [groups] step counts, advanced unless the step is skipped
    found: Tensor  # 0-dim bool, written: whether this step is skipped
    norm: Tensor  # 0-dim fp32, written when clipping: the unscaled gradients' total norm


def prologue(grads: Sequence[Tensor], state: StepState,
             scaler_state: Optional[tuple[Tensor, ...]],
             found_in: Optional[Tensor], *,
             coefs_fn: Callable[[Tensor, Tensor], Sequence[Tensor]], check: bool,
             max_norm: Optional[Tensor], rule: Optional[ScaleRule], group: Any = None,
             sharded: Sequence[bool] = ()) -> list[tuple[Tensor, ...]]:
    """Reductions and per-step scalars; returns, per group, the K + 3 scalars for `update`, each
    a 0-dim tensor (Note [One kernel for the per-step scalars]).

    `found_in` is an overflow already seen (by `fold_grads`); the scale update only runs for
    `scaler_state`, whose scale the gradients carry; `max_norm` (0-dim fp32) clips the norm.
    With a process `group`, the flag and the norm of the `sharded` buckets are reduced over it
    (Note [Agreeing on overflow across ranks] in distributed.py).
    """
    step = state.step
    found = torch.zeros((), dtype=torch.bool, device=step.device)
    if found_in is not None:
        found = found | found_in
    if check:
        for g in grads:
            found = found | ~torch.isfinite(g).all()
    if group is not None and (check or found_in is not None):
        found = distributed.agree_found(found, group)
    inv_scale = torch.ones((), dtype=torch.float32, device=step.device)
    if scaler_state is not None:
        inv_scale = inverse(scaler_state[0])
        found = found | ~scale_is_valid(scaler_state[0])  # never step by 1/0 or 1/nan
    grad_scale = inv_scale
    if max_norm is not None:  # torch.nn.utils.clip_grad_norm_'s formula, on unscaled grads
        # Unscaled after the reduction: inside it, 1/scale would be recomputed per vector (see
        # the Note). Squares of scaled fp32 grads overflow only for true grads above ~1e14.
        if group is not None and any(sharded):
            norm = distributed.global_squared_norm(grads, sharded, group).sqrt() * inv_scale
        else:
            norm = sum(g.float().square().sum() for g in grads).sqrt() * inv_scale
        state.norm.copy_(norm)
        grad_scale = inv_scale * (max_norm / (norm + 1e-6)).clamp_max(1.0)
    new_step = step + (~found).to(step.dtype)
    # Note [One kernel for the per-step scalars]: every scalar is read after the reduction.
    hyper = state.hyper * _one_after(found, state.hyper.dtype)
    columns = [c.float() for c in coefs_fn(hyper, new_step)]
    # One step count per group (a group added later starts at 0).
    rows = [(*(c[g] for c in columns), new_step[g].float(),
             grad_scale * _one_after(found, torch.float32), found.float())
            for g in range(state.hyper.shape[0])]
    step.copy_(new_step)
    state.found.copy_(found)
    if scaler_state is not None and rule.moves:
        for dst, src in zip(scaler_state, after_step(scaler_state, found, rule)):
            dst.copy_(src)
    return rows


def _one_after(found: Tensor, dtype: torch.dtype) -> Tensor:
    """Exactly 1 in `dtype`, computed from `found`: multiplying by it changes no bit of a value
    (inf, nan and -0.0 included) and makes the value depend on the reduction."""
    return (~found).to(dtype) + found.to(dtype)


# Note [One kernel for the per-step scalars]
# Inductor fuses a node into a kernel only if they share its iteration space; on CUDA, a
# reduction to a scalar is one kernel (small tensors) or two (a split reduction: partial results,
# then a final one whose kernel can also compute pointwise *consumers* of the result, of one
# element each). The per-step scalars were a [groups, K + 3] tensor (8 and 3 elements per group
# for Adam, each a kernel of its own), the scale update's write-back another, and the columns
# that depend only on the hyperparameters did not depend on the reduction at all: 4 kernels of a
# few threads besides the reduction's (measured on an H100: 8 launches per step with the update,
# tests/gpu/test_cuda_optim.py). So the scalars are returned as one 0-dim tensor each (per group:
# one element, the reduction's output shape), every one of them is made to read the reduction's
# result (`_one_after`: a multiply by exactly 1), and the prologue is compiled with
# `aggressive_fusion` (fxamp/_compat: fuse_unrelated_options), so that the reduction's final
# kernel computes them all and writes the step count and scale state back. Inductor's CUDA code
# for the 1B-parameter O2 step (generated without a GPU, torch 2.11): 2 kernels for the
# prologue (a split reduction) and 1 for the update, was 6 and 1; on CPU the prologue stays one
# C++ kernel. The update reads the scalars as 0-dim loads, indexed as it indexed a row.


class BucketArgs(NamedTuple):
    """What `update` reads and writes of one bucket: its full-size buffers as [blocks, ALIGN]
    views (Note [Blocks of ALIGN in the compiled update]), per-block ones flat."""

    weights: tuple[Tensor, ...]  # the master or parameters (and a 16-bit master's correction)
    grad: Tensor
    states: tuple[tuple[Tensor, ...], ...]  # per state, one buffer or int8 codes and scales
    model: Optional[Tensor]  # the parameters, written from a separate master; else None
    aux: tuple  # the rule's constants for this bucket (Algorithm.aux)
    master: str  # the weights' kind (codecs.decode_master)
    stream_keys: Tensor  # int64: the master's and each state's codecs.stream_key
    has_grad: Tensor  # fp32 per block: 1 where its parameter has a gradient, else 0 (kept)


def update(bucket: BucketArgs, c: Sequence[Tensor], *, update_fn: Callable,
           unsigned: Sequence[bool], stochastic: Sequence[bool] = ()) -> None:
    """One elementwise pass over one bucket, `c` its group's scalars from the prologue (0-dim
    tensors, indexed like a row): decode the weights and states, unscale and clip the gradient,
    apply the rule, encode, select the old values when skipping (the whole step, or the blocks
    of parameters without a gradient: `has_grad`), write the weights, the states and the model
    copy.

    The weights are decoded by their master kind (Note [16-bit masters] in docs/design.md);
    each state is a tuple of buffers (one, or int8 codes and scales, Note [8-bit moments]);
    `unsigned[k]` says whether state k is non-negative, `stochastic[k]` whether it is rounded
    stochastically (Note [Rounding compact moments stochastically] in docs/design.md).
    """
    w, g, st, model, ax, master, keys, has_grad = bucket
    # Per block (Note [A parameter without a gradient] in flat.py); fp32, not a bool input,
    # for the reason of Note [Selecting 8-bit codes].
    skip = (c[SKIP] + (1 - has_grad)) != 0
    new_w, new_st = update_fn(codecs.decode_master(w, master), g.float() * c[GRAD_SCALE],
                              tuple(codecs.decode_state(s, u) for s, u in zip(st, unsigned)),
                              c, *ax)
    bits = None
    if master == "stochastic":
        bits = codecs.stream_bits(w[0].shape, keys[0], c[STEP], False)
    _write(w, codecs.encode_master(new_w, w, master, bits), skip)
    for k, (s, new, u) in enumerate(zip(st, new_st, unsigned)):
        bits = None
        if k < len(stochastic) and stochastic[k]:
            bits = codecs.stream_bits(new.shape, keys[1 + k], c[STEP], codecs.state_half(k))
        _write(s, codecs.encode_state(new, s, u, bits), skip)
    if model is not None:
        model.copy_(torch.where(skip[:, None], model, new_w.to(model.dtype)))


def _write(bufs: Sequence[Tensor], new: Sequence[Tensor], skip: Tensor) -> None:
    # `skip` has one entry per block: full-size buffers are [blocks, ALIGN], per-block ones flat.
    # Note [Selecting 8-bit codes]: Inductor's vectorised C++ casts a 0-dim bool mask to an
    # int8 mask lane by lane (a scalar loop per vector, a third of the 8-bit step's time), and
    # torch 2.11 wrote converted codes to a full-size buffer before selecting. The codecs hand
    # 8-bit contents over as exact fp32 or int32 values; the select is one blend on those
    # lanes, and the conversion to the buffer's dtype comes last.
    for old, value in zip(bufs, new):
        rows = skip[:, None] if old.dim() == 2 else skip
        old.copy_(torch.where(rows, old.to(value.dtype), value).to(old.dtype))


def fold_grads(raws: Sequence[Tensor], accs: Sequence[Tensor], inv_scale: Tensor,
               found: Tensor) -> None:
    """acc += raw * inv_scale and raw = 0, OR-ing raw's overflow into `found`.

    Gradients of losses with different scales meet here (several losses, Apex's master grads);
    `found` is the scaler's flag for the current step. `inv_scale` comes in computed (see
    `inverse`): a reciprocal inside this graph would be recomputed per vector.
    """
    flag = found | ~scale_is_valid(inv_scale)  # the scale was 0, negative, inf or nan
    for raw, acc in zip(raws, accs):
        flag = flag | ~torch.isfinite(raw).all()
        acc.add_(raw.to(acc.dtype) * inv_scale)
        raw.zero_()
    found.copy_(flag)


def gather_grads(raws: Sequence[Tensor], accs: Sequence[Optional[Tensor]],
                 outs: Sequence[Tensor], inv_scale: Tensor, found_out: Tensor) -> None:
    """out = acc + raw * inv_scale in out's dtype, the raw gradients left as they are, and
    found_out = whether any raw gradient (or the scale) is not finite.

    The master gradients of Note [Gathered master gradients] in master_grads.py.
    """
    flag = ~scale_is_valid(inv_scale)
    for raw, acc, out in zip(raws, accs, outs):
        flag = flag | ~torch.isfinite(raw).all()
        grad = raw.float() * inv_scale
        out.copy_(grad if acc is None else grad + acc)
    found_out.copy_(flag)


def unscale_grads(raws: Sequence[Tensor], accs: Sequence[Optional[Tensor]],
                  keep: tuple[bool, ...], inv_scale: Tensor, found: Tensor) -> None:
    """raw = acc + raw * inv_scale in raw's dtype, in place, OR-ing raw's overflow into `found`;
    where `keep`, acc holds the same sum in fp32 (the step's gradient: 16-bit parameters with
    fp32 masters), else acc (if any) is zeroed. One pass: Apex's unscale at a scale_loss exit
    (Note [.grad after a scale_loss exit] in docs/design.md)."""
    flag = found | ~scale_is_valid(inv_scale)
    for raw, acc, kept in zip(raws, accs, keep):
        flag = flag | ~torch.isfinite(raw).all()
        grad = raw.float() * inv_scale
        if acc is not None:
            grad = grad + acc
        raw.copy_(grad)
        if kept:
            acc.copy_(grad)
        elif acc is not None:
            acc.zero_()
    found.copy_(flag)


def inverse(scale: Tensor) -> Tensor:
    """1 / scale rounded as GradScaler rounds it (through float64)."""
    return scale.double().reciprocal().float()


_STEP_FNS = (prologue, update, fold_grads, gather_grads, unscale_grads)


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The step's functions by name: compiled (`compiled()`) or plain (`eager`)."""

    prologue: Callable[..., list[tuple[Tensor, ...]]]
    update: Callable[..., None]
    fold_grads: Callable[..., None]
    gather_grads: Callable[..., None]
    unscale_grads: Callable[..., None]


eager = StepFns(**{fn.__name__: fn for fn in _STEP_FNS})


def _compile_per_kind() -> StepFns:
    options = {update: recompute_pointwise_options,  # Note [A codec the CPU runs fast]
               prologue: fuse_unrelated_options}  # Note [One kernel for the per-step scalars]
    return StepFns(**{fn.__name__: CompiledPerKind(fn, options.get(fn)) for fn in _STEP_FNS})


_COMPILED = _compile_per_kind()


def forget_compiled() -> None:
    """Start new caches of compiled step functions and loss-scale updates: optimizers and
    scalers built from now on compile their kinds again, as the first of a process would
    (benchmarks of a cold compile); those built before keep theirs."""
    global _COMPILED
    _COMPILED = _compile_per_kind()
    forget_compiled_update()


def compiled() -> StepFns:
    """`prologue`, `update`, `fold_grads`, `gather_grads` and `unscale_grads` compiled once per
    kind of call and shared by every optimizer of the process (Note [One compiled step per
    kind]); each kind compiles when it is first called."""
    return _COMPILED
