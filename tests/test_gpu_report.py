"""The GPU report command: its CPU smoke mode runs every stage the GPU run does (the tests, the
optimizer benchmark, one end-to-end process per model) and writes the JSON and the markdown;
a stage past its cap is killed and recorded, not lost."""

import json
import subprocess
import sys

from benchmarks import gpu_report


def test_smoke_runs_every_stage_and_writes_the_report(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_report", "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert {s["name"]: s["status"] for s in report["stages"]} == {
        "tests": "ok", "optimizer": "ok", "e2e-gpt2-bf16": "ok", "e2e-resnet-bf16": "ok"}
    tests = report["tests"]  # no CUDA here: every GPU test collected, and skipped
    assert tests["skipped"] >= 4 and tests["passed"] == tests["failed"] == 0
    rows = report["optimizer"]["sizes"][0]["rows"]["O2"]
    # The fxamp state formats always; torchao's 8-bit AdamW only where torchao imports.
    assert set(rows) - {"torchao AdamW8bit"} == {
        "fxamp", "fxamp+clip", "fused+GS", "eager O2", "fxamp low_memory",
        "fxamp compensated", "fxamp stochastic+int8"}
    timed = {(m["model"], m["recipe"]): m for m in report["e2e"]["results"]}
    assert set(timed) == {(model, recipe) for model in ("gpt2", "resnet")
                          for recipe in ("eager", "compile", "fxamp-O2")}
    assert all(m["step_ms"] > 0 and m["throughput"] > 0 for m in timed.values())
    assert timed[("gpt2", "fxamp-O2")]["breakdown"]["fxamp_s"] > 0
    markdown = (tmp_path / "gpu_report.md").read_text()
    for heading in ("| stage | status |", "CUDA tests", "| O2 (bfloat16) | fxamp |",
                    "| gpt2 | bf16 | fxamp-O2 |", "Dynamo capture", "Targets:"):
        assert heading in markdown


def test_a_stage_past_its_cap_is_killed_and_recorded(tmp_path):
    sleeper = gpu_report.Stage("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                               cap_s=1.0)
    quick = gpu_report.Stage("quick", [sys.executable, "-c", "print('done')"], cap_s=30.0,
                             shared_lock=True)
    gpu_report.run([sleeper, quick], str(tmp_path))
    assert sleeper.status.startswith("over cap (1 s)") and sleeper.wall_s < 30
    assert quick.status == "ok" and (tmp_path / "quick.log").read_text() == "done\n"
