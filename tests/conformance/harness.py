"""Run one pattern three ways on the same weights and batch, and judge fxamp against autocast.

- reference: the model in fp32, eager (fp32's own rounding, ~1e-7, is far below the 16-bit
  errors measured here, so float64 would change no verdict);
- peer: `model.compile(backend="aot_eager")` under `torch.autocast` (what users get without
  fxamp);
- subject: `fxamp.compile(model, opt_level=..., compiler="aot_eager")` (or Inductor).

Note [Conformance tolerance]: each error below is measured against the fp32 reference, and a
case passes when, for every metric, fxamp's error <= K[level] x autocast's error + FLOOR[dtype].
- O1 applies autocast's own op table (tests/test_autocast_parity.py), so its error should be
  autocast's, rounding for rounding: K = 2 leaves room only for a different order of casts.
- O2 also stores the weights and runs the non-matmul ops (norms, residual adds, softmax inputs)
  in the low dtype; K = 4. O3 adds BatchNorm and fp32-listed ops in the low dtype; K = 8.
- FLOOR covers a case where autocast casts (nearly) nothing and its error is ~0, while O2/O3 still
  round the weights: 4 unit roundoffs of the dtype (bf16 2**-9, fp16 2**-12), as a relative error.
Errors are relative and linear in the perturbation: the loss's relative error; per parameter the
angle between the flattened gradient and fp32's (radians, arccos of the cosine) and the relative
error of its norm; the relative error of every floating buffer (running statistics, buffers a
forward updates). The worst parameter / buffer counts. Written once here, never tuned per case.
Measured (2026-11-23, every passing case, bf16 and fp16, errors above a quarter of FLOOR): the
largest fxamp / autocast ratio was 1.2 at O1 (fp64_complex_side, rnn_cell), 1.9 at O2
(spectral_norm, transformer_encoder_train gradient norms) and 0.9 at O3 (resnet_channels_last):
each K leaves about 2x. A dropped Tensor hook (gradient 1/3 of fp32's) gives ratios of 30-1700,
a lost or fp32-only run fails the structural checks below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

import fxamp

__all__ = ["Pattern", "Run", "K", "FLOOR", "reference", "peer", "subject", "compare"]

K = {"O1": 2.0, "O2": 4.0, "O3": 8.0}
FLOOR = {torch.bfloat16: 4 * 2.0**-9, torch.float16: 4 * 2.0**-12}
SEED = 0
# Two calls on the same weights and batch: the second step is where recompiles, guards and
# state carried over from the first call (buffers, caches) show up. The second is compared.
STEPS = 2


def _call(model: nn.Module, inputs: tuple) -> Any:
    return model(*inputs)


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A model pattern users train. `build()` returns a seeded fp32 model and one batch;
    `group` names the feature it belongs to in the README's table.

    call: how the training script calls the model; grad_mode: "train" (forward + backward),
    "no_grad" or "inference_mode" (forward only); eval: model.eval() first; copy: applied to
    the prepared model (fxamp: after fxamp.compile; peer: before compiling, as the copy of a
    plain model is what users compile); levels: the opt levels that are meaningful; xfail:
    {level or "*": the exact symptom on main}; xfail_before: the torch (major, minor) from
    which the xfail cases pass (they then run unmarked); check: extra assertions on the subject;
    compiler: the fxamp compiler every case of the pattern needs (None: the suite's; "eager" for
    double backward), the peer then compiling with torch's backend of the same name;
    peer_compiled: False where torch.compile + autocast itself fails the pattern on a supported
    torch (the peer is then eager autocast: the same ops, the same numerics).
    """

    name: str
    group: str
    summary: str
    build: Callable[[], tuple[nn.Module, tuple]]
    call: Callable[[nn.Module, tuple], Any] = _call
    grad_mode: str = "train"
    eval: bool = False
    copy: Optional[Callable[[nn.Module], nn.Module]] = None
    levels: tuple[str, ...] = ("O1", "O2")
    xfail: Mapping[str, str] = dataclasses.field(default_factory=dict)
    xfail_before: Optional[tuple[int, int]] = None
    check: Optional[Callable[["Run", "Run", str], None]] = None
    inductor: bool = False
    slow: bool = False
    compiler: Optional[str] = None
    peer_compiled: bool = True

    def xfail_reason(self, level: str) -> Optional[str]:
        return self.xfail.get(level, self.xfail.get("*"))

    def fresh(self) -> tuple[nn.Module, tuple]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model, inputs = self.build()
        return (model.eval() if self.eval else model.train()), inputs


@dataclasses.dataclass
class Run:
    """What one way of running produced: loss, outputs, gradients and buffers (float64)."""

    model: nn.Module
    loss: float
    outputs: list[torch.Tensor]
    grads: dict[str, Optional[torch.Tensor]]
    buffers: dict[str, torch.Tensor]
    warnings: list[str]


def _grad_context(mode: str):
    return {"train": contextlib.nullcontext, "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode}[mode]()


def loss_of(output: Any) -> torch.Tensor:
    """Mean squared distance of every floating output to a fixed random target, in float64.

    A random target (not `output.sum()`) keeps the gradient generic: a LayerNorm'd output's
    sum or sum of squares is constant, and their gradients would be rounding noise.
    """
    leaves = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]
    total = 0.0
    for i, leaf in enumerate(leaves):
        leaf = torch.view_as_real(leaf) if leaf.is_complex() else leaf
        target = torch.randn(leaf.shape, generator=torch.Generator().manual_seed(SEED + i),
                             dtype=torch.float64)
        total = total + (leaf.to(torch.float64) - target).pow(2).mean()
    return total


def _execute(pattern: Pattern, model: nn.Module, inputs: tuple, scale: float,
             autocast: Optional[torch.dtype]) -> Run:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            model.zero_grad(set_to_none=True)
            with _grad_context(pattern.grad_mode):
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    output = pattern.call(model, inputs)
                loss = loss_of(output)
            if pattern.grad_mode == "train":
                (loss * scale).backward()
    grads = {name: None if p.grad is None else p.grad.detach().to(torch.float64) / scale
             for name, p in model.named_parameters()}
    buffers = {name: b.detach().to(torch.float64) for name, b in model.named_buffers()
               if b.is_floating_point()}
    outputs = [t.detach() for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    caught = [str(w.message) for w in caught]
    return Run(model, float(loss.detach()), outputs, grads, buffers, caught)


# fp16 gradients of these small models stay far from underflow once the loss is multiplied by
# 2**10 (GradScaler's job in training); bf16 has fp32's range and needs no scale.
LOSS_SCALE = {torch.float16: 2.0**10, torch.bfloat16: 1.0}


def reference(pattern: Pattern, dtype: torch.dtype) -> Run:
    model, inputs = pattern.fresh()
    model = pattern.copy(model) if pattern.copy else model
    return _execute(pattern, model, inputs, LOSS_SCALE[dtype], None)


def peer(pattern: Pattern, dtype: torch.dtype) -> Run:
    model, inputs = pattern.fresh()
    model = pattern.copy(model) if pattern.copy else model
    if pattern.peer_compiled:
        model.compile(backend=pattern.compiler or "aot_eager")
    return _execute(pattern, model, inputs, LOSS_SCALE[dtype], dtype)


def subject(pattern: Pattern, level: str, dtype: torch.dtype, compiler: str = "aot_eager") -> Run:
    model, inputs = pattern.fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fxamp.compile(model, opt_level=level, dtype=dtype, compiler=compiler)
    model = pattern.copy(model) if pattern.copy else model
    run = _execute(pattern, model, inputs, LOSS_SCALE[dtype], None)
    run.warnings[:0] = [str(w.message) for w in caught]
    return run


def _rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    ref_norm = float(ref.norm())
    return float((value - ref).norm()) / ref_norm if ref_norm > 0 else float(value.norm())


def _angle(value: torch.Tensor, ref: torch.Tensor) -> float:
    norms = float(value.norm() * ref.norm())
    if norms == 0:
        return 0.0 if float(value.norm() + ref.norm()) == 0 else math.pi / 2
    return math.acos(max(-1.0, min(1.0, float((value * ref).sum()) / norms)))


def errors(run: Run, ref: Run) -> dict[str, float]:
    """The case's errors against the fp32 reference (see Note [Conformance tolerance])."""
    out = {"loss": abs(run.loss - ref.loss) / max(abs(ref.loss), 1e-30)}
    pairs = [(run.grads[n], g) for n, g in _informative(ref.grads).items()]
    if pairs and all(g is not None for g, _ in pairs):
        out["grad angle"] = max(_angle(g.flatten(), r.flatten()) for g, r in pairs)
        out["grad norm"] = max(abs(float(g.norm()) / float(r.norm()) - 1) for g, r in pairs)
    if ref.buffers:
        out["buffers"] = max(_rel(run.buffers[n], b) for n, b in ref.buffers.items())
    return out


# A gradient that is zero in exact arithmetic (BERT's key bias: softmax ignores a score shift)
# comes out of fp32 as rounding noise, ~1e-12 of the others; its angle and norm mean nothing.
NOISE = 1e-6


def _informative(grads: dict[str, Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
    norms = {n: float(g.norm()) for n, g in grads.items() if g is not None}
    largest = max(norms.values(), default=0.0)
    return {n: grads[n] for n, v in norms.items() if v > NOISE * largest}


def _check_structure(run: Run, ref: Run) -> None:
    lost = [n for n, g in ref.grads.items() if g is not None and run.grads.get(n) is None]
    assert not lost, f"fxamp lost the gradient of {lost} (fp32 eager has them)"
    assert set(run.buffers) == set(ref.buffers), "buffers differ from the fp32 model's"
    assert len(run.outputs) == len(ref.outputs), "the output's structure differs from fp32's"
    for i, (out, want) in enumerate(zip(run.outputs, ref.outputs)):
        if want.dtype in (torch.float64, torch.complex64, torch.complex128) or (
                not want.is_floating_point() and not want.is_complex()):
            assert out.dtype == want.dtype, (
                f"output {i}: {want.dtype} in fp32 eager, {out.dtype} under fxamp "
                "(fp64, complex and integer computations must stay untouched)")
    bad = [n for n, g in run.grads.items() if g is not None and not bool(g.isfinite().all())]
    assert not bad and math.isfinite(run.loss), f"non-finite loss or gradients: {bad}"


def _same_bits(run: Run, ref: Run) -> bool:
    same = [torch.equal(g, ref.grads[n]) for n, g in run.grads.items() if g is not None]
    return run.loss == ref.loss and all(same)


def compare(run: Run, peer_run: Run, ref: Run, level: str, dtype: torch.dtype) -> dict:
    """Assert fxamp's run conforms; returns the errors (for reports)."""
    _check_structure(run, ref)
    ours, theirs = errors(run, ref), errors(peer_run, ref)
    bound = {m: K[level] * theirs.get(m, 0.0) + FLOOR[dtype] for m in ours}
    worse = {m: f"{ours[m]:.3g} > {bound[m]:.3g} (autocast {theirs.get(m, 0.0):.3g})"
             for m in ours if not ours[m] <= bound[m]}
    assert not worse, f"fxamp {level} {dtype} is further from fp32 than autocast: {worse}"
    # Silently skipping mixed precision (an fp32 run) is as wrong as a bad one.
    if max(theirs.values()) > 0 and _same_bits(run, ref):
        raise AssertionError(f"fxamp {level} gave fp32's results bit for bit while autocast's "
                             f"differ ({theirs}): it ran without mixed precision")
    return {"fxamp": ours, "autocast": theirs}
