"""AOTAutograd and Inductor: the compiler entry points, their config, donated buffers."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

# Checked on 2.11.0, 2.13.0, 2.14.1.
from torch._functorch.aot_autograd import make_boxed_func  # noqa: F401


def compile_fx(gm: fx.GraphModule, example_inputs: Any, *, config_patches: Optional[dict] = None):
    """Inductor's compiler entry point (what `torch.compile(backend="inductor")` calls), with
    the CPU's vector width in the config of a graph that has CPU inputs (Note [Inductor's cache
    and the CPU's instruction set]).

    Imported when first used: Inductor takes seconds to import. Checked on 2.11.0, 2.13.0,
    2.14.1.
    """
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    on_cpu = any(getattr(x, "device", None) == _CPU for x in example_inputs)
    patches = {**(cpu_code_options() if on_cpu else {}), **(config_patches or {})}
    return inductor_compile_fx(gm, example_inputs, config_patches=patches or None)


# Note [Inductor's cache and the CPU's instruction set]
# Inductor's C++ code depends on the vector instruction set it picks for this CPU (AVX-512 or
# AVX2 on x86: the lanes of each `Vectorized` type, how many of them a loop loads), and that
# pick follows `ATEN_CPU_CAPABILITY` as well as the CPU. But its FX graph cache keys a compiled
# graph on the graph and Inductor's config, not on that pick (torch 2.11-2.14): a process with
# `ATEN_CPU_CAPABILITY=avx2` (CI's second run of the float8 tests on an AVX-512 machine), or a
# narrower CPU sharing the cache directory, loads the wrapper and kernel sources generated for
# AVX-512 and compiles them with AVX2's flags. Those kernels load and store 32 bf16 lanes into
# 16-lane vectors: memory past the end is read and written, and the gradients come out NaN or
# wrong on some runs (seen on the float8 repro of issue 38 on an AVX-512 CPU, 3 and 4 runs in 6
# and 4). fxamp puts the picked width into the config of every graph it compiles for the CPU
# (`cpp.simdlen`, which Inductor reads to pick the same instruction set again), so that graphs
# generated for different widths are different cache entries; a width the user passes wins.
# Reported upstream-style in docs/float8.md, "Known differences".
_CPU = torch.device("cpu")


def cpu_code_options() -> dict[str, Any]:
    """{"cpp.simdlen": the vector width Inductor picked for this CPU} ({} where it found no
    vector instruction set): Note [Inductor's cache and the CPU's instruction set]. Checked on
    2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return {"cpp.simdlen": isa.bit_width()} if isa else {}


def cpp_dtypes() -> frozenset[str]:
    """The dtypes Inductor's C++ code generation can name ("float8_e8m0fnu" is missing on
    2.11). Imported when first used. Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP

    return frozenset(str(d).removeprefix("torch.") for d in DTYPE_TO_CPP)


def list_mode_options(mode: str) -> dict[str, Any]:
    """Inductor's config patches for a `torch.compile(mode=...)`. Checked on 2.11.0, 2.13.0,
    2.14.1."""
    from torch._inductor import list_mode_options as inductor_mode_options

    return inductor_mode_options(mode)


def inductor_config_keys() -> frozenset[str]:
    """The names `torch.compile(options=...)` accepts (Inductor's config, dotted names
    included). Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor import config as inductor_config

    return frozenset(inductor_config.get_config_copy())


# Inductor's store-versus-recompute thresholds (a pointwise value with several users and more
# reads or ops than these is written to a buffer). Names differ by version: 2.11.0 has the first
# three; 2.13.0 adds the CPU ones; 2.14.1 adds realize_opusers_threshold. Checked on all three.
_REALIZE_THRESHOLDS = ("realize_reads_threshold", "realize_opcount_threshold",
                       "realize_acc_reads_threshold", "realize_cpu_opcount_threshold",
                       "realize_cpu_acc_reads_threshold", "realize_opusers_threshold")


def recompute_pointwise_options() -> dict[str, int]:
    """`torch.compile(options=...)` that let Inductor recompute a pointwise value in each
    consumer instead of writing it to memory (Note [A codec the CPU runs fast] in
    fxamp/optim/functional/codecs.py), with the threshold names this torch has."""
    keys = inductor_config_keys()
    return {name: 1 << 30 for name in _REALIZE_THRESHOLDS if name in keys}


def fuse_unrelated_options() -> dict[str, bool]:
    """`torch.compile(options=...)` that let Inductor fuse nodes sharing no buffer into one
    kernel (`aggressive_fusion`; Note [One kernel for the per-step scalars] in
    fxamp/optim/functional/fused_step.py). Checked on 2.11.0, 2.13.0, 2.14.1."""
    return {"aggressive_fusion": True} if "aggressive_fusion" in inductor_config_keys() else {}


def run_and_get_code(fn: Callable, *args: Any) -> tuple[Any, list[str]]:
    """fn(*args) and the source of every module Inductor generated meanwhile (tests read it).
    Checked on 2.11.0, 2.13.0, 2.14.1."""
    from torch._inductor.utils import run_and_get_code as inductor_run_and_get_code

    return inductor_run_and_get_code(fn, *args)


def without_donated_buffers(compile_fn: Callable, gm: fx.GraphModule,
                            example_inputs: Any) -> Callable:
    """`compile_fn(gm, example_inputs)` with AOTAutograd's donated buffers off for this graph,
    so that its backward may run more than once (`retain_graph=True`, `create_graph=True`).

    `torch._functorch.config.donated_buffer` is read twice: when the graph is partitioned
    (saved activations that alias no input or output are marked donated, and Inductor's
    backward may overwrite them) and again when the backward runs (a backward that keeps its
    graph is refused if any are marked). Patching the flag for the compile alone leaves the
    marks unset (None), which the runtime check reads as "marked"; so the metadata this compile
    left on the tracing context is given an explicit empty list as well. On an AOTAutograd cache
    hit the context holds no metadata: the cached entry was saved with the empty list. Checked on
    2.13.0 (aot_eager and Inductor, cold and warm cache).
    """
    import torch._functorch.config as functorch_config
    from torch._guards import TracingContext

    with functorch_config.patch(donated_buffer=False):
        compiled = compile_fn(gm, example_inputs)
    context = TracingContext.try_get()
    metadata = None if context is None else context.fw_metadata
    if metadata is not None:
        metadata.bw_donated_idxs = []
    return compiled
