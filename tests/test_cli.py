"""`python -m fxamp explain`, run as users run it: in a subprocess from the repository root."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fxamp", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_explain_mlp_o2():
    result = run_cli("explain", "examples.models:mlp", "--opt-level", "O2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("fxamp O2 | dtype bf16 | policy torch-cpu | device cpu\n")
    assert "== forward graph 0 (after fxamp) ==" in out
    assert "fc1_weight: bf16[32,16]" in out  # O2 stores the weights in bf16
    assert "== compute ops ==" in out
    assert "== backward graph" not in out  # only with --backward
    linears = [line for line in out.splitlines() if line.startswith("linear.default")]
    assert len(linears) == 2 and all("-> bf16" in line for line in linears)


@pytest.mark.parametrize("args, message", [
    (["--opt-level", "01"], "opt_level '01' is not one of 'O0', 'O1', 'O2', 'O3' "
                            "(the prefix is the letter O, not the number zero"),
    (["--keep-batchnorm-fp32", "True"], "keep_batchnorm_fp32 cannot be set with O1"),
])
def test_bad_option_exits_2_with_one_line(args, message):
    result = run_cli("explain", "examples.models:mlp", *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"python -m fxamp: error: {message}")
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("target, message", [
    ("examples.models", "TARGET 'examples.models' is not 'package.module:factory'"),
    ("examples.no_such_module:mlp", "cannot import 'examples.no_such_module'"),
    ("examples.models:no_such_factory", "'examples.models' has no callable 'no_such_factory'"),
])
def test_bad_target_exits_2(target, message):
    result = run_cli("explain", target)
    assert result.returncode == 2
    assert result.stderr.startswith(f"python -m fxamp: error: {message}")
    assert len(result.stderr.splitlines()) == 1
