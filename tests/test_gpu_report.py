"""The GPU report command (benchmarks/gpu_report.py): its CPU smoke mode runs every stage the GPU
run does, in order, and writes the JSON, the markdown and the archive; the stages share the
budget (Note [Shares of the time left]); a part past its cap is killed and recorded, and the next
stage runs; the `run` call that docs/benchmarks.md gives is one the device tool accepts."""

import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_report, gpu_stages

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# A minute on a quiet machine; CI runs this file's slow tests on the 2.11.0 leg, the GPUs' torch.
@pytest.mark.slow
def test_smoke_runs_every_stage_and_writes_the_report(tmp_path):
    done = subprocess.run([PY, "-m", "benchmarks.gpu_report", "--smoke", "--out",
                           str(tmp_path / "out"), "--archive", str(tmp_path / "OUT" / "r.tar.gz")],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert [s["name"] for s in report["stages"]] == list(gpu_report.ORDER)  # priority order
    assert {p["name"]: p["status"] for s in report["stages"] for p in s["parts"]} == {
        "float8-llama1b": "ok", "whole-stack": "ok", "optimizer": "ok", "tests-gpu": "ok",
        "float8-gpt2-bf16+fxamp-f8": "ok", "float8-gpt2-torchao-f8+fxamp-f8-delay": "ok",
        "e2e-gpt2-bf16": "ok", "e2e-resnet-bf16": "ok"}
    tests = report["tests"]  # no CUDA here: every GPU test collected, and skipped
    assert tests["skipped"] >= 4 and tests["passed"] == tests["failed"] == 0
    size = report["optimizer"]["sizes"][0]
    rows = size["rows"]["O2"]
    # The fxamp state formats always; torchao's 8-bit AdamW only where torchao imports.
    assert set(rows) - {"torchao AdamW8bit"} == {
        "fxamp", "fxamp+clip", "fused+GS", "eager O2", "fxamp low_memory",
        "fxamp compensated", "fxamp stochastic+int8"}
    assert len({r["group"] for r in rows.values()}) >= 2  # the smoke's budget forces groups
    timed = {(m["model"], m["recipe"]): m for m in report["e2e"]["results"]}
    assert set(timed) == {(model, recipe) for model in ("gpt2", "resnet")
                          for recipe in ("eager", "compile", "ceiling", "fxamp-O2")}
    assert all(m["step_ms"] > 0 and m["throughput"] > 0 for m in timed.values())
    assert timed[("gpt2", "fxamp-O2")]["breakdown"]["fxamp_s"] > 0
    assert all(r["kernel_list"] and r["ready_s"] > 0 for r in rows.values())
    float8 = report["float8"]
    ran = {m for m, r in float8["gpt2"].items() if "seconds" in r}
    assert {"bf16", "fxamp-f8", "fxamp-f8-delay"} <= ran
    llama = {m for m, r in float8["llama1b"].items() if "seconds" in r}
    assert {"fxamp-f8", "compile-autocast", "whole-stack"} <= llama
    assert all(float8["llama1b"][m]["kernels"] for m in llama)  # the profiled step
    if _imports("torchao"):
        assert {"torchao-f8"} <= ran & llama and "torchao AdamW8bit" in rows
    markdown = (tmp_path / "out" / "gpu_report.md").read_text()
    for heading in ("| stage | status |", "CUDA tests", "| O2 (bfloat16) | fxamp |",
                    "fxamp's kernels in one profiled step", "| gpt2 | bf16 | fxamp-O2 |",
                    "Dynamo capture", "| gpt2 | fxamp-f8 |", "| llama1b | whole-stack |",
                    "Where a training step's time goes", "Targets:", "fxamp-f8 / bf16",
                    "llama1b whole stack: tokens/s vs compile-autocast"):
        assert heading in markdown
    assert (tmp_path / "OUT" / "gpu_report.md").read_text() == markdown
    with tarfile.open(tmp_path / "OUT" / "r.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_report/gpu_report.json", "gpu_report/optimizer.log",
            "gpu_report/float8-llama1b.json", "gpu_report/whole-stack.json"} <= names
    assert sorted(p.name for p in (tmp_path / "OUT").iterdir()) == ["gpu_report.md", "r.tar.gz"]


def _imports(name: str) -> bool:
    try:
        __import__(name)
    except Exception:
        return False
    return True


def _part(name, code):
    return gpu_stages.Part(name, [PY, "-c", code])


def test_a_part_past_its_cap_is_killed_and_the_next_stage_runs(tmp_path):
    stages = [gpu_stages.Stage("slow", [_part("sleeper", "import time; time.sleep(60)"),
                                        _part("quick", "print('done')")], share=1.0),
              gpu_stages.Stage("broken", [_part("fails", "raise SystemExit(3)")], share=1.0),
              gpu_stages.Stage("last", [_part("last", "print('ran')")], share=1.0)]
    start = time.monotonic()
    gpu_stages.run(stages, str(tmp_path), budget_s=6.0, root=str(ROOT))
    slow, broken, last = stages
    assert time.monotonic() - start < 30 and slow.cap_s == pytest.approx(2.0, abs=0.5)
    assert slow.parts[0].status.startswith("over cap (2 s)")
    assert slow.parts[1].status == "ok" and (tmp_path / "quick.log").read_text() == "done\n"
    assert broken.status == "fails: failed (exit 3)"
    assert last.status == "ok" and (tmp_path / "last.log").read_text() == "ran\n"


def test_a_stage_gets_its_share_of_what_is_left_and_is_skipped_below_its_minimum(tmp_path):
    # Note [Shares of the time left]: a quick first stage leaves its time to the others; the
    # last needs more than its share of what is left and is skipped.
    seen = []
    stages = [gpu_stages.Stage("a", [_part("a", "pass")], share=0.5),
              gpu_stages.Stage("b", [_part("b", "import os; print(os.environ["
                                                 "'FXAMP_REPORT_DEADLINE'])")], share=0.25),
              gpu_stages.Stage("c", [_part("c", "pass")], share=0.25, min_s=1000)]
    gpu_stages.run(stages, str(tmp_path), budget_s=100.0, root=str(ROOT),
                   after_stage=lambda s: seen.append([x.status for x in s]))
    a, b, c = stages
    assert a.cap_s == pytest.approx(50, abs=1) and b.cap_s > 45  # half of the ~100 s left
    deadline = float((tmp_path / "b.log").read_text())  # the part learns its cap
    assert time.time() < deadline < time.time() + b.cap_s
    assert c.status.startswith("skipped") and c.parts[0].status == "skipped"
    assert seen[0] == ["ok", "not started", "not started"] and len(seen) == 3


def test_the_stages_after_the_first_tier_get_what_it_left(tmp_path):
    # Note [Shares of the time left]: the first tier shares the budget among itself (the later
    # stages' shares do not shrink it); a later stage gets all that is left, or is skipped.
    stages = [gpu_stages.Stage("new", [_part("new", "pass")], share=0.5),
              gpu_stages.Stage("again", [_part("again", "pass")], share=0.5, first=False),
              gpu_stages.Stage("too-big", [_part("too-big", "pass")], share=0.5, min_s=1000,
                               first=False),
              gpu_stages.Stage("last", [_part("last", "pass")], share=0.1, first=False)]
    gpu_stages.run(stages, str(tmp_path), budget_s=100.0, root=str(ROOT))
    new, again, too_big, last = stages
    assert new.cap_s == pytest.approx(100, abs=1) and new.status == "ok"
    assert again.cap_s == pytest.approx(100 - new.wall_s, abs=1) and again.status == "ok"
    assert too_big.status.startswith("skipped") and last.status == "ok"


def test_the_report_measures_first_what_no_report_has_measured():
    # Note [Measured first]: the default order, and `--stages` keeps the order given.
    stages = gpu_report.plan("/tmp/unused", smoke=False)
    assert [s.name for s in stages] == list(gpu_report.ORDER)
    assert [s.name for s in stages if s.first] == list(gpu_report.FIRST)
    assert list(gpu_report.FIRST) == list(gpu_report.ORDER[:len(gpu_report.FIRST)])
    assert {"float8-llama1b", "whole-stack"} <= set(gpu_report.FIRST)
    chosen = gpu_report.plan("/tmp/unused", smoke=False, names=["e2e-resnet", "tests"])
    assert [(s.name, s.first) for s in chosen] == [("e2e-resnet", True), ("tests", True)]


def test_gpt2s_conv1d_become_the_same_linear_layers():
    import transformers

    from benchmarks import float8_gpu

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0)).eval()
    ids = torch.randint(0, 64, (2, 16))
    expected = model(input_ids=ids).logits
    float8_gpu.as_linear(model)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 4 + 1  # + lm_head
    assert not any(type(m).__name__ == "Conv1D" for m in model.modules())
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


def _documented_call() -> dict:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    block = re.search(r"<!-- run-call -->\n```json\n(.*?)\n```", text, re.S)
    assert block, "docs/benchmarks.md lost its run call"
    return json.loads(block[1])


def test_the_documented_run_call_fits_the_device_tool():
    call = _documented_call()
    assert len(call["command"]) <= 2000 and call["timeout_s"] <= 600
    assert len(call["carry"]) <= 8 and all(len(p) <= 200 for p in call["carry"])
    ignored = (ROOT / ".gitignore").read_text().split()
    assert all(f"/{p}/" in ignored for p in call["carry"])  # carried: ignored, not tracked
    report = re.search(r"python3 -m benchmarks\.gpu_report ([^;&|]*)", call["command"])
    argv = report[1].replace("$OUT", "/tmp/out").split()
    assert "--smoke" not in argv and "--archive" in argv
    budget = float(argv[argv.index("--budget") + 1])
    assert budget <= 480 and budget + 60 <= call["timeout_s"]  # room to install and pack


def test_the_cuda_autocast_lists_build_here():
    # tests/gpu/test_cuda_parity.py builds its cases from torch's CUDA lists at import, on the
    # GPU: the lists module imports on this torch (without expecttest where it is missing) and
    # the CUDA list's entries become cases (built here from CPU tensors).
    from autocast_lists import cases, torch_lists

    torch_lists("cpu")
    from torch.testing._internal import autocast_test_lists as lists

    assert len(cases(lists.AutocastTestLists(torch.device("cpu")))) > 100


def test_a_failed_parts_last_log_lines_are_in_the_report(tmp_path):
    from benchmarks import report_md

    part = gpu_stages.Part("broken", [PY, "-c", "print('first'); raise SystemExit('the why')"],
                           results=str(tmp_path / "broken.json"))
    stage = gpu_stages.Stage("tests", [part], share=1.0)
    gpu_stages.run([stage], str(tmp_path), budget_s=60.0, root=str(ROOT))
    report = report_md.collect([stage], "cmd", time.time(), time.time())
    assert report["stages"][0]["parts"][0]["last_lines"] == ["first", "the why"]
    assert "broken (failed (exit 1)), the end of broken.log:" in report_md.render(report)
