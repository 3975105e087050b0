"""End-to-end training step: fxamp O1/O2 against torch.autocast + GradScaler + fused AdamW.

For a GPT-2-style and a ResNet-style model (transformers configs, random weights), it builds and
compiles each of these recipes in one process, then times them taking turns:
  eager        torch.autocast + torch.amp.GradScaler + torch.optim.AdamW(fused=True)
  compile      the same with the model under torch.compile (Inductor)
  fxamp-O1     fxamp.compile(opt_level="O1") + fxamp.optim.AdamW + LossScaler("dynamic")
  fxamp-O2     fxamp.compile(opt_level="O2") + fxamp.optim.AdamW (fp32 masters) + LossScaler
and prints per recipe the median training-step time, the peak memory of a step, the compile
time (first step minus a steady step), and fxamp's ratios to both baselines.

    python -m benchmarks.bench_e2e                    # CPU: small sizes, bf16, a few minutes
    python -m benchmarks.bench_e2e --size tiny        # smoke test
    python -m benchmarks.bench_e2e --device cuda      # on a GPU: fp16, GPT-2 small / ResNet-50

Peak memory: what stays allocated between steps (parameters and buffers, gradients, optimizer
state, fp32 masters: the storages behind them, counted once) plus the highest point one step
allocates above that: on CUDA from the caching allocator's peak counter, on CPU (no such
counter) from torch.profiler's memory timeline of the step.

Compile time: the first step (Dynamo, fxamp's passes, AOTAutograd, Inductor, and for fxamp the
optimizer step's compile) minus a steady step, each recipe in an empty Inductor cache
(`torch._inductor.utils.fresh_cache`) so none reuses kernels another one compiled (`--warm`
keeps the usual caches).

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

RECIPES = ("eager", "compile", "fxamp-O1", "fxamp-O2")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BASELINES = ("eager", "compile")
# gpt2: (embd, layers, heads, seq, batch, vocab); resnet: (stem, widths, depths, block, image,
# batch). "large" is GPT-2 small (124M) and ResNet-50, for a GPU.
SIZES = {
    "tiny": dict(gpt2=(32, 1, 2, 16, 2, 128), resnet=(8, [8, 16], [1, 1], "basic", 16, 2)),
    "small": dict(gpt2=(64, 2, 2, 64, 4, 512), resnet=(16, [16, 32], [1, 1], "basic", 32, 8)),
    "large": dict(gpt2=(768, 12, 12, 512, 8, 50257),
                  resnet=(64, [256, 512, 1024, 2048], [3, 4, 6, 3], "bottleneck", 224, 64)),
}


@dataclasses.dataclass
class Measurement:
    model: str
    recipe: str
    step_ms: float
    peak_mb: float
    compile_s: float
    first_step_s: float


def gpt2(embd: int, layers: int, heads: int, seq: int, batch: int, vocab: int):
    config = transformers.GPT2Config(n_embd=embd, n_layer=layers, n_head=heads, n_positions=seq,
                                     vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return (lambda: transformers.GPT2LMHeadModel(config)), ids, ids.roll(-1, 1)


def resnet(stem: int, widths: list[int], depths: list[int], layer_type: str, image: int,
           batch: int):
    config = transformers.ResNetConfig(embedding_size=stem, hidden_sizes=widths, depths=depths,
                                       layer_type=layer_type,
                                       num_labels=1000 if image >= 224 else 10)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image, image, generator=gen)
    labels = torch.randint(0, config.num_labels, (batch,), generator=gen)
    return (lambda: transformers.ResNetForImageClassification(config)), images, labels


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output["logits"].float()  # ["logits"]: fxamp's O2 output cast returns a dict
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


Step = Callable[[torch.Tensor, torch.Tensor], None]


def _torch_recipe(model, dtype, device, compiled: bool) -> tuple[Step, torch.optim.Optimizer]:
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device.type)

    def step(x, target):
        with torch.autocast(device.type, dtype=dtype):
            loss = _loss(forward(x), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return step, opt


def _fxamp_recipe(model, dtype, level: str) -> tuple[Step, torch.optim.Optimizer]:
    model = fxamp.compile(model, opt_level=level, dtype=dtype)
    config = fxamp.config_of(model)
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-4,
                            master_weights=bool(config.master_weights))
    scaler = fxamp.optim.LossScaler(config.loss_scale)

    def step(x, target):
        scaler.scale(_loss(model(x), target)).backward()
        opt.step(scaler)
        opt.zero_grad()
    return step, opt


def build(recipe: str, make_model, dtype, device):
    torch.manual_seed(0)
    model = make_model().to(device).train()
    if recipe in BASELINES:
        step, opt = _torch_recipe(model, dtype, device, compiled=recipe == "compile")
    else:
        step, opt = _fxamp_recipe(model, dtype, recipe.split("-")[1])
    return model, step, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Step, batch, device: torch.device) -> float:
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


def transient_peak_bytes(step: Step, batch, device: torch.device) -> int:
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
    step: Step
    first_step_s: float
    peak_bytes: int


def prepare(recipe: str, make_model, batch, dtype, device, *, warmup: int,
            cold: bool) -> Runner:
    """Build a recipe, time its first step (the compiles) in an empty Inductor cache, warm it
    up, and measure its peak memory: what stays allocated plus one step's transient peak."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache() if cold else contextlib.nullcontext():
        model, step, opt = build(recipe, make_model, dtype, device)
        first = _timed(step, batch, device)
        for _ in range(warmup - 1):
            step(*batch)
    peak = persistent_bytes(model, opt) + transient_peak_bytes(step, batch, device)
    return Runner(recipe, step, first, peak)


def interleaved_medians(runners: list[Runner], batch, device, steps: int) -> dict[str, float]:
    """Median seconds per step, the recipes taking turns step by step (Note [Taking turns])."""
    times: dict[str, list[float]] = {r.recipe: [] for r in runners}
    for i in range(steps):
        k = i % len(runners)
        for r in runners[k:] + runners[:k]:
            times[r.recipe].append(_timed(r.step, batch, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def warm_up_compiler(device: torch.device) -> None:
    """Pay Inductor's once-per-process costs (imports, compile workers, compiler checks) on a
    throwaway graph, so that the first recipe measured is not charged for them."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        layer = torch.nn.Linear(8, 8).to(device)
        torch.compile(layer)(torch.randn(4, 8, device=device)).sum().backward()


def measure_model(name: str, make_model, batch, dtype, device, recipes, *, warmup: int,
                  steps: int, cold: bool) -> list[Measurement]:
    runners = []
    for recipe in recipes:
        runners.append(prepare(recipe, make_model, batch, dtype, device, warmup=warmup,
                               cold=cold))
        print(f"  {name:<7}{recipe:<10} first step {runners[-1].first_step_s:6.1f} s, peak "
              f"{runners[-1].peak_bytes / 2**20:8.1f} MiB", flush=True)
    medians = interleaved_medians(runners, batch, device, steps)
    return [Measurement(name, r.recipe, medians[r.recipe] * 1e3, r.peak_bytes / 2**20,
                        max(0.0, r.first_step_s - medians[r.recipe]), r.first_step_s)
            for r in runners]


def ratio_rows(results: list[Measurement]) -> list[str]:
    """fxamp / baseline for each metric (below 1: fxamp is faster, smaller or compiles sooner)."""
    rows = ["| model | fxamp | vs | step time | peak memory | compile time |",
            "|---|---|---|---:|---:|---:|"]
    by = {(r.model, r.recipe): r for r in results}
    for (model, recipe), r in by.items():
        if recipe in BASELINES:
            continue
        for base in BASELINES:
            b = by[(model, base)]
            compile_ratio = f"{r.compile_s / b.compile_s:.2f}x" if base == "compile" else "-"
            rows.append(f"| {model} | {recipe} | {base} | {r.step_ms / b.step_ms:.2f}x | "
                        f"{r.peak_mb / b.peak_mb:.2f}x | {compile_ratio} |")
    return rows


def absolute_rows(results: list[Measurement]) -> list[str]:
    rows = ["| model | recipe | step (ms) | peak memory (MiB) | compile (s) | first step (s) |",
            "|---|---|---:|---:|---:|---:|"]
    rows += [f"| {r.model} | {r.recipe} | {r.step_ms:.1f} | {r.peak_mb:.1f} | {r.compile_s:.1f} "
             f"| {r.first_step_s:.1f} |" for r in results]
    return rows


def environment(device: torch.device, dtype: torch.dtype, size: str,
                threads: Optional[int]) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_name()}, {os.cpu_count()} cores, {threads or 'all'} thread(s) used"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{name} | torch {torch.__version__} | transformers {transformers.__version__} | "
            f"{str(dtype).replace('torch.', '')} | size {size} | "
            f"{datetime.date.today().isoformat()} | load average at start {load:.2f}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


def plot(results: list[Measurement], path: str, title: str) -> None:
    """Each recipe's step time, peak memory and compile time relative to `compile`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("step_ms", "step time"), ("peak_mb", "peak memory"), ("compile_s", "compile"))
    models = list(dict.fromkeys(r.model for r in results))
    recipes = list(dict.fromkeys(r.recipe for r in results))
    by = {(r.model, r.recipe): r for r in results}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=False)
    width = 0.8 / len(recipes)
    for ax, (field, label) in zip(axes, metrics):
        for i, recipe in enumerate(recipes):
            values = [getattr(by[(m, recipe)], field) / max(getattr(by[(m, "compile")], field),
                                                             1e-9) for m in models]
            ax.bar([k + i * width for k in range(len(models))], values, width, label=recipe)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(models))], models)
        ax.set_title(f"{label} / torch.compile+autocast")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp16", "bf16"],
                        help="default: fp16 on CUDA, bf16 on CPU (each device's autocast default)")
    parser.add_argument("--size", choices=list(SIZES), help="default: large on CUDA, else small")
    parser.add_argument("--models", nargs="+", default=["gpt2", "resnet"],
                        choices=["gpt2", "resnet"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int,
                        help="intra-op threads; default 1 on CPU (Note [One thread on CPU])")
    parser.add_argument("--warm", action="store_true",
                        help="compile with Inductor's usual caches instead of empty ones")
    parser.add_argument("--plot", help="save a PNG of the ratios here")
    parser.add_argument("--json", help="save the measurements here")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[Measurement]:
    args = _parse(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "bf16")]
    size = args.size or ("large" if cuda else "small")
    threads = args.threads or (None if cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    env = environment(device, dtype, size, threads)
    print(env, flush=True)
    warm_up_compiler(device)
    results = []
    for name in args.models:
        make_model, x, target = {"gpt2": gpt2, "resnet": resnet}[name](*SIZES[size][name])
        results += measure_model(name, make_model, (x.to(device), target.to(device)), dtype,
                                 device, args.recipes, warmup=args.warmup, steps=args.steps,
                                 cold=not args.warm)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("\n" + "\n".join(absolute_rows(results)))
    if set(BASELINES) <= set(args.recipes):
        print("\nfxamp / baseline (below 1 is better for fxamp):\n" + "\n".join(
            ratio_rows(results)))
    if args.plot and "compile" in args.recipes:  # the plot is relative to this baseline
        plot(results, args.plot, env)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": [dataclasses.asdict(r) for r in results]},
                      f, indent=1)
    return results


if __name__ == "__main__":
    main()
