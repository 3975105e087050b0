"""The judge itself can fail: hand-made runs that lose a gradient, run in fp32, change an fp64
output or stray from fp32 further than K x autocast are rejected (no compiler involved)."""

import dataclasses

import pytest
import torch

from . import harness

BF16 = torch.bfloat16


def _run(loss=1.0, grad=(1.0, 2.0, 3.0), out_dtype=torch.float32, buffers=None):
    grads = {"w": None if grad is None else torch.tensor(grad, dtype=torch.float64)}
    return harness.Run(None, loss, [torch.zeros(2, dtype=out_dtype)], grads, buffers or {}, [])


REF = _run()
PEER = _run(loss=1.01, grad=(1.0, 2.0, 3.03))  # autocast: 1 % off


def test_accepts_autocast_sized_errors():
    errors = harness.compare(_run(loss=1.015, grad=(1.0, 2.0, 3.04)), PEER, REF, "O1", BF16)
    assert errors["fxamp"]["loss"] == pytest.approx(0.015)


def test_rejects_more_than_k_times_autocast():
    with pytest.raises(AssertionError, match="further from fp32 than autocast"):
        harness.compare(_run(loss=1.04), PEER, REF, "O1", BF16)  # 4x autocast's loss error


def test_k_grows_with_the_level():
    harness.compare(_run(loss=1.04), PEER, REF, "O3", BF16)


def test_rejects_a_lost_gradient():
    with pytest.raises(AssertionError, match=r"lost the gradient of \['w'\]"):
        harness.compare(_run(grad=None), PEER, REF, "O2", BF16)


def test_rejects_a_silent_fp32_run():
    with pytest.raises(AssertionError, match="ran without mixed precision"):
        harness.compare(_run(), PEER, REF, "O1", BF16)


def test_rejects_a_changed_fp64_output():
    ref, peer = _run(out_dtype=torch.float64), _run(loss=1.01, out_dtype=torch.float64)
    with pytest.raises(AssertionError, match="must stay untouched"):
        harness.compare(_run(loss=1.01, out_dtype=torch.float32), peer, ref, "O1", BF16)


def test_rejects_a_wrong_buffer():
    buffers = lambda v: {"ema": torch.tensor([v, 1.0], dtype=torch.float64)}
    ref = dataclasses.replace(REF, buffers=buffers(1.0))
    peer = dataclasses.replace(PEER, buffers=buffers(1.01))
    with pytest.raises(AssertionError, match="buffers"):
        harness.compare(dataclasses.replace(PEER, buffers=buffers(2.0)), peer, ref, "O2", BF16)


def test_noise_gradients_are_not_judged():
    # fp32's gradient of 1e-13 next to ones of ~1 is rounding noise (BERT's key bias).
    grads = {"w": torch.ones(3, dtype=torch.float64), "k": torch.full((3,), 1e-13,
                                                                       dtype=torch.float64)}
    assert list(harness._informative(grads)) == ["w"]
