"""The examples run as a user runs them (`python -m examples.NAME`) and print what they promise.

examples/digits.py and examples/distributed.py have tests of their own (test_digits.py,
distributed/); the README's demo runs here in full, as the README gives it, in the slow tier
(`-m slow`, which CI runs on one leg) with the optimizer demo: each trains for a minute, and
every API they call is under test in the default tier.
"""

import os
import subprocess
import sys

import pytest
import torch

import fxamp
from fxamp.float8.config import recipe_refusal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, *args):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_LOGS", None)
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_opt_levels_explains_every_level():
    out = _run("examples.opt_levels")
    for model in ("attention", "cnn"):
        for level in ("O0", "O1", "O2", "O3"):
            assert f"######## {model} at {level} ########" in out
    assert "graphs: 1 | graph breaks: 0 | casts inserted: 2 (+2 at the model boundary) | " \
           "ops kept in fp32: 1" in out  # the CNN at O2: BatchNorm kept in fp32


@pytest.mark.slow  # ~40 s quiet: trains, checkpoints and resumes in a subprocess
def test_optimizer_demo_trains_skips_and_resumes():
    out = _run("examples.optimizer_demo", "--epochs", "1")
    assert "weights torch.bfloat16, masters torch.float32" in out
    assert "resumed from a checkpoint: next step bit-identical: True" in out
    assert "== Apex-style: initialize + scale_loss ==" in out


def test_debug_overflow_names_the_planted_op_and_its_fix():
    out = _run("examples.debug_overflow")
    assert "forward: aten.matmul.default in attn (Attention)" in out
    assert "module_overrides={'attn': 'fp32'}" in out
    assert "no op produced an inf or NaN" in out


@pytest.mark.slow  # ~70 s quiet: the README's demo in full, as the README runs it
def test_readme_demo_as_the_readme_runs_it():
    out = _run("examples.demo")
    assert "==== what fxamp O2 does to the CNN (bf16) ====" in out
    assert "keep_batchnorm_fp32" in out
    assert "O1/O2 within 0.6 accuracy points of O0" in out


def test_planner_example_plans_saves_applies_and_explains():
    out = _run("examples.planner")
    assert "float8: 1 of 3 GEMMs | modeled GEMM time of a training step on h100" in out
    assert "loaded plan equal: True" in out
    # torch 2.11 runs no row-scaled float8 GEMM on CPU: its plan is tensorwise, and says why
    # (Note [A recipe this device cannot run is not measured])
    rowwise = recipe_refusal("rowwise", "cpu", torch.bfloat16) is None
    recipe, error = ("rowwise", "1") if rowwise else ("tensorwise", "0.999")
    assert (f"skip_modules '2'; stays bf16; plan: bf16: the float8 {recipe} error of its output, "
            f"{error}, exceeds the budget 0.1") in out
    assert rowwise or f"float8 rowwise was not measured: torch {torch.__version__} " in out
    assert "step 2: loss" in out


@pytest.mark.slow
def test_healing_promotes_the_planted_op_and_lands_near_fp32():
    out = _run("examples.healing")
    assert "fp16 O1               loss nan, 300/300 steps skipped" in out
    assert "promoted module 'blocks.0.attn.scores' to fp32 at step 4" in out
    healed = next(line for line in out.splitlines() if line.startswith("fp16 O1 + fxamp.Healer"))
    assert float(healed.split(", ")[-1].split("%")[0]) < 1.0


def test_viewer_example_saves_both_views(tmp_path):
    out = _run("examples.viewer", "--save-only")
    assert "fxamp O1 | dtype bf16 | policy torch-cpu | device cpu" in out
    assert "forward: aten.matmul.default in attn (Attention), graph 0" in out
    for name in ("gpt2", "planted_overflow"):
        view = fxamp.viewer.GraphView.load(os.path.join(ROOT, "out", f"{name}.fxamp.json"))
        assert view.graphs[0]["nodes"]


@pytest.mark.slow  # ~60 s quiet: three 100-step runs and two resumed ones
def test_blockscaled_example_trains_near_bf16_and_resumes_bit_exactly():
    # issue 39's targets: after 100 steps MXFP8 within 3 % and NVFP4 within 5 % of bf16's loss
    # (measured 2026-12-03: +0.02 % and +2.18 %, NVFP4 with the Hadamard transform and
    # stochastic rounding), and a resume half way bit-exact
    out = _run("examples.blockscaled")
    gaps = {line.split()[0]: float(line.rsplit("(", 1)[1].split("%")[0])
            for line in out.splitlines() if "vs bf16" in line}
    assert set(gaps) == {"mxfp8", "nvfp4"}
    assert abs(gaps["mxfp8"]) <= 3 and abs(gaps["nvfp4"]) <= 5, out
    assert out.count("weights bit-exact") == 2, out
