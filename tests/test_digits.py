"""Convergence on real data: the digits script's short form (the README demo's), run as in CI.

`python -m examples.digits --short` trains a small CNN on scikit-learn's digits at O0 and at
O1/O2/O3 in fp16 and bf16, from the same weights on the same batches. Held here: O1 and O2 end
within SHORT.tolerance (0.6 accuracy points: two of the 360 test images) of O0; O3, Apex's
pure-16-bit speed baseline, is only required to train (Note [What O3 does to a conv bias before
BatchNorm] in examples/digits.py). Measured at seed 0: O1/O2 0.00 to +0.28 points from O0;
over seeds 0-5, -0.56 to +0.28 (Note [Tolerances against O0], docs/convergence.md).

The runs compile with compiler="aot_eager" (the same graphs, without Inductor's per-run compile,
~10 s per opt level and dtype on 2 cores): the README demo runs the same script through Inductor.
"""

import pytest
import torch

from examples import digits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits") / "digits.png"
    results = digits.main(["--short", "--compiler", "aot_eager", "--no-progress",
                           "--plot", str(path)])
    return {r.run: r for r in results}, path


def test_mixed_precision_lands_within_tolerance_of_o0(run):
    results, _ = run
    assert list(results) == list(digits.RUNS)
    assert digits.out_of_tolerance(list(results.values()), digits.SHORT.tolerance) == []
    assert results["O0"].test_accuracy > 95.0  # the CNN learned digits at all


@pytest.mark.parametrize("name", digits.RUNS)
def test_every_run_trains(run, name):
    result = run[0][name]
    first_epoch = result.losses[:result.steps_per_epoch].mean().item()
    assert torch.isfinite(result.losses).all()
    assert result.final_loss < 0.5 * first_epoch, (result.final_loss, first_epoch)


def test_dynamic_scale_backs_off_on_fp16_overflow_only(run):
    # Note [Why the loss scale starts at 2**24 and grows every 100 steps] in examples/digits.py
    results, _ = run
    for name in ("O1-fp16", "O2-fp16"):
        r = results[name]
        assert r.skipped.any() and r.scales[-1] < 2.0**24, name
        assert torch.equal(r.scales[1:][r.skipped[:-1]], r.scales[:-1][r.skipped[:-1]] / 2)
    for name in ("O1-bf16", "O2-bf16"):
        assert not results[name].skipped.any() and results[name].scales[-1] == 2.0**24, name
    for name in ("O0", "O3-fp16", "O3-bf16"):  # static scale 1 (Apex's O0 and O3 presets)
        assert (results[name].scales == 1).all(), name


def test_table_and_plot(run, capsys):
    results, path = run
    table = digits.table(list(results.values()))
    assert table.count("\n") == 1 + len(digits.RUNS)
    assert "| O2-fp16 |" in table
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
