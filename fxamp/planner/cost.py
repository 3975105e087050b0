"""The planner's cost model: a roofline of the target device (docs/planner.md, "The cost
model").

A GEMM's modeled time in a training step is the sum, over the GEMMs autograd runs for it
(the forward one, grad_input when its left operand needs a gradient, grad_weight when its
right one does), of `max(flops / peak[precision], bytes / bandwidth)`; float8 adds the
scaled casts fxamp emits (Note [Float8 casts in the cost model]). The block-scaled recipes
(`mxfp8`, `nvfp4`) are timed only on a target with their tensor cores (`Target.mxfp8_tflops`,
`nvfp4_tflops`: B200's), their operands counted with their block scales.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from fxamp import validation
from fxamp.errors import ConfigError

__all__ = ["Target", "TARGETS", "as_target", "GemmShape", "gemm_time", "cast_time",
           "PRECISIONS", "ITEMSIZE", "LOW_BIT", "BLOCK_SCALED"]

# What a GEMM can run in: fp32, a 16-bit dtype, or float8 (the recipe's own name).
PRECISIONS = ("fp32", "bf16", "fp16", "tensorwise", "rowwise", "mxfp8", "nvfp4")
LOW_BIT = ("tensorwise", "rowwise", "mxfp8", "nvfp4")  # the recipes: fxamp casts their operands
BLOCK_SCALED = ("mxfp8", "nvfp4")
# Bytes per operand element a GEMM reads; a block-scaled element carries its share of the block's
# scale (mxfp8: one e8m0 byte per 32 e4m3 values; nvfp4: one e4m3 byte per 16 e2m1 nibbles).
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "tensorwise": 1, "rowwise": 1,
            "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# Note [Float8 casts in the cost model]: fxamp's float8 GEMM (fxamp/float8/gemm.py) scales
# each operand of each of its GEMMs from the 16-bit tensor: one amax pass (read 2 bytes an
# element) and one cast pass (read 2, write 1). A tensor used by two GEMMs (the input by the
# forward and grad_weight ones, the weight by forward and grad_input, the gradient by both
# backward ones) is counted as cast twice. That is an upper bound on what the casts cost: a
# tensor-scaled gradient is cast once and its cast transposed, and compiled, the weight's and
# the input's second casts are the forward's (Note [Cast once, then transpose] in
# fxamp/float8/gemm.py); Inductor may also fuse an amax into the op that produced its tensor.
# A block-scaled cast finds each block's amax and casts it in one pass (read 2, write the
# element and its scale's share); NVFP4 first reads the tensor once more for its per-tensor
# scale. Each operand of each GEMM is quantized anew along that GEMM's reduction dim (Note
# [Block-scaled recipes are emulated only] in fxamp/float8/block_gemm.py), so the count of
# casts is the same upper bound's.
CAST_BYTES_PER_ELEMENT = {"tensorwise": 2 + 2 + 1, "rowwise": 2 + 2 + 1,
                          "mxfp8": 2 + ITEMSIZE["mxfp8"], "nvfp4": 2 + 2 + ITEMSIZE["nvfp4"]}


@dataclasses.dataclass(frozen=True)
class Target:
    """A device as the cost model sees it: dense peak TFLOP/s per precision and memory
    bandwidth in GB/s (10**9 bytes/s). `mxfp8_tflops` and `nvfp4_tflops` are None on a device
    without block-scaled tensor cores (the block-scaled recipes are then not timed). Pass your
    own to `fxamp.plan(target=...)`."""

    name: str
    fp32_tflops: float
    bf16_tflops: float
    fp16_tflops: float
    float8_tflops: float
    bandwidth_gbs: float
    mxfp8_tflops: Optional[float] = None
    nvfp4_tflops: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Target name={self.name!r} must be a non-empty string")
        for f in dataclasses.fields(self)[1:]:
            value = getattr(self, f.name)
            if value is not None or f.name not in ("mxfp8_tflops", "nvfp4_tflops"):
                validation.positive_finite(value, f"Target {f.name}")

    def supports(self, precision: str) -> bool:
        """Whether this device runs `precision` (a block-scaled recipe needs its peak)."""
        return precision not in BLOCK_SCALED or getattr(self, f"{precision}_tflops") is not None

    def peak(self, precision: str) -> float:
        """FLOP/s of a GEMM in `precision` (a name of PRECISIONS this target supports)."""
        key = "float8" if precision in ("tensorwise", "rowwise") else precision
        value = getattr(self, f"{key}_tflops")
        if value is None:
            raise ConfigError(f"target {self.name!r} has no {precision} tensor cores "
                              f"({key}_tflops=None)")
        return value * 1e12

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9


def _this_cpu() -> Target:
    # Conservative figures for a CPU without AMX or AVX-512 BF16 (docs/planner.md): 25 GFLOP/s
    # a core in fp32 (one AVX2 core measures 25 with MKL), 16-bit GEMMs no faster (they are
    # converted to fp32), float8 (torch._scaled_mm converts too) at 40 % of fp32, 10 GB/s.
    cores = os.cpu_count() or 1
    fp32 = 0.025 * cores
    return Target("cpu", fp32, fp32, fp32, 0.4 * fp32, 10.0)


# Dense (no sparsity) datasheet peaks. fp32 is the non-tensor-core rate: torch runs fp32
# matmuls without TF32 unless torch.backends.cuda.matmul.allow_tf32 is set.
TARGETS: dict[str, Target] = {
    "h100": Target("h100", 67.0, 989.4, 989.4, 1978.9, 3350.0),  # H100 SXM5, HBM3
    "h200": Target("h200", 67.0, 989.4, 989.4, 1978.9, 4800.0),  # H200 SXM, HBM3e
    # HGX B200 at 1000 W, HBM3e; MXFP8 at the float8 rate, NVFP4 at twice it
    "b200": Target("b200", 80.0, 2250.0, 2250.0, 4500.0, 8000.0, mxfp8_tflops=4500.0,
                   nvfp4_tflops=9000.0),
    "cpu": _this_cpu(),
}


def as_target(target: Union[str, Target]) -> Target:
    """A built-in target by name ("h100", "h200", "b200", "cpu") or your own `Target`."""
    if isinstance(target, Target):
        return target
    if isinstance(target, str) and target.lower() in TARGETS:
        return TARGETS[target.lower()]
    raise ConfigError(f"target={target!r} is not one of {', '.join(map(repr, TARGETS))} or a "
                      "fxamp.planner.Target(name, fp32_tflops, bf16_tflops, fp16_tflops, "
                      "float8_tflops, bandwidth_gbs, mxfp8_tflops=None, nvfp4_tflops=None)")


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One GEMM site as the cost model sees it: `batch` GEMMs of [M, K] @ [K, N] (batch 1 for
    a 2-D GEMM) and which gradient GEMMs a training step runs for it."""

    m: int
    k: int
    n: int
    batch: int = 1
    grad_input: bool = True
    grad_weight: bool = True

    @property
    def gemms(self) -> list[tuple[int, int, int]]:
        """(rows, contraction, cols) of the forward, grad_input and grad_weight GEMMs run."""
        m, k, n = self.m, self.k, self.n
        return [(m, k, n)] + [(m, n, k)] * self.grad_input + [(k, m, n)] * self.grad_weight


def _one_gemm(rows: int, inner: int, cols: int, batch: int, precision: str, t: Target) -> float:
    flops = 2.0 * batch * rows * inner * cols
    size = ITEMSIZE[precision]
    out_size = 4 if precision == "fp32" else 2  # the recipes' GEMMs return the 16-bit dtype
    data = batch * (size * (rows * inner + inner * cols) + out_size * rows * cols)
    return max(flops / t.peak(precision), data / t.bandwidth)


def cast_time(shape: GemmShape, t: Target, precision: str = "tensorwise") -> float:
    """Seconds the casts of one step in recipe `precision` take (Note [Float8 casts in the
    cost model])."""
    m, k, n = shape.m, shape.k, shape.n
    casts = (m * k * (1 + shape.grad_weight) + k * n * (1 + shape.grad_input)
             + m * n * (shape.grad_input + shape.grad_weight))
    return CAST_BYTES_PER_ELEMENT[precision] * shape.batch * casts / t.bandwidth


def gemm_time(shape: GemmShape, precision: str, t: Target) -> float:
    """Modeled seconds of one training step of this GEMM site in `precision`, casts included."""
    gemms = sum(_one_gemm(r, i, c, shape.batch, precision, t) for r, i, c in shape.gemms)
    return gemms + (cast_time(shape, t, precision) if precision in LOW_BIT else 0.0)
