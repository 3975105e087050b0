"""gpu_report's results: gathered from the stages' files into one dict (the JSON), checked against
the issue's targets, and rendered as the markdown that docs/benchmarks.md pastes."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import xml.etree.ElementTree as ET
from typing import Any, Optional

from benchmarks import bench_e2e, optimizer_step

PACKAGES = ("torch", "triton", "transformers", "torchvision", "timm", "pytest", "hypothesis")


def collect(stages: list, command: str, started: float, ended: float) -> dict[str, Any]:
    by = {s.name: s for s in stages}
    e2e = [_load_json(s.results) for s in stages if s.name.startswith("e2e-")]
    report = {
        "command": command,
        "date": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "wall_s": round(ended - started, 1),
        "device": _device(),
        "versions": {name: _version(name) for name in PACKAGES},
        "stages": [dict(name=s.name, status=s.status, wall_s=round(s.wall_s, 1),
                        cap_s=s.cap_s, log=os.path.basename(s.name) + ".log") for s in stages],
        "tests": _junit(by["tests"].results),
        "optimizer": _load_json(by["optimizer"].results),
        "e2e": {"environments": [r["environment"] for r in e2e if r],
                "results": [m for r in e2e if r for m in r["results"]]},
    }
    report["targets"] = targets(report)
    return report


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores): a smoke run, its figures measure nothing"


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_json(path: Optional[str]) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, TypeError, ValueError):
        return None


def _junit(path: str) -> Optional[dict]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome in ("failure", "error"):
            message = next(c for c in case if c.tag == outcome).get("message", "")
            failures.append(f"{case.get('classname')}::{case.get('name')}: {message[:300]}")
        counts["failed" if outcome in ("failure", "error") else outcome or "passed"] += 1
    return {**counts, "failures": failures}


def _measurements(report: dict) -> list:
    return [bench_e2e.Measurement(**m) for m in report["e2e"]["results"]]


def targets(report: dict) -> list[str]:
    """PASS/FAIL per target of the issue that this run measured (and the optimizer's, which
    optimizer_step checked itself)."""
    lines = [t for size in (report["optimizer"] or {}).get("sizes", []) for t in size["targets"]]
    by = {(m.model, m.dtype, m.recipe): m for m in _measurements(report) if m.step_ms}
    for (model, dtype, recipe), m in sorted(by.items()):
        base = by.get((model, dtype, "compile"))
        if recipe.startswith("fxamp") and base:
            lines += _e2e_targets(f"{model} {dtype} {recipe}", m, base)
    return lines


def _e2e_targets(name: str, m, base) -> list[str]:
    bound = 0.95 if m.recipe == "fxamp-O2" else 1.0
    at_most = [(f"step time <= {bound}x compile's", m.step_ms / base.step_ms, bound)]
    if m.recipe == "fxamp-O2":
        at_most.append(("peak memory <= compile's", m.peak_mb / base.peak_mb, 1.0))
    if base.compile_s:
        at_most.append(("cold compile <= 1.15x compile's", m.compile_s / base.compile_s, 1.15))
    if m.breakdown and m.compile_s:
        at_most.append(("fxamp re-trace + passes <= 0.05 of its compile",
                        m.breakdown["fxamp_s"] / m.compile_s, 0.05))
    lines = [f"{'PASS' if value <= bound else 'FAIL'}  {name}: {what}: {value:.2f}"
             for what, value, bound in at_most]
    if m.mfu is not None and m.model == "gpt2" and m.dtype == "bf16":
        lines.append(f"{'PASS' if m.mfu >= 0.45 else 'FAIL'}  {name}: MFU >= 45%: "
                     f"{100 * m.mfu:.1f}%")
    return lines


def render(report: dict) -> str:
    v = report["versions"]
    lines = [f"### GPU report: {report['device']}, {report['date']}", "",
             f"`{report['command']}`: {report['wall_s']:.0f} s | " + " | ".join(
                 f"{k} {v[k]}" for k in PACKAGES if v[k]), "",
             "| stage | status | wall (s) | cap (s) |", "|---|---|---:|---:|"]
    lines += [f"| {s['name']} | {s['status']} | {s['wall_s']:.0f} | {s['cap_s']:.0f} |"
              for s in report["stages"]]
    lines += ["", *_tests_lines(report["tests"]), "", *_optimizer_lines(report["optimizer"]),
              "", *_e2e_lines(report), "", "Targets:", "", "```", *report["targets"], "```"]
    return "\n".join(lines) + "\n"


def _tests_lines(tests: Optional[dict]) -> list[str]:
    if tests is None:
        return ["CUDA tests (`pytest -m gpu tests/gpu`): no results (see tests.log)."]
    head = (f"CUDA tests (`pytest -m gpu tests/gpu`): {tests['passed']} passed, "
            f"{tests['failed']} failed, {tests['skipped']} skipped.")
    return [head] + [f"- FAILED {f}" for f in tests["failures"]]


def _optimizer_lines(results: Optional[dict]) -> list[str]:
    if not results:
        return ["Optimizer step: no results (see optimizer.log)."]
    import torch

    low = getattr(torch, results["dtype"])
    return [f"Optimizer step ({results['environment'].lstrip('# ')}):"] + [
        line for size in results["sizes"] for line in optimizer_step.report(size, low)]


def _e2e_lines(report: dict) -> list[str]:
    results = _measurements(report)
    if not results:
        return ["End to end: no results (see the e2e-*.log files)."]
    envs = sorted(set(report["e2e"]["environments"]))
    return (["End to end (" + "; ".join(envs) + "):", ""] + bench_e2e.absolute_rows(results)
            + ["", "fxamp / baseline (below 1 is better for fxamp):", ""]
            + bench_e2e.ratio_rows(results)
            + ["", "Where the cold compile went (seconds, share of the recipe's compile time):",
               ""] + bench_e2e.breakdown_rows(results))
