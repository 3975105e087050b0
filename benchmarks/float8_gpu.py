"""Float8 training speed on a GPU, and the whole stack on one model, in one process.

    python3 -m benchmarks.float8_gpu --json out/float8.json          # H100/H200: 1B Llama, GPT-2
    python3 -m benchmarks.float8_gpu --models llama1b --modes compile-autocast whole-stack
    python3 -m benchmarks.float8_gpu --smoke                         # CPU, tiny: the code path

For each model (a Llama-style 1B and GPT-2 124M, transformers configs with random weights) it
trains the same steps on the same batches in each mode, and prints tokens/s, peak memory and
the final loss. The float8 modes (the default; O2-style bf16 weights, torch.optim.AdamW):
  bf16              fxamp.compile(opt_level="O2", dtype=bf16)
  torchao-f8        torchao's convert_to_float8_training(recipe) + torch.compile
  fxamp-f8          fxamp.compile(opt_level="O2", dtype=bf16, float8=recipe)
  fxamp-f8-delay    the same with Float8Config(scaling="delayed")
and the whole stack against what a PyTorch user writes (issue 35):
  compile-autocast  fp32 weights, torch.compile, torch.autocast(bf16), AdamW(fused=True)
  whole-stack       fxamp.compile(opt_level="O2", dtype=bf16, float8=recipe) and
                    fxamp.optim.AdamW(state_format="low_memory"): 16-bit weights with 7 bytes
                    per parameter in all (docs/optimizer_memory.md), the fused compiled step
Targets (issues 15 and 35, H100, tensorwise): fxamp-f8 >= torchao-f8 tokens/s, >= 1.2x bf16 on
the 1B model, delayed >= dynamic, final loss within 0.5 % of bf16; the whole stack >= 1.3x
compile-autocast's tokens/s at <= 0.6x its peak memory, loss within 1 %. Without CUDA (and
without --smoke) it prints why and exits 0.

Peak memory is the allocator's highest point from the start of a mode's first step: its model,
gradients, optimizer state and activations (the model each mode starts from is a copy of one
kept on the CPU). `--profile N` keeps, per mode, the N kernels that took the most time in one
extra profiled step (what the next GPU session needs to see where a mode's time goes).

GPT-2's projections are transformers' Conv1D (x @ W + b), which torchao's conversion does not
touch (it swaps nn.Linear only): they are rebuilt as the equivalent nn.Linear first, so that
both float8 modes see the same GEMMs. benchmarks/gpu_report.py runs a few processes side by
side (`--modes`, `--lock`: shared while compiling, exclusive while timing;
benchmarks/gpu_lock.py) and merges their JSON files; under the report's deadline
(benchmarks/deadline.py) a mode times fewer steps, and later modes are skipped, rather than
losing everything.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import os
import sys
import time
from typing import Optional

import torch
import transformers

import fxamp
import fxamp.optim
from benchmarks import deadline, gpu_lock
from benchmarks.step_timing import kernel_profile

# name: (hidden, intermediate, layers, heads, kv heads, vocab, seq, batch)
MODELS = {
    "llama1b": ("llama", 2048, 5632, 16, 32, 8, 32000, 2048, 4),
    "gpt2": ("gpt2", 768, 3072, 12, 12, 12, 50304, 1024, 8),
}
TINY = {"llama1b": ("llama", 64, 128, 1, 4, 4, 256, 32, 2),  # one layer: the smoke is tracing
        "gpt2": ("gpt2", 64, 256, 1, 4, 4, 256, 32, 2)}
FLOAT8_MODES = ("bf16", "torchao-f8", "fxamp-f8", "fxamp-f8-delay")
STACK_MODES = ("compile-autocast", "whole-stack")
MODES = FLOAT8_MODES + STACK_MODES
LR, WEIGHT_DECAY = 1e-4, 0.01


def build(spec: tuple) -> torch.nn.Module:
    kind, hidden, inter, layers, heads, kv, vocab, seq, _ = spec
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
            max_position_embeddings=seq, attn_implementation="sdpa"))
    return as_linear(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_inner=inter, n_layer=layers, n_head=heads,
        n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0)))


def as_linear(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every transformers Conv1D (y = x @ W + b, W of shape (in, out)) replaced by
    the nn.Linear that computes the same (weight W.T), in place."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        if isinstance(module, Conv1D):
            n_in, n_out = module.weight.shape
            linear = torch.nn.Linear(n_in, n_out, device=module.weight.device,
                                     dtype=module.weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(module.weight.t())
                linear.bias.copy_(module.bias)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, linear)
    return model


def prepare(mode: str, base: torch.nn.Module, recipe: str, compiler: str,
            device: str) -> torch.nn.Module:
    """The mode's model: a copy of `base` (kept on the CPU) on `device`, converted/compiled."""
    model = copy.deepcopy(base).to(device)
    if mode == "torchao-f8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = model.to(torch.bfloat16)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
        return torch.compile(model, backend=compiler)
    if mode == "compile-autocast":
        return torch.compile(model, backend=compiler)
    float8 = {"bf16": None, "fxamp-f8": recipe, "whole-stack": recipe,
              "fxamp-f8-delay": fxamp.Float8Config(recipe=recipe, scaling="delayed")}[mode]
    return fxamp.compile(model, opt_level="O2", dtype=torch.bfloat16, float8=float8,
                         compiler=compiler)


def optimizer(mode: str, model: torch.nn.Module, compiler: str) -> torch.optim.Optimizer:
    if mode == "whole-stack":  # fxamp's fused step, uncompiled in the smoke (aot_eager)
        return fxamp.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                 state_format="low_memory", compile=compiler == "inductor")
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                             fused=mode == "compile-autocast")


def _step(model, opt, ids, autocast) -> torch.Tensor:
    with autocast():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_model(name: str, spec: tuple, device: str, modes: list[str], recipe: str,
              steps: int, warmup: int, compiler: str, *, lock: Optional[str] = None,
              profile: int = 0, save=lambda results: None) -> dict:
    *_, vocab, seq, batch = spec
    base = build(spec)  # on the CPU: each mode copies it to the device
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
               for _ in range(warmup + steps)]
    results, slowest = {}, 0.0
    for mode in modes:
        if not deadline.enough_for(1.5 * slowest):
            results[mode] = {"skipped": "not run: the report's deadline was near"}
        else:
            start = time.perf_counter()
            results[mode] = _time_mode(mode, base, recipe, compiler, batches, warmup, device,
                                       lock, profile)
            results[mode]["tokens_per_step"] = batch * seq
            gc.collect()  # the mode's model, optimizer state and compiled graphs
            if device == "cuda":
                torch.cuda.empty_cache()
            slowest = max(slowest, time.perf_counter() - start)
        print(f"{name:8s} {mode:16s} {_line(results[mode], batch * seq)}", flush=True)
        for k in results[mode].get("kernels", [])[:10]:
            print(f"    {k['us']:10.1f} us  {k['calls']:4d}x  {k['name'][:100]}")
        save(results)
    return results


def _time_mode(mode, base, recipe, compiler, batches, warmup, device, lock, profile) -> dict:
    try:
        model = prepare(mode, base, recipe, compiler, device)
    except (ImportError, fxamp.ConfigError) as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    opt = optimizer(mode, model, compiler)
    autocast = (functools.partial(torch.autocast, device, dtype=torch.bfloat16)
                if mode == "compile-autocast" else contextlib.nullcontext)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with gpu_lock.hold(lock, exclusive=False):  # compiling: other processes compile too
        for ids in batches[:warmup]:
            _step(model, opt, ids, autocast)
        sync()
    losses = []
    with gpu_lock.hold(lock, exclusive=True):  # timing: the GPU to this process
        start = time.perf_counter()
        for ids in batches[warmup:]:
            losses.append(_step(model, opt, ids, autocast))
            # Under the report's deadline: fewer steps (at least 2), not none.
            if len(losses) >= 2 and not deadline.enough_for(
                    2 * (time.perf_counter() - start) / len(losses) + 1):
                break
        sync()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        kernels = (kernel_profile(lambda: _step(model, opt, batches[-1], autocast),
                                  torch.device(device))[:profile] if profile else [])
    return {"seconds": seconds, "steps": len(losses), "losses": [x.item() for x in losses],
            "final_loss": losses[-1].item(), "peak_gib": peak, "kernels": kernels}


def _line(r: dict, tokens_per_step: int) -> str:
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    tps = r["steps"] * tokens_per_step / r["seconds"]
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f} GiB"
    return f"{tps:12.0f} tokens/s  peak {peak:>10s}  final loss {r['final_loss']:.4f}"


def targets(results: dict) -> list[str]:
    """The issues' targets, as lines of text, for the models measured: speed per step, and the
    loss at the last step that both modes took."""
    lines = []
    for name, r in results.items():
        ok = {m: "seconds" in r.get(m, {}) for m in MODES}

        def per_step(mode):
            return r[mode]["seconds"] / r[mode]["steps"]

        def drift(mode, ref):
            last = min(r[mode]["steps"], r[ref]["steps"]) - 1
            return last + 1, abs(r[mode]["losses"][last] / r[ref]["losses"][last] - 1)
        if ok["fxamp-f8"] and ok["bf16"]:
            speedup = per_step("bf16") / per_step("fxamp-f8")
            step, d = drift("fxamp-f8", "bf16")
            lines.append(f"{name}: fxamp-f8 / bf16 = {speedup:.2f}x (target >= 1.2 on llama1b); "
                         f"loss at step {step} {100 * d:.2f} % from bf16 (target <= 0.5 %)")
        if ok["fxamp-f8"] and ok["torchao-f8"]:
            ratio = per_step("torchao-f8") / per_step("fxamp-f8")
            lines.append(f"{name}: fxamp-f8 / torchao-f8 = {ratio:.2f}x (target >= 1.0)")
        if ok["fxamp-f8"] and ok["fxamp-f8-delay"]:
            ratio = per_step("fxamp-f8") / per_step("fxamp-f8-delay")
            lines.append(f"{name}: delayed / dynamic = {ratio:.2f}x (target >= 1.0)")
        if ok["whole-stack"] and ok["compile-autocast"]:
            lines += _stack_targets(name, r, per_step("compile-autocast") / per_step(
                "whole-stack"), drift("whole-stack", "compile-autocast"))
    return lines


def _stack_targets(name: str, r: dict, speedup: float, drift: tuple[int, float]) -> list[str]:
    stack, base = r["whole-stack"], r["compile-autocast"]
    checks = [(f"tokens/s vs compile-autocast >= 1.3x: {speedup:.2f}x", speedup >= 1.3),
              (f"loss at step {drift[0]} within 1 % of compile-autocast's: "
               f"{100 * drift[1]:.2f} %", drift[1] <= 0.01)]
    if stack["peak_gib"] and base["peak_gib"]:
        ratio = stack["peak_gib"] / base["peak_gib"]
        checks.append((f"peak memory <= 0.6x compile-autocast's: {ratio:.2f}x "
                       f"({stack['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB)", ratio <= 0.6))
    return [f"{'PASS' if ok else 'FAIL'}  {name} whole stack: {what}" for what, ok in checks]


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, aot_eager")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(FLOAT8_MODES), choices=list(MODES))
    parser.add_argument("--recipe", default="tensorwise", choices=list(fxamp.float8.RECIPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lock", help="a lock file shared with other benchmark processes on "
                                       "this GPU (benchmarks/gpu_lock.py)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="keep each mode's N slowest kernels of one extra profiled step")
    parser.add_argument("--json", help="write the results here (rewritten after each mode)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("float8_gpu: skipped, no CUDA device (use --smoke for the CPU code path)")
        return {}
    device, compiler = ("cpu", "aot_eager") if args.smoke else ("cuda", "inductor")
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    results: dict = {}

    def save(model_results: dict, name: str = "") -> None:
        if args.json:  # written whole and renamed: a killed run leaves its last complete file
            with open(args.json + ".tmp", "w") as f:
                json.dump({"recipe": args.recipe, "device": device,
                           "results": {**results, name: model_results}}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
    for name in args.models:
        results[name] = run_model(name, (TINY if args.smoke else MODELS)[name], device,
                                  args.modes, args.recipe, steps, warmup, compiler,
                                  lock=args.lock, profile=args.profile,
                                  save=lambda r, name=name: save(r, name))
    for line in targets(results):
        print(line)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
