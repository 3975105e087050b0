"""Inf and NaN in one gradient element: the compiled step is skipped on the device, leaving the
model parameters, masters, moments and the step count bit-identical, and the scale moves by the
chosen semantics; then it grows back after the growth interval, within the min/max clamps."""

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot, train

import fxamp.optim as fo

INF, NAN = float("inf"), float("nan")


def _bad_step(model, opt, scaler, step, value):
    opt.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    model[0].weight.grad[0, 0] = value
    opt.step(scaler)


@pytest.mark.parametrize("value", [INF, NAN], ids=["inf", "nan"])
@pytest.mark.parametrize("semantics", ["apex", "torch", "deepspeed"])
def test_overflow_skips_bit_identically_and_backs_off(semantics, value):
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model.parameters(), lr=1e-2)
    scaler = fo.LossScaler(semantics=semantics, growth_interval=3)
    train(model, opt, 4, scaler)
    before, scale = snapshot(opt), scaler.get_scale()
    _bad_step(model, opt, scaler, 4, value)
    assert opt.last_step_skipped() and opt.found_inf.dtype == torch.bool
    assert bit_identical(snapshot(opt), before)
    # DeepSpeed's hysteresis (2) absorbs the first overflow; the others halve at once.
    assert scaler.get_scale() == (scale if semantics == "deepspeed" else scale / 2)
    train(model, opt, 1, scaler, start=5)
    assert not opt.last_step_skipped() and not bit_identical(snapshot(opt), before)


def test_skip_with_clipping_and_sgd_momentum():
    model = make_mlp(torch.bfloat16)
    opt = fo.SGD(model.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.5)
    scaler = fo.LossScaler()
    train(model, opt, 2, scaler)
    before = snapshot(opt)
    _bad_step(model, opt, scaler, 2, NAN)
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)
    assert torch.isnan(opt.grad_norm)


def test_skipped_first_step_leaves_fresh_state():
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-2)
    scaler = fo.LossScaler()
    before = snapshot(opt)
    _bad_step(model, opt, scaler, 0, INF)
    assert bit_identical(snapshot(opt), before) and opt.step_counts.item() == 0


def test_scale_grows_after_the_window_within_min_and_max():
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model.parameters(), lr=1e-3)
    scaler = fo.LossScaler(min_loss_scale=2.0**15, max_loss_scale=2.0**16, growth_interval=2)
    scales = []
    for step in range(3):
        _bad_step(model, opt, scaler, step, INF)
        scales.append(scaler.get_scale())
    for step in range(3, 9):
        train(model, opt, 1, scaler, start=step)
        scales.append(scaler.get_scale())
    assert scales == [2.0**15] * 4 + [2.0**16] * 5  # floored, grown after 2 clean, capped
