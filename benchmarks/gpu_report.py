"""The GPU proof in one command: within one budget (8 minutes), first what no GPU report has
measured yet or what changed since the last one, then, with the time left, the figures already
measured; one JSON, one markdown table, one archive.

    python3 -m benchmarks.gpu_report --out DIR --archive $OUT/gpu_report.tar.gz   # CUDA (H100)
    python3 -m benchmarks.gpu_report --out DIR --smoke    # the same code paths on CPU, tiny

Stages, in priority order (Note [Measured first]; benchmarks/gpu_stages.py: Note [Shares of
the time left]); the parts of a stage run side by side, each with its log DIR/<part>.log and
its results file:
  float8-llama1b  benchmarks.float8_gpu on the 1B Llama-style model: bf16, torchao float8, fxamp
                  float8 and fxamp float8 delayed (two parts of two modes), each mode's slowest
                  kernels of one profiled step
  whole-stack     benchmarks.float8_gpu on the same model and batches: float8 GEMMs + the
                  7 B/param low_memory state + fxamp's fused step against torch.compile +
                  autocast + fused AdamW (one part each): tokens/s, peak memory, loss
  optimizer       benchmarks.optimizer_step: 1B parameters in 128 tensors, O2 with a bf16 model:
                  fxamp's default, low_memory, compensated and stochastic+int8 formats against
                  fused AdamW + GradScaler, torch's eager O2 and torchao's AdamW8bit (where it
                  imports), in groups that fit the memory (benchmarks/optimizer_groups.py);
                  fxamp's kernels by name
  tests           pytest -m gpu: tests/gpu/test_cuda_optim.py (the fused step against fp32
                  AdamW, the step under set_sync_debug_mode("error"), kernels per step),
                  tests/gpu/test_cuda_parity.py (torch's CUDA autocast lists) and
                  tests/gpu/test_planner_roofline.py (the planner's modeled GEMM times against
                  measured ones; -s prints the table into its log)
then, with the time left:
  float8-gpt2     benchmarks.float8_gpu, GPT-2 124M: the four float8 modes (one part each)
  e2e-gpt2        benchmarks.bench_e2e, GPT-2 124M at 1024 tokens x 8, bf16 and fp16 (one part
                  each): eager autocast, torch.compile + autocast, fxamp O1 and O2; MFU
  e2e-resnet      benchmarks.bench_e2e, ResNet-50 (torchvision) at 224^2 x 64, bf16 and fp16
After every stage it rewrites DIR/gpu_report.json and DIR/gpu_report.md and packs DIR into
the archive, so a run stopped from outside keeps everything up to its last stage. Nothing needs
the network or expecttest; torchao is used where it imports (docs/benchmarks.md: its wheel).

# Note [Measured first]
A session is lent a GPU for 15 minutes in all, machine start included: one call of the report,
rarely two. The first report (H100, 2026-11-27) spent its call on what it listed first, and the
1B float8 model, last, was skipped. So the stages are in two tiers. FIRST: what no report has
measured, or what changed since the last one (the 1B float8 model and the whole stack, never
run; the optimizer step, whose kernels changed, with the peers the first call skipped; the CUDA
tests, which failed): these share the budget among themselves. Then the stages whose figures
are already in the docs, measured again only with the time the first tier left, in order.
Update FIRST when a report has measured something (and say so in docs/benchmarks.md).
`--stages` runs the named stages, in the order given, all as first tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from typing import Optional

from benchmarks.gpu_stages import Part, Stage, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# name: (share of the time left, least seconds worth starting it with: Note [Shares of the
# time left]), in priority order within each tier (Note [Measured first]).
STAGES = {"float8-llama1b": (0.3, 120), "whole-stack": (0.25, 100), "optimizer": (0.2, 60),
          "tests": (0.15, 30), "float8-gpt2": (0.2, 90), "e2e-gpt2": (0.3, 90),
          "e2e-resnet": (0.1, 60)}
FIRST = ("float8-llama1b", "whole-stack", "optimizer", "tests")
ORDER = FIRST + tuple(name for name in STAGES if name not in FIRST)
FLOAT8_MODES = ("bf16", "torchao-f8", "fxamp-f8", "fxamp-f8-delay")
PROFILED_KERNELS = 15  # per float8 mode: its slowest kernels of one profiled step


def plan(out: str, smoke: bool, names: Optional[list[str]] = None) -> list[Stage]:
    """The stages; `smoke`: CPU, tiny sizes, no Inductor, fewer parts (the same code paths).
    `names`: only these, in this order, all first tier."""
    parts = {"tests": lambda: _tests(out, smoke), "optimizer": lambda: [_optimizer(out, smoke)],
             "e2e-gpt2": lambda: _e2e(out, smoke, "gpt2"),
             "float8-gpt2": lambda: _float8(out, smoke, "float8-gpt2", "gpt2", (
                 [["bf16", "fxamp-f8"], ["torchao-f8", "fxamp-f8-delay"]] if smoke
                 else [[m] for m in FLOAT8_MODES])),
             "e2e-resnet": lambda: _e2e(out, smoke, "resnet"),
             # two processes: four 1B models side by side would not fit the GPU's memory;
             # fxamp's and torchao's float8 first in each, should the deadline cut the second
             "float8-llama1b": lambda: _float8(out, smoke, "float8-llama1b", "llama1b", (
                 [["fxamp-f8", "torchao-f8"]] if smoke
                 else [["fxamp-f8", "bf16"], ["torchao-f8", "fxamp-f8-delay"]])),
             "whole-stack": lambda: _float8(out, smoke, "whole-stack", "llama1b", (
                 [["compile-autocast", "whole-stack"]] if smoke
                 else [["compile-autocast"], ["whole-stack"]]))}
    cores = os.cpu_count() or 1
    stages = []
    for name in names or ORDER:
        share, min_s = STAGES[name]
        stage_parts = parts[name]()
        for part in stage_parts:  # Inductor's compile workers: the cores shared by the parts
            part.env["TORCHINDUCTOR_COMPILE_THREADS"] = str(max(1, cores // len(stage_parts)))
        stages.append(Stage(name, stage_parts, share, 0.0 if smoke else min_s,
                            first=bool(names) or name in FIRST))
    return stages


def _module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def _tests(out: str, smoke: bool) -> list[Part]:
    files = ({"gpu": "tests/gpu"} if smoke else  # without CUDA the files only skip: one part
             {"optim": "tests/gpu/test_cuda_optim.py", "autocast": "tests/gpu/test_cuda_parity.py",
              "planner": "tests/gpu/test_planner_roofline.py",
              # mxfp8/nvfp4 emulated on CUDA; their hardware GEMM's test runs on 10.0+ only
              "blockscaled": "tests/gpu/test_blockscaled_cuda.py"})
    # -n 0: one process (pyproject's addopts start a worker per core: GPU tests time and count
    # kernels, and must have the GPU to themselves)
    return [Part(f"tests-{name}", _module("pytest", "-m", "gpu", path, "-v", "-s", "-n", "0", "-p",
                                          "no:cacheprovider", f"--junitxml={out}/tests-{name}.xml"),
                 f"{out}/tests-{name}.xml") for name, path in files.items()]


def _optimizer(out: str, smoke: bool) -> Part:
    sizes = (["--device", "cpu", "--params", "2e5", "--tensors", "20", "--reps", "3",
              "--warmup", "1", "--compiler", "aot_eager", "--memory-gib", "0.01"] if smoke
             else ["--device", "cuda", "--params", "1e9", "--tensors", "128", "--reps", "20"])
    return Part("optimizer", _module("benchmarks.optimizer_step", *sizes, "--modes", "O2",
                                     "--dtype", "bfloat16", "--lock", f"{out}/gpu.lock",
                                     "--json", f"{out}/optimizer.json"), f"{out}/optimizer.json")


def _e2e(out: str, smoke: bool, model: str) -> list[Part]:
    sizes = (["--device", "cpu", "--size", "tiny", "--steps", "3", "--warmup", "1",
              "--recipes", "eager", "compile", "ceiling", "fxamp-O2", "--compiler",
              "aot_eager"] if smoke
             else ["--device", "cuda", "--size", "large", "--steps", "30", "--warmup", "3",
                   # O2 before O1: the headline target, if the deadline leaves room for one
                   "--recipes", "eager", "compile", "fxamp-O2", "ceiling", "fxamp-O1"])
    return [Part(f"e2e-{model}-{dtype}", _module(
        "benchmarks.bench_e2e", *sizes, "--models", model, "--dtype", dtype, "--lock",
        f"{out}/gpu.lock", "--json", f"{out}/e2e-{model}-{dtype}.json"),
        f"{out}/e2e-{model}-{dtype}.json") for dtype in (("bf16",) if smoke else ("bf16", "fp16"))]


def _float8(out: str, smoke: bool, stage: str, model: str,
            mode_groups: list[list[str]]) -> list[Part]:
    sizes = ["--smoke"] if smoke else (["--steps", "20", "--warmup", "5"] if model == "gpt2"
                                       else ["--steps", "10", "--warmup", "3"])
    profile = ["--profile", str(5 if smoke else PROFILED_KERNELS)]
    parts = []
    for modes in mode_groups:
        name = f"{stage}-{'+'.join(modes)}" if len(mode_groups) > 1 else stage
        parts.append(Part(name, _module("benchmarks.float8_gpu", *sizes, *profile, "--models",
                                        model, "--modes", *modes, "--lock", f"{out}/gpu.lock",
                                        "--json", f"{out}/{name}.json"), f"{out}/{name}.json"))
    return parts


def write(stages: list[Stage], out: str, command: str, started: float,
          archive: Optional[str]) -> dict:
    """The report as it stands (JSON, markdown), and the archive of DIR."""
    from benchmarks import report_md  # torch, transformers: not before the first stage starts

    report = report_md.collect(stages, command, started, time.time())
    with open(os.path.join(out, "gpu_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    markdown = report_md.render(report)
    with open(os.path.join(out, "gpu_report.md"), "w") as f:
        f.write(markdown)
    if archive:
        pack(out, archive)
        shutil.copyfile(os.path.join(out, "gpu_report.md"),
                        os.path.join(os.path.dirname(archive), "gpu_report.md"))
    return report


def pack(out: str, archive: str) -> None:
    """DIR as a .tar.gz, written whole and renamed (what a stopped run leaves is complete)."""
    with tarfile.open(archive + ".tmp", "w:gz") as tar:
        for name in sorted(os.listdir(out)):
            if name != "gpu.lock" and not name.endswith(".tmp"):
                tar.add(os.path.join(out, name), arcname=os.path.join("gpu_report", name))
    os.replace(archive + ".tmp", archive)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the report, logs and results")
    parser.add_argument("--archive", help="pack the folder into this .tar.gz after each stage "
                                          "(and copy gpu_report.md beside it)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, no Inductor: checks that every stage works")
    parser.add_argument("--budget", type=float,
                        help="seconds for all stages (default 480; smoke 3000, a cap only)")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES),
                        help="only these, in this order (Note [Measured first])")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)  # the parts run in the repository
    os.makedirs(args.out, exist_ok=True)
    if args.archive:
        args.archive = os.path.abspath(args.archive)
        os.makedirs(os.path.dirname(args.archive), exist_ok=True)
    budget = args.budget or (3000.0 if args.smoke else 480.0)
    stages = plan(args.out, args.smoke, args.stages)
    command = "python3 -m benchmarks.gpu_report " + " ".join(sys.argv[1:] if argv is None
                                                             else argv)
    print(f"{command}: {len(stages)} stages in turn, {budget:.0f} s budget; logs in "
          f"{args.out}/", flush=True)
    started = time.time()

    def after_stage(stages: list[Stage]) -> None:
        done = [s for s in stages if s.status != "not started"][-1]
        print(f"[{time.time() - started:5.0f} s] {done.name}: {done.status}", flush=True)
        write(stages, args.out, command, started, args.archive)
    try:
        run(stages, args.out, budget, root=ROOT, after_stage=after_stage)
    finally:  # interrupted too: what was measured is written
        report = write(stages, args.out, command, started, args.archive)
        print(report_md_text(args.out))
    return report


def report_md_text(out: str) -> str:
    with open(os.path.join(out, "gpu_report.md")) as f:
        return f.read()


if __name__ == "__main__":
    main()
