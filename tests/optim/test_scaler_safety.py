"""The loss scale can never reach 0 or write NaN into the weights, and a step that forgets the
scaler is refused instead of applying scaled gradients.

Each test here failed on main before the scaler-safety change (2026-11-23): the scale reached
exactly 0 after ~166 overflows and the step at scale 0 wrote NaN; a scale written as 0/nan/inf
was stepped with; `opt.step()` after `scaler.scale(loss).backward()` applied an update 2**16
times too large.
"""

import math

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot, train

import fxamp.optim as fo
from fxamp.errors import ConfigError


def _nan_loss_step(model, opt, scaler, step):
    opt.zero_grad()
    scaler.scale(loss_of(model, step) * float("nan")).backward()
    opt.step(scaler)


@pytest.mark.parametrize("semantics", ["apex", "torch", "deepspeed"])
def test_scale_floor_holds_after_300_overflowing_steps(semantics):
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    scaler = fo.LossScaler(semantics=semantics, compile=False)
    train(model, opt, 2, scaler)
    before = snapshot(opt)
    for step in range(300):
        _nan_loss_step(model, opt, scaler, step)
    assert scaler.get_scale() == 1.0  # the default floor (Note [The scale has a floor])
    assert bit_identical(snapshot(opt), before)  # every one of the 300 steps was skipped
    train(model, opt, 1, scaler, start=300)
    assert not opt.last_step_skipped()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_lower_floor_can_be_asked_for_but_not_none():
    scaler = fo.LossScaler(min_loss_scale=2.0**-24, compile=False)
    for _ in range(60):
        scaler.update(torch.tensor(True))
    assert scaler.get_scale() == 2.0**-24
    with pytest.raises(ConfigError, match=r"min_loss_scale=0 must be a positive finite number "
                                          r"\(the floor of a dynamic scale, 1.0 by default"):
        fo.LossScaler(min_loss_scale=0)


@pytest.mark.parametrize("bad", [0.0, -4.0, float("inf"), float("nan")])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_step_at_a_bad_scale_is_skipped_and_the_scale_restarts_at_the_floor(bad, compile):
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=compile)
    scaler = fo.LossScaler(compile=compile)
    train(model, opt, 2, scaler)
    before = snapshot(opt)
    scaler.scale_tensor.fill_(bad)  # nothing but a hand-written tensor can get here
    train(model, opt, 1, scaler, start=2)
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)
    assert scaler.get_scale() == 1.0
    train(model, opt, 1, scaler, start=3)
    assert not opt.last_step_skipped()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_folded_gradients_at_a_bad_scale_skip_the_step():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    scaler = fo.LossScaler(compile=False)
    before = snapshot(opt)
    scaler.scale_tensor.fill_(0.0)
    scaler.scale(loss_of(model, 0)).backward()
    opt.unscale_(scaler)
    opt.step()
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)


def _scaled_backward(model, scaler, step=0):
    scaler.scale(loss_of(model, step)).backward()


def test_step_without_the_scaler_is_refused_and_changes_nothing():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    scaler = fo.LossScaler(compile=False)
    _scaled_backward(model, scaler)
    before, scale = snapshot(opt), scaler.state_dict()
    with pytest.raises(ConfigError, match=r"SGD.step\(\) was called without a scaler, but the "
                                          r"gradients carry the scale of LossScaler.*scale 65536"
                                          r".*Call step\(scaler\)"):
        opt.step()
    assert bit_identical(snapshot(opt), before) and scaler.state_dict() == scale
    with pytest.raises(ConfigError, match=r"unscale_\(\) was called without a scaler"):
        opt.unscale_()
    opt.step(scaler)  # the fix the message names
    assert not opt.last_step_skipped() and not bit_identical(snapshot(opt), before)


def test_second_optimizer_forgetting_the_shared_scaler_is_refused():
    model = make_mlp()
    opt0 = fo.SGD(model[0].parameters(), lr=0.1, compile=False)
    opt2 = fo.SGD(model[2].parameters(), lr=0.1, compile=False)
    scaler = fo.LossScaler(compile=False)
    _scaled_backward(model, scaler)
    opt0.step(scaler)
    with pytest.raises(ConfigError, match="without a scaler"):
        opt2.step()
    opt2.step(scaler)


def test_steps_without_a_scaler_that_are_right_are_not_refused():
    scaled, plain = make_mlp(), make_mlp(seed=1)
    opt_scaled = fo.SGD(scaled.parameters(), lr=0.1, compile=False)
    opt_plain = fo.SGD(plain.parameters(), lr=0.1, compile=False)
    scaler = fo.LossScaler(compile=False)
    _scaled_backward(scaled, scaler)
    loss_of(plain, 0).backward()
    opt_plain.step()  # another model's unscaled gradients
    opt_scaled.unscale_(scaler)
    opt_scaled.step()  # already unscaled with the scaler, as GradScaler's unscale_ + step
    _scaled_backward(scaled, scaler, 1)
    opt_scaled.zero_grad()  # the scaled gradients are dropped
    loss_of(scaled, 2).backward()
    opt_scaled.step()
    with torch.no_grad():
        fo.LossScaler(compile=False).scale(loss_of(scaled, 3))  # nothing to backpropagate
    loss_of(scaled, 3).backward()
    opt_scaled.step()


def test_a_scaled_loss_that_is_never_backpropagated_is_not_held():
    model = make_mlp()
    scaler = fo.LossScaler(compile=False)
    for step in range(3):
        scaler.scale(loss_of(model, step))  # an evaluation loss, with grad enabled
    assert scaler.scaled_graphs.roots == []
    _scaled_backward(model, scaler)
    assert len(scaler.scaled_graphs.roots) == 1


def test_forgotten_scaler_update_would_have_been_scale_times_too_large():
    # What the refusal prevents: the same SGD step with gradients 2**16 too large.
    model = make_mlp()
    ref = make_mlp()
    opt, ref_opt = (fo.SGD(m.parameters(), lr=0.1, compile=False) for m in (model, ref))
    scaler = fo.LossScaler(compile=False)
    _scaled_backward(model, scaler)
    loss_of(ref, 0).backward()
    opt.step(scaler)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
    assert math.isclose(scaler.get_scale(), 2.0**16)


def test_step_takes_a_loss_scaler_not_a_grad_scaler():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    loss_of(model, 0).backward()
    before = snapshot(opt)
    with pytest.raises(ConfigError, match=r"step\(scaler\) takes an fxamp.optim.LossScaler "
                                          r"\(or nothing\), not GradScaler; build "
                                          r"fxamp.optim.LossScaler\(semantics='torch'\)"):
        opt.step(torch.amp.GradScaler("cpu"))
    assert bit_identical(snapshot(opt), before)
