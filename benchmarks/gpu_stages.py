"""Runs benchmarks/gpu_report.py's stages: one after another in priority order under one
deadline, the parts of a stage side by side, each stage capped at its share of the time left.

# Note [Shares of the time left]
A lent GPU machine may come once, for one command of at most 10 minutes; what matters most must
be measured first and nothing may be lost to what runs long. So the stages run in priority order,
and a stage of the first tier (`first`: Note [Measured first] in benchmarks/gpu_report.py) is
capped at its share of what is left of the budget when it starts, among the first tier:
    cap_i = left * share_i / (share_i + the shares of the first-tier stages after it)
A stage that ends early leaves its time to the later ones, one that runs long (up to its cap)
takes from them, and a stage whose cap would be below its `min_s` is skipped, recorded as such.
The stages after the first tier (figures measured before) get what the first tier left, in
order: each is capped at all that is left, and skipped when that is below its `min_s`.
A part still running at its stage's cap is killed (its process group: Inductor's compile
workers too) and recorded "over cap"; the stage after it runs all the same. Parts learn their
cap (benchmarks/deadline.py, as a deadline 10 % or 5 s before it) and size themselves to it:
fewer rounds, recipes or modes, rather than nothing; what a killed part wrote is kept.

Parts of one stage run side by side because compiling is CPU work (16 cores) and timing needs
the GPU alone: each part holds benchmarks/gpu_lock.py's lock shared while it compiles and
exclusively while it times, so compiles overlap and timings do not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from typing import Callable, Optional

from benchmarks import deadline


@dataclasses.dataclass
class Part:
    name: str  # its log is DIR/<name>.log
    argv: list[str]
    results: Optional[str] = None  # the file it writes (JSON or junit XML)
    env: dict = dataclasses.field(default_factory=dict)
    status: str = "not started"
    wall_s: float = 0.0


@dataclasses.dataclass
class Stage:
    name: str
    parts: list[Part]
    share: float
    min_s: float = 0.0
    first: bool = True  # Note [Shares of the time left]
    status: str = "not started"
    cap_s: float = 0.0
    wall_s: float = 0.0


def run(stages: list[Stage], out: str, budget_s: float, *, root: str,
        after_stage: Optional[Callable[[list[Stage]], None]] = None) -> None:
    """Run `stages` in order within `budget_s` (Note [Shares of the time left]); `after_stage`
    sees every stage's state after each one (to write the report as it goes)."""
    end = time.monotonic() + budget_s
    with _terminate_as_interrupt():
        for i, stage in enumerate(stages):
            left = end - time.monotonic()
            tier = [s.share for s in stages[i:] if s.first] if stage.first else [stage.share]
            stage.cap_s = max(0.0, left * stage.share / sum(tier))
            if stage.cap_s < max(stage.min_s, 1.0):
                stage.status = (f"skipped: {stage.cap_s:.0f} s of the budget left for it, it "
                                f"needs {stage.min_s:.0f} s")
                for part in stage.parts:
                    part.status = "skipped"
            else:
                _run_stage(stage, out, root)
            if after_stage is not None:
                after_stage(stages)


def _run_stage(stage: Stage, out: str, root: str) -> None:
    start, procs = time.monotonic(), {}
    # The parts aim to end a little before the cap, to write what they measured.
    cap_env = {deadline.ENV: f"{time.time() + stage.cap_s - max(5.0, 0.1 * stage.cap_s):.1f}"}
    with contextlib.ExitStack() as stack:
        stack.callback(_stop_all, stage.parts, procs)  # on an interrupt: nothing left running
        for part in stage.parts:
            log = stack.enter_context(open(os.path.join(out, f"{part.name}.log"), "w"))
            procs[part.name] = subprocess.Popen(
                part.argv, stdout=log, stderr=subprocess.STDOUT, cwd=root,
                env=_env(root, {**part.env, **cap_env}), start_new_session=True)
            part.status = "running"
        while any(p.status == "running" for p in stage.parts):
            time.sleep(0.2)
            elapsed = time.monotonic() - start
            for part in (p for p in stage.parts if p.status == "running"):
                _poll(part, procs[part.name], elapsed, stage.cap_s)
    stage.wall_s = time.monotonic() - start
    stage.status = _summary(stage.parts)


def _summary(parts: list[Part]) -> str:
    bad = [f"{p.name}: {p.status}" for p in parts if p.status != "ok"]
    return "ok" if not bad else "; ".join(bad)


def _env(root: str, extra: dict) -> dict:
    # fxamp need not be installed: the parts import it, and the benchmarks, from the repository.
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _poll(part: Part, proc: subprocess.Popen, elapsed: float, cap_s: float) -> None:
    rc = proc.poll()
    part.wall_s = elapsed
    if rc is not None:
        part.status = "ok" if rc == 0 else f"failed (exit {rc})"
    elif elapsed > cap_s:
        _kill(proc)
        part.status = f"over cap ({cap_s:.0f} s): killed, partial results kept"


def _stop_all(parts: list[Part], procs: dict) -> None:
    for part in (p for p in parts if p.status == "running"):
        _kill(procs[part.name])
        part.status = "interrupted"


def _kill(proc: subprocess.Popen) -> None:
    try:  # the part and its children (Inductor's compile workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (`timeout`, the machine's limit) ends the run as Ctrl-C does: parts killed."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
