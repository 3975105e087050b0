"""The GPU proof in one command: the CUDA tests, the optimizer benchmark at 1B parameters and the
end-to-end benchmark, in about 9 minutes, written to one JSON and one markdown table.

    python3 -m benchmarks.gpu_report --out DIR            # on a CUDA machine (H100/H200)
    python3 -m benchmarks.gpu_report --out DIR --smoke    # the same code path on CPU, tiny

Stages (each a subprocess with its own log, DIR/<stage>.log, and results file):
  tests       python -m pytest -m gpu tests/gpu: torch's CUDA autocast lists, fused-step numerics
              against fp32 AdamW, the step under set_sync_debug_mode("error"), kernels per step
  optimizer   benchmarks.optimizer_step at 1B parameters in 128 tensors, O2 fp16 (fp32 masters)
  e2e-M-D     benchmarks.bench_e2e for model M (GPT-2 124M at 1024 tokens, ResNet-50 at 224^2)
              in dtype D (fp16, bf16): eager, torch.compile, fxamp O1 and O2, taking turns

# Note [Compiling side by side, timing in turns]
Twelve cold compiles of GPT-2 and ResNet-50 take longer than the 10 minutes a lent GPU machine
gives one command, if run one after another; compiling is CPU work and the machine has 16
cores. So every stage starts at once: the e2e processes compile and warm up holding a lock
file shared (the tests hold it shared too), and each timing part (an e2e process's interleaved
steps, the whole optimizer benchmark) holds it exclusively, so nothing else runs on the GPU
while something is timed (benchmarks/gpu_lock.py). Compile times measured side by side are
longer than alone; their ratios within one e2e process (same load, minutes apart) are the
figure to read, and compile_breakdown's parts say where the time went.

Each stage has a wall-clock cap, counted from the start of the report; a stage still running
at its cap is killed and recorded as "over cap" with what it had written by then (the
benchmarks rewrite their JSON as results come). Nothing needs the network or expecttest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from benchmarks import gpu_lock

E2E_MODELS, E2E_DTYPES = ("gpt2", "resnet"), ("bf16", "fp16")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


@dataclasses.dataclass
class Stage:
    name: str
    argv: list[str]
    cap_s: float  # from the report's start
    results: Optional[str] = None  # the JSON file the stage writes
    shared_lock: bool = False  # the report holds the lock shared while the stage runs
    env: dict = dataclasses.field(default_factory=dict)
    status: str = "not started"
    wall_s: float = 0.0


def plan(out: str, smoke: bool, budget_s: float) -> list[Stage]:
    """The stages and their caps; `smoke`: CPU, tiny sizes, no Inductor (fast and the same
    code path)."""
    lock, py = os.path.join(out, "gpu.lock"), [sys.executable, "-m"]
    device = ["--device", "cpu"] if smoke else ["--device", "cuda"]
    quick = ["--compiler", "aot_eager"] if smoke else []
    tests = Stage("tests", py + ["pytest", "-m", "gpu", "tests/gpu", "-q", "-p",
                                 "no:cacheprovider", f"--junitxml={out}/tests.xml"],
                  cap_s=0.55 * budget_s, results=f"{out}/tests.xml", shared_lock=True)
    sizes = (["--params", "2e5", "--tensors", "20", "--reps", "3", "--warmup", "2"] if smoke
             else ["--params", "1e9", "--tensors", "128", "--reps", "20"])
    optimizer = Stage("optimizer", py + ["benchmarks.optimizer_step", *device, *sizes, *quick,
                                         "--modes", "O2", "--lock", lock,
                                         "--json", f"{out}/optimizer.json"],
                      cap_s=budget_s, results=f"{out}/optimizer.json")
    stages = [tests, optimizer]
    dtypes = E2E_DTYPES[:1] if smoke else E2E_DTYPES
    threads = max(1, (os.cpu_count() or 1) // (len(dtypes) * len(E2E_MODELS)))
    for dtype in dtypes:
        for model in E2E_MODELS:
            name = f"e2e-{model}-{dtype}"
            steps = ["--size", "tiny", "--steps", "3", "--warmup", "1", "--recipes", "eager",
                     "compile", "fxamp-O2"] if smoke else ["--size", "large", "--steps", "30"]
            stages.append(Stage(name, py + ["benchmarks.bench_e2e", *device, *steps, *quick,
                                            "--models", model, "--dtype", dtype,
                                            "--lock", lock, "--json", f"{out}/{name}.json"],
                                cap_s=budget_s, results=f"{out}/{name}.json",
                                env={"TORCHINDUCTOR_COMPILE_THREADS": str(threads)}))
    return stages


def run(stages: list[Stage], out: str) -> None:
    """Start every stage, wait for each to end or reach its cap (Note [Compiling side by side,
    timing in turns])."""
    start, procs = time.monotonic(), {}
    with contextlib.ExitStack() as stack:
        shared = stack.enter_context(contextlib.ExitStack())
        # For the shared stages: taken before any stage can take the lock exclusively.
        shared.enter_context(gpu_lock.hold(os.path.join(out, "gpu.lock"), exclusive=False))
        stack.callback(_stop_all, stages, procs)
        for stage in stages:
            log = stack.enter_context(open(os.path.join(out, f"{stage.name}.log"), "w"))
            procs[stage.name] = subprocess.Popen(
                stage.argv, stdout=log, stderr=subprocess.STDOUT, env=_env(stage), cwd=ROOT,
                start_new_session=True)
            stage.status = "running"
        while any(s.status == "running" for s in stages):
            time.sleep(0.5)
            for stage in (s for s in stages if s.status == "running"):
                _poll(stage, procs[stage.name], time.monotonic() - start)
            if not any(s.status == "running" for s in stages if s.shared_lock):
                shared.close()


def _env(stage: Stage) -> dict:
    # fxamp need not be installed: the stages import it, and the benchmarks, from here.
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **stage.env}


def _stop_all(stages: list[Stage], procs: dict) -> None:
    for stage in (s for s in stages if s.status == "running"):  # interrupted (Ctrl-C)
        _kill(procs[stage.name])
        stage.status = "interrupted"


def _poll(stage: Stage, proc: subprocess.Popen, elapsed: float) -> None:
    rc = proc.poll()
    stage.wall_s = elapsed
    if rc is not None:
        stage.status = "ok" if rc == 0 else f"failed (exit {rc})"
    elif elapsed > stage.cap_s:
        _kill(proc)
        stage.status = f"over cap ({stage.cap_s:.0f} s): killed, partial results kept"


def _kill(proc: subprocess.Popen) -> None:
    try:  # the stage and its children (Inductor's compile workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the report, logs and results")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes, no Inductor: checks that the command works")
    parser.add_argument("--budget", type=float,
                        help="seconds for the whole report (default 540; smoke 100)")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)  # the stages run in the repository
    os.makedirs(args.out, exist_ok=True)
    budget = args.budget or (100.0 if args.smoke else 540.0)
    stages = plan(args.out, args.smoke, budget)
    command = "python3 -m benchmarks.gpu_report " + " ".join(argv or sys.argv[1:])
    print(f"{command}: {len(stages)} stages side by side, {budget:.0f} s budget; logs in "
          f"{args.out}/", flush=True)
    started = time.time()
    run(stages, args.out)
    from benchmarks import report_md  # torch, transformers, fxamp: not before the stages start

    report = report_md.collect(stages, command, started, time.time())
    with open(os.path.join(args.out, "gpu_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    markdown = report_md.render(report)
    with open(os.path.join(args.out, "gpu_report.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    return report


if __name__ == "__main__":
    main()
