"""End-to-end training step: fxamp O1/O2 against torch.autocast + GradScaler + fused AdamW.

For a GPT-2-style and a ResNet-style model (transformers configs, random weights), it builds and
compiles each of these recipes in one process, then times them taking turns:
  eager        torch.autocast + torch.amp.GradScaler + torch.optim.AdamW(fused=True)
  compile      the same with the model under torch.compile (Inductor)
  fxamp-O1     fxamp.compile(opt_level="O1") + fxamp.optim.AdamW + LossScaler("dynamic")
  fxamp-O2     fxamp.compile(opt_level="O2") + fxamp.optim.AdamW (fp32 masters) + LossScaler
  ceiling      the model in the 16-bit dtype under torch.compile + torch.optim.AdamW(fused=True)
               on the 16-bit parameters: no masters, no loss scaling, no casts (O3's
               arithmetic): the fastest a mixed-precision step of this model could be
and prints per recipe the median training-step time, the throughput (tokens/s, images/s; for
GPT-2 also the model FLOPs utilisation), the peak memory of a step, the compile time (first step
minus a steady step) and where it went (benchmarks/compile_breakdown.py), and fxamp's ratios to
both baselines.

    python -m benchmarks.bench_e2e                    # CPU: small sizes, bf16, a few minutes
    python -m benchmarks.bench_e2e --size tiny        # smoke test
    python -m benchmarks.bench_e2e --device cuda      # on a GPU: fp16, GPT-2 small / ResNet-50
    python -m benchmarks.gpu_report --out DIR         # the whole GPU proof (fp16 and bf16)

Peak memory: what stays allocated between steps (parameters and buffers, gradients, optimizer
state, fp32 masters: the storages behind them, counted once) plus the highest point one step
allocates above that: on CUDA from the caching allocator's peak counter, on CPU (no such
counter) from torch.profiler's memory timeline of the step.

Compile time: the first step (Dynamo, fxamp's passes, AOTAutograd, Inductor, and for fxamp the
optimizer step's compile) minus a steady step, each recipe in an empty Inductor cache
(`torch._inductor.utils.fresh_cache`) and with fxamp's optimizer graphs forgotten
(`fused_step.forget_compiled`), so none reuses kernels or graphs another one compiled (`--warm`
keeps both; a second optimizer of a kind is `benchmarks.second_optimizer`). With
`--optimizer-in-cache` the model's graphs still compile in an empty cache but fxamp's optimizer
graphs are found in it, as by every process after the first: its step does not depend on the
model (compile_optimizer_kinds).

# Note [Taking turns]
On a shared 2-core VM a block of steps of one recipe ran 6 ms and the next block of the same
recipe 11 ms, whatever else ran: the machine's speed drifts over seconds. So all recipes of a
model are built first and then take turns, one step each (starting from a different recipe
every round), and each reports the median of its steps: a slow second slows every recipe alike.

# Note [One thread on CPU]
With two intra-op threads three runs of one recipe spread by 20 %, with one thread by 5 % (a
parallel region waits for its slowest thread, and any other process deschedules one). The CPU
run shows fxamp's overheads, not parallel speed, so it uses one thread unless told otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
import transformers

import fxamp
import fxamp.optim
from fxamp.optim.functional import fused_step
from benchmarks import compile_breakdown, deadline, gpu_lock
from benchmarks.e2e_tables import BASELINES, absolute_rows, breakdown_rows, plot, ratio_rows
from benchmarks.workloads import SIZES, WORKLOADS, Workload, peak_flops

RECIPES = ("eager", "compile", "ceiling", "fxamp-O1", "fxamp-O2")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TIMING_RESERVE_S = 15.0  # for the rounds of timing (and the wait for the GPU lock) after compiling


@dataclasses.dataclass
class Measurement:
    model: str
    recipe: str
    dtype: str
    step_ms: Optional[float]  # None until timed
    peak_mb: float
    compile_s: Optional[float]
    first_step_s: float
    throughput: Optional[float] = None  # units per second
    unit: str = ""
    mfu: Optional[float] = None
    breakdown: Optional[dict] = None


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    # torchvision returns logits; transformers a ModelOutput (["logits"]: as a dict too)
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
    logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@dataclasses.dataclass
class Recipe:
    """A built recipe; a training step is `forward_backward` then `optimizer_step`."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    forward_backward: Callable[[torch.Tensor, torch.Tensor], None]
    optimizer_step: Callable[[], None]

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        self.forward_backward(x, target)
        self.optimizer_step()


def _torch_recipe(model, dtype, device, compiler: Optional[str]) -> Recipe:
    forward = torch.compile(model, backend=compiler) if compiler else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type)

    def forward_backward(x, target):
        with torch.autocast(device.type, dtype=dtype):
            loss = _loss(forward(x), target)
        scaler.scale(loss).backward()

    def optimizer_step():
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return Recipe(model, opt, forward_backward, optimizer_step)


def _ceiling_recipe(model, dtype, compiler: str) -> Recipe:
    model = model.to(dtype)
    forward = torch.compile(model, backend=compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def forward_backward(x, target):
        # the model is all bf16: so are its floating inputs (images; token ids stay ids)
        _loss(forward(x.to(dtype) if x.is_floating_point() else x), target).backward()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return Recipe(model, opt, forward_backward, optimizer_step)


def _fxamp_recipe(model, dtype, level: str, compiler: str) -> Recipe:
    model = fxamp.compile(model, opt_level=level, dtype=dtype, compiler=compiler)
    config = fxamp.config_of(model)
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-4, compile=compiler == "inductor",
                            master_weights=bool(config.master_weights))
    scaler = fxamp.optim.LossScaler(config.loss_scale, compile=compiler == "inductor")

    def forward_backward(x, target):
        scaler.scale(_loss(model(x), target)).backward()

    def optimizer_step():
        opt.step(scaler)
        opt.zero_grad()
    return Recipe(model, opt, forward_backward, optimizer_step)


def build(recipe: str, make_model, dtype, device, compiler: str = "inductor") -> Recipe:
    """`compiler="aot_eager"` (the smoke test's) compiles nothing with Inductor, and runs
    fxamp's optimizer step uncompiled."""
    torch.manual_seed(0)
    model = make_model().to(device).train()
    if recipe == "ceiling":
        return _ceiling_recipe(model, dtype, compiler)
    if recipe in BASELINES:
        return _torch_recipe(model, dtype, device, compiler if recipe == "compile" else None)
    return _fxamp_recipe(model, dtype, recipe.split("-")[1], compiler)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable, batch, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step(*batch)
    _sync(device)
    return time.perf_counter() - start


def persistent_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the storages behind parameters, buffers, gradients and optimizer state
    (fxamp's state dict holds views of its flat buffers, fp32 masters included)."""
    tensors = [*model.parameters(), *model.buffers(),
               *(p.grad for p in model.parameters() if p.grad is not None)]
    for state in opt.state_dict()["state"].values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def transient_peak_bytes(step: Callable, batch, device: torch.device) -> int:
    """Highest point of the bytes one step allocates above what was live before it."""
    if device.type == "cuda":
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(*batch)
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step(*batch)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


@dataclasses.dataclass
class Runner:
    recipe: str
    step: Callable
    first_step_s: float
    peak_bytes: int
    first_parts: tuple  # what compile_breakdown.breakdown needs besides the compile time


def first_step(recipe: Recipe, batch, device: torch.device) -> tuple[float, tuple]:
    """Time the first step, with compile-time snapshots between its model and optimizer parts
    (benchmarks/compile_breakdown.py)."""
    backend = fxamp.backend_of(recipe.model)
    before = compile_breakdown.snapshot()
    start = time.perf_counter()
    recipe.forward_backward(*batch)
    _sync(device)
    after_model, middle = compile_breakdown.snapshot(), time.perf_counter()
    recipe.optimizer_step()
    _sync(device)
    end = time.perf_counter()
    fxamp_s = sum(g.trace_s + g.passes_s for g in backend.compiled_graphs) if backend else 0.0
    return end - start, (before, after_model, fxamp_s, end - middle)


def prepare(recipe: str, make_model, batch, dtype, device, *, warmup: int, cold: bool,
            compiler: str = "inductor", optimizer_in_cache: bool = False) -> Runner:
    """Build a recipe, time its first step (the compiles) in an empty Inductor cache, warm it
    up, and measure its peak memory: what stays allocated plus one step's transient peak.
    Cold, the recipe also compiles its optimizer's kinds as the first of a process would; with
    `optimizer_in_cache`, as a later process would, which finds them in Inductor's caches."""
    from torch._inductor.utils import fresh_cache

    if cold:  # nor an earlier recipe's optimizer graphs (Note [One compiled step per kind])
        fused_step.forget_compiled()
    with fresh_cache() if cold else contextlib.nullcontext():
        if cold and optimizer_in_cache and recipe not in BASELINES:
            compile_optimizer_kinds(recipe, make_model, dtype, device, compiler)
        built = build(recipe, make_model, dtype, device, compiler)
        first, parts = first_step(built, batch, device)
        for _ in range(warmup - 1):
            built.step(*batch)
    peak = persistent_bytes(built.model, built.opt) + transient_peak_bytes(built.step, batch,
                                                                           device)
    return Runner(recipe, built.step, first, peak, parts)


def compile_optimizer_kinds(recipe: str, make_model, dtype, device, compiler: str) -> None:
    """Step the recipe's optimizer once on a throwaway copy of the model (zero gradients, no
    forward: the model's graphs are not compiled), then forget the compiled kinds: what is left
    is what an earlier process leaves a new one, the optimizer's graphs and kernels in
    Inductor's and AOTAutograd's caches, which the optimizer's step does not depend on the
    model for (Note [One compiled step per kind] in docs/design.md)."""
    throwaway = build(recipe, make_model, dtype, device, compiler)
    for p in throwaway.model.parameters():
        p.grad = torch.zeros_like(p)
    throwaway.optimizer_step()
    fused_step.forget_compiled()


def interleaved_medians(runners: list[Runner], batch, device, steps: int) -> dict[str, float]:
    """Median seconds per step, the recipes taking turns step by step (Note [Taking turns])."""
    times: dict[str, list[float]] = {r.recipe: [] for r in runners}
    for i in range(steps):
        start = time.perf_counter()
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            times[r.recipe].append(_timed(r.step, batch, device))
        if i >= 2 and not deadline.enough_for(2 * (time.perf_counter() - start) + 1):
            break  # a report's deadline: fewer rounds (at least 3), not none
    return {name: statistics.median(ts) for name, ts in times.items()}


def warm_up_compiler(device: torch.device, compiler: str = "inductor") -> None:
    """Pay Inductor's once-per-process costs (imports, compile workers, compiler checks) on a
    throwaway graph, so that the first recipe measured is not charged for them."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        layer = torch.nn.Linear(8, 8).to(device)
        torch.compile(layer, backend=compiler)(torch.randn(4, 8, device=device)).sum().backward()


def _measurement(name: str, dtype: str, r: Runner, work: Workload, step_s: Optional[float],
                 peak: Optional[float]) -> Measurement:
    m = Measurement(name, r.recipe, dtype, None, r.peak_bytes / 2**20, None, r.first_step_s,
                    unit=f"{work.unit}/s")
    if step_s is not None:
        m.step_ms, m.compile_s = step_s * 1e3, max(0.0, r.first_step_s - step_s)
        m.throughput = work.items / step_s
        m.mfu = work.flops / step_s / peak if work.flops and peak else None
        if r.recipe != "eager":
            m.breakdown = dataclasses.asdict(compile_breakdown.breakdown(*r.first_parts,
                                                                         m.compile_s))
    return m


def measure_model(name: str, work: Workload, device, dtype_name: str, args, *,
                  peak: Optional[float], report: Callable[[list[Measurement]], None],
                  first: bool = False) -> list[Measurement]:
    """Prepare every recipe (compiling, with the device shared), then time them taking turns
    (with the device to this process: benchmarks/gpu_lock.py); `report` gets partial results.
    The `first` model also pays Inductor's once-per-process start-up beforehand."""
    batch, runners, slowest = (work.inputs.to(device), work.targets.to(device)), [], 0.0
    with gpu_lock.hold(args.lock, exclusive=False):
        if first:
            warm_up_compiler(device, args.compiler)
        for recipe in args.recipes:
            # Under a report's deadline (benchmarks/deadline.py): time the recipes that are
            # ready rather than none.
            if runners and not deadline.enough_for(1.2 * slowest + TIMING_RESERVE_S):
                print(f"  {name:<7}{recipe:<10} not prepared: the report's deadline is near",
                      flush=True)
                continue
            start = time.perf_counter()
            runners.append(prepare(recipe, work.make_model, batch, DTYPES[dtype_name], device,
                                   warmup=args.warmup, cold=not args.warm,
                                   compiler=args.compiler,
                                   optimizer_in_cache=args.optimizer_in_cache))
            slowest = max(slowest, time.perf_counter() - start)
            print(f"  {name:<7}{recipe:<10} first step {runners[-1].first_step_s:6.1f} s, peak "
                  f"{runners[-1].peak_bytes / 2**20:8.1f} MiB", flush=True)
            report([_measurement(name, dtype_name, r, work, None, None) for r in runners])
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what other processes' turns may need
    with gpu_lock.hold(args.lock, exclusive=True):
        medians = interleaved_medians(runners, batch, device, args.steps)
    return [_measurement(name, dtype_name, r, work, medians[r.recipe], peak) for r in runners]


def environment(device: torch.device, dtypes: list[str], size: str, threads: Optional[int],
                peak: Optional[float]) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_name()}, {os.cpu_count()} cores, {threads or 'all'} thread(s) used"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mfu = f" | MFU against {peak / 1e12:.0f} TFLOP/s dense 16-bit" if peak else ""
    return (f"{name} | torch {torch.__version__} | transformers {transformers.__version__} | "
            f"{'+'.join(dtypes)} | size {size} | {datetime.date.today().isoformat()} | "
            f"load average at start {load:.2f}{mfu}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES),
                        help="default: fp16 on CUDA, bf16 on CPU (each device's autocast default)")
    parser.add_argument("--size", choices=list(SIZES), help="default: large on CUDA, else small")
    parser.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int,
                        help="intra-op threads; default 1 on CPU (Note [One thread on CPU])")
    parser.add_argument("--warm", action="store_true",
                        help="compile with Inductor's usual caches instead of empty ones")
    parser.add_argument("--optimizer-in-cache", action="store_true",
                        help="cold, but fxamp's optimizer graphs found in Inductor's caches, as "
                             "by any process after the first (they do not depend on the model)")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                        help="aot_eager: no Inductor anywhere (a smoke test of this script)")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense 16-bit peak for MFU (default: known GPUs)")
    parser.add_argument("--lock", help="a lock file shared with other benchmark processes on "
                                       "this GPU (benchmarks/gpu_lock.py)")
    parser.add_argument("--plot", help="save a PNG of the ratios here")
    parser.add_argument("--json", help="save the measurements here (rewritten as they come)")
    return parser.parse_args(argv)


def _saver(path: Optional[str], env: str, done: list[Measurement]):
    def save(partial: list[Measurement]) -> None:
        if path:  # written whole and renamed, so a killed run leaves its last complete file
            with open(path + ".tmp", "w") as f:
                json.dump({"environment": env,
                           "results": [dataclasses.asdict(r) for r in done + partial]},
                          f, indent=1)
            os.replace(path + ".tmp", path)
    return save


def main(argv: Optional[list[str]] = None) -> list[Measurement]:
    args = _parse(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtypes = args.dtype or ["fp16" if cuda else "bf16"]
    size = args.size or ("large" if cuda else "small")
    threads = args.threads or (None if cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    peak = peak_flops(device, args.peak_tflops)
    env = environment(device, dtypes, size, threads, peak)
    print(env, flush=True)
    results: list[Measurement] = []
    save = _saver(args.json, env, results)
    for dtype_name in dtypes:
        for name in args.models:
            work = WORKLOADS[name](*SIZES[size][name])
            results += measure_model(name, work, device, dtype_name, args, peak=peak,
                                     report=save, first=not results)
            save([])
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    print("\n" + "\n".join(absolute_rows(results)))
    print("\nWhere the compile time went (seconds, share of the recipe's compile time):\n"
          + "\n".join(breakdown_rows(results)))
    if set(BASELINES) & set(args.recipes):
        print("\nfxamp / baseline (below 1 is better for fxamp):\n" + "\n".join(
            ratio_rows(results)))
    if args.plot and "compile" in args.recipes:  # the plot is relative to this baseline
        plot(results, args.plot, env)
    return results


if __name__ == "__main__":
    main()
