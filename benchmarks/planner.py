"""The precision planner on GPT-2 small: modeled H100 step time, and planning time against a
cold compile (docs/planner.md).

    python3 -m benchmarks.planner                  # GPT-2 small (124M), random init, CPU
    python3 -m benchmarks.planner --layers 2       # a shorter run
    python3 -m benchmarks.planner --no-compile     # the plan only

Plans GPT-2 small (transformers' default GPT2Config, random weights) on one calibration
sequence for target="h100", modeled at a training batch of `--batch-size` sequences, and
prints the plan, the modeled GEMM time of a training step on an H100 for the plan, all-bf16
and all-float8, and the planning time next to one cold `fxamp.compile` (O1, Inductor: the
first forward and backward) of the same model on the same batch. The step times are modeled,
not measured: tests/gpu/test_planner_roofline.py checks them on a GPU.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F
import transformers

import fxamp


def _gpt2(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def _loss(output, ids):
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _cpu() -> float:
    # this process and its finished children (Inductor compiles C++ in worker processes): on a
    # shared machine wall time says more about the neighbours than about the work
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    ids = torch.randint(0, 50257, (1, args.seq), generator=torch.Generator().manual_seed(0))
    model = _gpt2(args.layers)
    start, cpu = time.perf_counter(), _cpu()
    plan = fxamp.plan(model, (ids, ids), _loss, target="h100", batch_size=args.batch_size)
    planning, planning_cpu = time.perf_counter() - start, _cpu() - cpu
    print(plan)
    recipe = plan.recipe or "tensorwise"
    print(f"\nGPT-2 small ({args.layers} layers), training batch {args.batch_size} x {args.seq} "
          f"tokens, modeled GEMM time of one step on an H100 (fxamp/planner/cost.py):")
    for name, seconds in (("plan", plan.step_time()), ("all bf16", plan.step_time("bf16")),
                          (f"all float8 {recipe}", plan.step_time(recipe))):
        print(f"  {name:24} {seconds * 1e3:8.3f} ms  ({plan.step_time('bf16') / seconds:.3f}x "
              "of bf16)")
    print(f"planning (measure + model + choose): {planning:.1f} s wall, {planning_cpu:.1f} s CPU")
    if not args.no_compile:
        model = fxamp.compile(_gpt2(args.layers), opt_level="O1")
        start, cpu = time.perf_counter(), _cpu()
        _loss(model(ids), ids).backward()
        wall, compile_cpu = time.perf_counter() - start, _cpu() - cpu
        print(f"one cold fxamp.compile (O1, Inductor; first forward + backward): {wall:.1f} s "
              f"wall, {compile_cpu:.1f} s CPU -> planning is {planning_cpu / compile_cpu:.2f}x "
              "a cold compile in CPU time")


if __name__ == "__main__":
    main()
