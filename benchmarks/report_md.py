"""gpu_report's results: gathered from the stages' files into one dict (the JSON), checked against
the issue's targets, and rendered as the markdown that docs/benchmarks.md pastes."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from typing import Any, Optional

from benchmarks import bench_e2e, float8_gpu, optimizer_step

PACKAGES = ("torch", "triton", "transformers", "torchvision", "timm", "torchao", "pytest",
            "hypothesis")


def collect(stages: list, command: str, started: float, ended: float) -> dict[str, Any]:
    parts = [p for s in stages for p in s.parts]
    e2e = [_load_json(p.results) for p in parts if p.name.startswith("e2e-")]
    optimizer = next((p for p in parts if p.name == "optimizer"), None)
    report = {
        "command": command,
        "date": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "wall_s": round(ended - started, 1),
        "device": _device(),
        "versions": {name: _version(name) for name in PACKAGES},
        "stages": [dict(name=s.name, status=s.status, wall_s=round(s.wall_s, 1),
                        cap_s=round(s.cap_s, 1), parts=[
                            dict(name=p.name, status=p.status, wall_s=round(p.wall_s, 1),
                                 log=p.name + ".log", last_lines=_last_lines(p))
                            for p in s.parts]) for s in stages],
        "tests": _tests([p for p in parts if p.name.startswith("tests-")]),
        "optimizer": _load_json(optimizer.results) if optimizer else None,
        "e2e": {"environments": [r["environment"] for r in e2e if r],
                "results": [m for r in e2e if r for m in r["results"]]},
        "float8": _float8([_load_json(p.results) for p in parts
                           if p.name.startswith(("float8-", "whole-stack"))]),
    }
    report["targets"] = targets(report)
    return report


def _last_lines(part, n: int = 3) -> list[str]:
    """A part that did not end "ok": the end of its log (why, without unpacking the archive)."""
    if part.status in ("ok", "skipped", "not started") or not part.results:
        return []
    try:
        with open(os.path.join(os.path.dirname(part.results), part.name + ".log")) as f:
            lines = [line.rstrip()[:200] for line in f if line.strip() and "USDT" not in line]
    except OSError:
        return []
    return lines[-n:]


def _float8(files: list) -> dict:
    """The float8 parts' results merged: {model: {mode: result}}."""
    merged: dict = {}
    for f in (f for f in files if f):
        for model, modes in f["results"].items():
            merged.setdefault(model, {}).update(modes)
    return merged


def _device() -> str:
    """The GPU's name from nvidia-smi (this process never touches CUDA: the stages have the
    device to themselves), else torch's, else a smoke run's CPU."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
        if names[0].strip():
            return names[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
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


def _tests(parts: list) -> Optional[dict]:
    """The test parts' counts and failures, from their junit XML, else (a part killed before
    pytest wrote it) from the verbose log."""
    counts, failures, found = {"passed": 0, "failed": 0, "skipped": 0}, [], False
    for part in parts:
        one = _junit(part.results) or _verbose_log(os.path.join(
            os.path.dirname(part.results), part.name + ".log"))
        if one is None:
            continue
        found = True
        for key in counts:
            counts[key] += one[key]
        failures += one["failures"]
    return {**counts, "failures": failures} if found else None


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


VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)")


def _verbose_log(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for match in filter(None, map(VERBOSE_LINE.match, lines)):
        outcome = {"ERROR": "failed"}.get(match[2], match[2].lower())
        counts[outcome] += 1
        if outcome == "failed":
            failures.append(f"{match[1]}: (the part was stopped before its summary)")
    return {**counts, "failures": failures}


def _measurements(report: dict) -> list:
    return [bench_e2e.Measurement(**m) for m in report["e2e"]["results"]]


def targets(report: dict) -> list[str]:
    """PASS/FAIL per target of the issue that this run measured (and the optimizer's, which
    optimizer_step checked itself)."""
    lines = [t for size in (report["optimizer"] or {}).get("sizes", [])
             for t in size.get("targets", [])]
    lines += float8_gpu.targets(report["float8"])
    by = {(m.model, m.dtype, m.recipe): m for m in _measurements(report) if m.step_ms}
    for (model, dtype, recipe), m in sorted(by.items()):
        base = by.get((model, dtype, "compile"))
        if recipe.startswith("fxamp") and base:
            lines += _e2e_targets(f"{model} {dtype} {recipe}", m, base,
                                  by.get((model, dtype, "ceiling")))
    return lines


def _e2e_targets(name: str, m, base, ceiling=None) -> list[str]:
    bound = 0.85 if m.recipe == "fxamp-O2" else 1.0
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
    if ceiling is not None and m.recipe == "fxamp-O2":
        # what mixed precision costs over the 16-bit model without masters or loss scaling
        share = ceiling.step_ms / m.step_ms  # the ceiling's step time over fxamp's: tokens/s
        lines.append(f"{'PASS' if share >= 0.97 else 'FAIL'}  {name}: throughput >= 0.97x the "
                     f"ceiling's: {share:.2f}")
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
    for part in (p for s in report["stages"] for p in s["parts"] if p["last_lines"]):
        lines += ["", f"{part['name']} ({part['status']}), the end of {part['log']}:", "```",
                  *part["last_lines"], "```"]
    lines += ["", *_tests_lines(report["tests"]), "", *_optimizer_lines(report["optimizer"]),
              "", *_e2e_lines(report), "", *_float8_lines(report["float8"]), "", "Targets:",
              "", "```", *report["targets"], "```"]
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


def _float8_lines(results: dict) -> list[str]:
    if not results:
        return ["Float8 and the whole stack: no results (see the float8-*.log and "
                "whole-stack*.log files)."]
    lines = ["Float8 (O2-style bf16 weights, torch.optim.AdamW; tensorwise) and the whole stack "
             "(benchmarks/float8_gpu.py):", "",
             "| model | mode | tokens/s | steps | peak (GiB) | final loss |",
             "|---|---|---:|---:|---:|---:|"]
    for model, modes in results.items():
        for mode, r in modes.items():
            if "seconds" not in r:
                lines.append(f"| {model} | {mode} | {r.get('skipped', '?')} | | | |")
                continue
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            tps = r["steps"] * r["tokens_per_step"] / r["seconds"]
            lines.append(f"| {model} | {mode} | {tps:.0f} | {r['steps']} | {peak} | "
                         f"{r['final_loss']:.4f} |")
    profiled = [(model, mode, r["kernels"]) for model, modes in results.items()
                for mode, r in modes.items() if r.get("kernels")]
    if profiled:
        lines += ["", "Where a training step's time goes (one profiled step, the slowest kernels "
                      "by name):", "", "| model | mode | kernel | calls | us |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {model} | {mode} | `{k['name'][:90]}` | {k['calls']} | {k['us']:.0f} |"
                  for model, mode, kernels in profiled for k in kernels]
    return lines


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
