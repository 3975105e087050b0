"""examples/apex_migration.py, Apex's ImageNet-shaped loop after `import fxamp as amp`: its
loss-scale sequence and skipped steps are Apex's dynamic-scaler rule (written out by hand in the
example, fed with the overflows an fp32 run sees), a checkpoint and resume mid-run is
bit-identical, and its final weights are as close to fp32 training as torch.autocast's are."""

import pytest
import torch

from examples import apex_migration as mig

SETTINGS = mig.Settings(steps=24, corrupt=(5, 13), resume_at=12, compiler="aot_eager")


@pytest.fixture(scope="module")
def batches():
    return mig.load(SETTINGS)


@pytest.fixture(scope="module")
def fp32(batches):
    return mig.train_torch(SETTINGS, batches)


def test_apex_rule_by_hand():
    # The example's transcription of Apex's LossScaler.update_scale, on a known sequence.
    assert mig.apex_dynamic_scale([False, True, False, True, True], init_scale=8.0) == \
        [8.0, 8.0, 4.0, 4.0, 2.0]
    assert mig.apex_dynamic_scale([False] * 4, init_scale=8.0, scale_window=2, max_scale=16.0) \
        == [8.0, 8.0, 16.0, 16.0]


@pytest.mark.parametrize("level,dtype", [("O2", "bf16"), ("O2", "fp16"), ("O1", "bf16")])
def test_migrated_loop_follows_apex_and_fp32(batches, fp32, level, dtype):
    settings = mig.Settings(**{**SETTINGS.__dict__, "opt_level": level, "dtype": dtype})
    straight = mig.train(settings, batches)
    assert fp32.skipped == [5, 13]
    assert straight.skipped == fp32.skipped
    assert straight.scales == fp32.scales == [2.0 ** 16] * 6 + [2.0 ** 15] * 8 + [2.0 ** 14] * 10

    resumed = mig.train(settings, batches, resume_at=settings.resume_at)
    assert resumed.scales == straight.scales and resumed.skipped == straight.skipped
    for name, weight in straight.weights.items():
        assert torch.equal(resumed.weights[name], weight), name

    # Tolerance: within 1.5x torch.autocast's own distance from fp32 on the same loop (measured
    # at 40 steps: O2 bf16 1.7e-2 vs 4.1e-2, O2 fp16 3.1e-3 vs 1.1e-2, O1 bf16 equal), and
    # never more than 10 %.
    autocast = mig.train_torch(settings, batches, autocast=mig.DTYPES[dtype])
    error, autocast_error = mig.weight_error(straight, fp32), mig.weight_error(autocast, fp32)
    assert error <= min(1.5 * autocast_error + 1e-3, 0.1), (error, autocast_error)
