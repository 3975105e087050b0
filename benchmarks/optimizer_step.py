"""Optimizer-step benchmark: fxamp's fused compiled AdamW against torch's AdamW variants.

For each size it times, in one process, one optimizer step of:
  copy          a plain fp32 copy of N elements: the memory-bandwidth roofline of this run
                (and, for reading it, a copy moving 28 bytes per parameter, as a step does)
  fxamp         fxamp.optim.AdamW + LossScaler (O1: fp32 model; O2: 16-bit model, fp32 masters)
  fxamp+clip    the same with max_grad_norm=1.0 (the norm comes from the same reduction)
  foreach+GS    torch AdamW(foreach=True) + torch.amp.GradScaler (fp32)
  fused+GS      torch AdamW(fused=True) + GradScaler (fp32)
  compiled      torch.compile(AdamW.step), no loss scaling (fp32)
  eager O2      torch's way to O2: GradScaler's check pass + fused AdamW on fp32 masters + the
                copy to the 16-bit model
  fxamp NAME    O2 with a bf16 model: fxamp with state_format NAME (low_memory, compensated,
                stochastic+int8; docs/optimizer_memory.md)
  peers         O2, on the 16-bit model, where they install and run (`pip install
                ".[peers]"`; the header says of each whether it runs here, and why not):
                torchao AdamW8bit (stochastic rounding for bf16), bitsandbytes AdamW8bit,
                torch-optimi AdamW with kahan_sum, FlashOptim's FlashAdamW (on CPU its
                quantisation refuses: it needs CUDA)
and prints the bytes each method keeps per parameter between steps (model, gradients, masters,
optimizer state: the distinct storages behind them), ms per step, effective GB/s at the bytes
each parameter must move (28: an fp32 Adam step, or a 16-bit model with fp32 masters, moments
and 16-bit grads), that as a share of the copy bandwidth, kernels launched per step (CUDA
kernels; on CPU, executed ATen/Inductor kernels), and each time relative to fxamp's: the
median, lowest and highest of the per-round ratios. The issue's targets are checked at the end.

    python -m benchmarks.optimizer_step                                   # 10M and 100M
    python -m benchmarks.optimizer_step --params 2e5 --tensors 20 --reps 3   # smoke test

# Note [Taking turns]
This VM's copy bandwidth moves between 38 and 88 GB/s from minute to minute, so methods timed
one after another compared different machines (three quiet runs gave fxamp 1.00x, 1.88x and
1.94x torch's eager O2 path). Every method of a mode is built first and then they take turns,
one step each per round, starting each round one method further on; a ratio is taken within a
round, so a slow second slows both sides of it. Methods that do not fit in memory together
take turns in groups, fxamp's default step in each (Note [Groups that fit] in
benchmarks/optimizer_groups.py). Timings on a shared or busy machine are still meaningless: the
header prints the load average; run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import os
import json
import math
from typing import Callable

import torch

import fxamp.optim as fo
from benchmarks import gpu_lock, optimizer_groups
from benchmarks.step_timing import (  # noqa: F401 (the tests import them from here)
    count_kernels, interleaved, kernel_profile, ratio_stats, storage_bytes, time_step)

REQUIRED_BYTES = 28  # per parameter; see the docstring


def shapes(n_params: int, n_tensors: int) -> list[tuple[int, ...]]:
    """Half square weight matrices, half vectors (biases, norms), about n_params in all."""
    k = max(1, n_tensors // 2)
    d = max(1, int(math.sqrt(n_params / k)))
    return [(d, d)] * k + [(d,)] * (n_tensors - k)


def _params(shape_list, dtype, device, grads=True):
    # Drawn on the device: a billion draws on the host take longer than the whole benchmark.
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shape_list:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device).to(dtype))
        if grads:
            p.grad = (torch.randn(shape, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    return params


def _grad_scaler(device):
    gs = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=10**9)
    gs.scale(torch.ones((), device=device))  # GradScaler creates its scale lazily
    return gs


class Built:
    """A method ready to time: its step, and the tensors it keeps between steps (for bytes)."""

    def __init__(self, step: Callable, tensors: Callable[[], list]) -> None:
        self.step, self.tensors = step, tensors
        self.ready_s = 0.0  # building it and its first step (optimizer_groups._ready)


def _kept(*holders) -> Callable[[], list]:
    """The parameters, gradients and optimizer state of torch-style optimizers and params."""
    def tensors():
        out = []
        for h in holders:
            if isinstance(h, torch.optim.Optimizer):
                for group in h.param_groups:
                    out += [t for p in group["params"] for t in (p, p.grad) if t is not None]
                out += [v for s in h.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor)]
            else:
                out += list(h)
        return out
    return tensors


def build_fxamp(shape_list, device, dtype, clip=False, compile=True, state_format=None):
    extra = {} if state_format is None else {"state_format": state_format}
    opt = fo.AdamW(_params(shape_list, dtype, device), lr=1e-3, weight_decay=0.01,
                   max_grad_norm=1.0 if clip else None, compile=compile, **extra)
    scaler = fo.LossScaler(init_scale=1.0, compile=compile)
    return Built(lambda: opt.step(scaler), _kept(opt))


def build_torch(shape_list, device, *, fused):
    params = _params(shape_list, torch.float32, device)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=not fused, fused=fused)
    gs = _grad_scaler(device)
    return Built(lambda: (gs.step(opt), gs.update()), _kept(opt))


def build_torch_compiled(shape_list, device):
    params = _params(shape_list, torch.float32, device)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)  # a float lr: fixed here
    return Built(torch.compile(opt.step), _kept(opt))


def build_torch_o2(shape_list, device, dtype):
    model = _params(shape_list, dtype, device, grads=False)
    masters = _params(shape_list, torch.float32, device)
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)
    gs = _grad_scaler(device)

    def step():
        gs.step(opt)
        gs.update()
        with torch.no_grad():
            torch._foreach_copy_(model, masters)
    # The model's 16-bit gradients are what the masters' fp32 gradients stand in for here.
    return Built(step, _kept(opt, model, [p.grad.to(dtype) for p in masters]))


def build_torchao_8bit(shape_list, device, dtype):
    """torchao's AdamW8bit on the 16-bit model itself (bf16_stochastic_round: no masters), the
    nearest peer of fxamp's low_memory format; no loss scaling (it has none)."""
    from torchao.optim import AdamW8bit

    params = _params(shape_list, dtype, device)
    opt = AdamW8bit(params, lr=1e-3, weight_decay=0.01,
                    bf16_stochastic_round=dtype == torch.bfloat16)
    return Built(opt.step, lambda: _kept(params)() + [p.grad for p in params]
                 + _torchao_state(opt))


def _torchao_state(opt) -> list:
    # Its 8-bit states are tensor subclasses: count their codes and scales, not the wrapper.
    out = []
    for state in opt.state.values():
        for v in state.values():
            inner = [getattr(v, k, None) for k in ("codes", "scale", "qmap")]
            out += [t for t in inner if t is not None] if inner[0] is not None else [v]
    return out


def build_bnb_8bit(shape_list, device, dtype):
    """bitsandbytes' AdamW8bit (block-wise 8-bit moments) on the 16-bit model, as shipped: no
    masters, no loss scaling."""
    import bitsandbytes as bnb

    opt = bnb.optim.AdamW8bit(_params(shape_list, dtype, device), lr=1e-3, weight_decay=0.01)
    return Built(opt.step, _kept(opt))


def build_optimi_kahan(shape_list, device, dtype):
    """torch-optimi's AdamW on the 16-bit model with Kahan-compensated updates (bf16 moments
    and compensation): the nearest peer of fxamp's "compensated" format."""
    import optimi

    opt = optimi.AdamW(_params(shape_list, dtype, device), lr=1e-3, weight_decay=0.01,
                       kahan_sum=True)
    return Built(opt.step, _kept(opt))


def build_flashoptim(shape_list, device, dtype):
    """FlashOptim's FlashAdamW (8-bit moments, 24-bit masters as bf16 + 8 bits): the format
    fxamp's "low_memory" follows."""
    import flashoptim

    opt = flashoptim.FlashAdamW(_params(shape_list, dtype, device), lr=1e-3, weight_decay=0.01)
    return Built(opt.step, _kept(opt))


# pip's import name -> (the row's name, its builder); every one gets the 16-bit model.
PEER_ROWS = {"torchao": ("torchao AdamW8bit", build_torchao_8bit),
             "bitsandbytes": ("bitsandbytes AdamW8bit", build_bnb_8bit),
             "optimi": ("torch-optimi AdamW kahan", build_optimi_kahan),
             "flashoptim": ("flashoptim FlashAdamW", build_flashoptim)}


def peer_status(device, dtype) -> dict[str, str]:
    """Per peer: "runs", "not installed here", or why it imports but cannot step here (tried on
    one small tensor), so that no row is dropped without a word."""
    out = {}
    for name, (_, build) in PEER_ROWS.items():
        try:
            __import__(name)
        except Exception:  # absent, or present but unusable with this torch
            out[name] = "not installed here"
            continue
        try:
            build([(64, 64)], device, dtype).step()
            out[name] = "runs"
        except Exception as e:  # noqa: BLE001 (any failure is the reason printed)
            out[name] = f"cannot run here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return out


def build_copy(n: int, device):
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return lambda: dst.copy_(src)


PEERS: dict[str, str] = {}  # filled by main(): peer_status()
# The StateFormats (docs/optimizer_memory.md) timed beside fp32 masters in O2.
LOW_MEMORY_FORMATS = {"low_memory": "low_memory", "compensated": "compensated",
                      "stochastic+int8": fo.StateFormat("stochastic", "int8")}


def methods(mode: str, device, low: torch.dtype, compile: bool = True):
    """`compile=False` (a smoke test of this script) runs fxamp's step uncompiled."""
    if mode == "O1":
        return {"fxamp": lambda s: build_fxamp(s, device, torch.float32, compile=compile),
                "fxamp+clip": lambda s: build_fxamp(s, device, torch.float32, clip=True,
                                                    compile=compile),
                "foreach+GS": lambda s: build_torch(s, device, fused=False),
                "fused+GS": lambda s: build_torch(s, device, fused=True),
                "compiled": lambda s: build_torch_compiled(s, device),
                "eager O2": lambda s: build_torch_o2(s, device, low)}
    # In priority order (Note [Groups that fit] in benchmarks/optimizer_groups.py): the targets'
    # baselines, the 16-bit state formats and their peer, then the rest.
    rows = {"fxamp": lambda s: build_fxamp(s, device, low, compile=compile),
            "eager O2": lambda s: build_torch_o2(s, device, low),
            "fused+GS": lambda s: build_torch(s, device, fused=True)}
    if low == torch.bfloat16:  # the 16-bit master formats need a bf16 model
        for name, fmt in LOW_MEMORY_FORMATS.items():
            rows[f"fxamp {name}"] = lambda s, fmt=fmt: build_fxamp(s, device, low,
                                                                  compile=compile,
                                                                  state_format=fmt)
    for name, (row, build) in PEER_ROWS.items():
        if PEERS.get(name) == "runs":
            rows[row] = lambda s, build=build: build(s, device, low)
    rows["fxamp+clip"] = lambda s: build_fxamp(s, device, low, clip=True, compile=compile)
    return rows


def compiles(name: str) -> bool:
    """Whether readying the method compiles (Note [What readying a method costs] in
    benchmarks/optimizer_groups.py): fxamp's steps, torch.compile's, torchao's AdamW8bit (a
    compiled step per parameter shape)."""
    return name.startswith("fxamp") or name in ("compiled", "torchao AdamW8bit")


def run_size(n_params: int, args, device, low, save) -> dict:
    """One size's rows, mode by mode, in groups that fit the memory budget; `save` gets the
    partial results after each group."""
    shape_list = shapes(n_params, args.tensors)
    n = sum(math.prod(s) for s in shape_list)
    results = {"n": n, "tensors": len(shape_list), "rows": {}, "skipped": {}}
    copy = build_copy(n, device)
    copy_s = time_step(copy, device, args.warmup, args.reps)
    del copy  # its 8 bytes per element are the methods' while they run
    results["copy_gbs"] = 8 * n / copy_s / 1e9
    budget = _memory_budget(args, device)
    for mode in args.modes:
        builders = {name: build for name, build in
                    methods(mode, device, low, args.compiler == "inductor").items()
                    if name not in args.skip}

        def partial(rows, skipped, mode=mode):
            results["rows"][mode], results["skipped"][mode] = rows, skipped
            save(results)
        optimizer_groups.time_mode(builders, shape_list, n, device, args, budget_bytes=budget,
                                   save=partial, compiles=compiles)
    # The roofline is the faster of a copy before and after the methods, so a disturbed copy
    # cannot flatter them.
    copy = build_copy(n, device)
    copy_s = min(copy_s, time_step(copy, device, args.warmup, args.reps))
    results["copy_gbs"] = 8 * n / copy_s / 1e9
    # For reading the roofline, not for the targets: a copy that moves as many bytes as the
    # step (28 per parameter), whose working set fits a CPU's cache no better than the step's.
    del copy
    wide = build_copy(REQUIRED_BYTES * n // 8, device)
    results["wide_copy_gbs"] = REQUIRED_BYTES * n / time_step(wide, device, args.warmup,
                                                              args.reps) / 1e9
    return results


def _memory_budget(args, device) -> float:
    """Bytes the ready methods of a group may hold (Note [Groups that fit]): --memory-gib, else
    on CUDA 3/4 of the device (the rest for the steps' temporaries and the allocator's
    slack), else no limit."""
    if args.memory_gib:
        return args.memory_gib * 2**30
    if device.type == "cuda":
        return 0.75 * torch.cuda.get_device_properties(device).total_memory
    return math.inf


def report(results: dict, low: torch.dtype) -> list[str]:
    n, copy_gbs = results["n"], results["copy_gbs"]
    wide = results.get("wide_copy_gbs")
    wide = f"{wide:.1f} GB/s" if wide else "not measured"
    lines = [f"\n{n / 1e6:.1f}M params in {results['tensors']} tensors; copy {copy_gbs:.1f} GB/s "
             f"(8 bytes/element; a copy moving the step's {REQUIRED_BYTES} B/param: {wide})",
             "| mode | method | bytes/param | ms/step | GB/s @28 B | % of copy | kernels | "
             "time / fxamp's: median [min, max] over rounds |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for mode, rows in results["rows"].items():
        label = f"{mode} ({'fp32' if mode == 'O1' else str(low).split('.')[1]})"
        for name, row in rows.items():
            gbs = REQUIRED_BYTES * n / row["s"] / 1e9
            med, lo, hi = row["ratio"]
            lines.append(f"| {label} | {name} | {row['bytes_per_param']:.2f} | "
                         f"{row['s'] * 1e3:.2f} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f}% | "
                         f"{row['kernels']} | {med:.2f}x [{lo:.2f}, {hi:.2f}] |")
        lines += [f"| {label} | {name} | skipped: {why} | | | | | |"
                  for name, why in results.get("skipped", {}).get(mode, {}).items()]
    return lines + kernel_lines(results)


def kernel_lines(results: dict) -> list[str]:
    """fxamp's steps kernel by kernel (one profiled step): what the kernel count is made of."""
    lines = []
    for mode, rows in results["rows"].items():
        for name, row in rows.items():
            kernels = row.get("kernel_list")
            if not name.startswith("fxamp") or not kernels:
                continue
            if not lines:
                lines = ["", "fxamp's kernels in one profiled step (slowest first):", "",
                         "| mode | method | kernel | calls | us |", "|---|---|---|---:|---:|"]
            lines += [f"| {mode} | {name} | `{k['name'][:90]}` | {k['calls']} | {k['us']:.1f} |"
                      for k in kernels]
    return lines


def check_targets(results: dict, device) -> list[str]:
    """The issue's targets, where the rows they need were measured ("vs" = the median over
    rounds of their time / ours)."""
    rows, n, copy_gbs = results["rows"], results["n"], results["copy_gbs"]
    o1, o2 = rows.get("O1", {}), rows.get("O2", {})
    at_least, at_most = [], []  # (what, value, bound)
    if device.type == "cpu" and "fxamp" in o1:
        for name, need in (("eager O2", 1.0), ("fused+GS", 1.25), ("foreach+GS", 3.0)):
            if name in o1:
                at_least.append((f"O1 fxamp vs {name} >= {need}x", o1[name]["ratio"][0], need))
        for name, need in (("eager O2", 1.0), ("fused+GS", 1.25)):
            if name in o2 and "fxamp" in o2:
                at_least.append((f"O2 fxamp vs {name} >= {need}x", o2[name]["ratio"][0], need))
        at_least.append(("O1 fxamp share of copy bandwidth @28 B >= 0.8",
                         REQUIRED_BYTES * n / o1["fxamp"]["s"] / 1e9 / copy_gbs, 0.8))
    if device.type == "cuda" and "fxamp" in o2:
        gbs = 30 * n / o2["fxamp"]["s"] / 1e9
        at_least.append((f"O2 fxamp share of copy bandwidth @30 B >= 0.9 ({gbs:.0f} GB/s of "
                         f"{copy_gbs:.0f})", gbs / copy_gbs, 0.9))
        if "eager O2" in o2:  # fused AdamW + GradScaler + the 16-bit copy
            at_least.append(("O2 fxamp vs eager O2 >= 1.3x", o2["eager O2"]["ratio"][0], 1.3))
        at_most.append(("O2 fxamp kernel launches per step <= 3", o2["fxamp"]["kernels"], 3))
    for name, row in o2.items():  # the low-memory formats: at least as fast as fp32 masters
        if name.startswith("fxamp ") and "fxamp" in o2:
            at_most.append((f"O2 {name} time / fxamp's <= 1.0", round(row["ratio"][0], 2), 1.0))
    return ([f"{'PASS' if v >= bound else 'FAIL'}  {what}: {v:.2f}" for what, v, bound in at_least]
            + [f"{'PASS' if v <= bound else 'FAIL'}  {what}: {v}" for what, v, bound in at_most])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1e7,1e8",
                        help="comma-separated parameter counts (default 10M and 100M)")
    parser.add_argument("--tensors", type=int, default=128, help="tensors per model")
    parser.add_argument("--modes", default="O1,O2", help="O1 (fp32 model) and/or O2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="O2 model dtype: bfloat16 (CPU default) "
                                                      "or float16 (CUDA default)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated methods to leave out")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager"],
                        help="aot_eager: fxamp's step uncompiled (a smoke test of this script)")
    parser.add_argument("--lock", help="a lock file shared with other benchmark processes on "
                                       "this GPU, held exclusively (benchmarks/gpu_lock.py)")
    parser.add_argument("--memory-gib", type=float,
                        help="what a group of methods may hold (Note [Groups that fit] in "
                             "benchmarks/optimizer_groups.py; default 3/4 of a CUDA device)")
    parser.add_argument("--json", help="save the results here as they come")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    args.skip = set(filter(None, args.skip.split(",")))
    device = torch.device(args.device)
    low = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "bfloat16"))
    torch._inductor.config.cpp.enable_kernel_profile = True  # names C++ kernels for counting
    name = torch.cuda.get_device_name() if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads"
    header = (f"# fxamp optimizer step, {name}, torch {torch.__version__}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (numbers need an idle machine)")
    PEERS.update(peer_status(device, low))
    print(header)
    print("peers: " + "; ".join(f"{k} {v}" for k, v in PEERS.items()))
    done = []

    def save(results: dict) -> None:
        results["targets"] = check_targets(results, device)
        if args.json:  # written whole and renamed: a killed run leaves its last complete file
            with open(args.json + ".tmp", "w") as f:
                json.dump({"environment": header, "dtype": str(low).split(".")[1],
                           "sizes": done + [results]}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
    with gpu_lock.hold(args.lock, exclusive=True):
        for n_params in (int(float(p)) for p in args.params.split(",")):
            results = run_size(n_params, args, device, low, save)
            save(results)
            print("\n".join(report(results, low) + results["targets"]), flush=True)
            done.append(results)


if __name__ == "__main__":
    main()
