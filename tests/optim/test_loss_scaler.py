"""LossScaler against transcriptions of Apex's and DeepSpeed's update rules and torch's own
`_amp_update_scale_` kernel, step by step over random overflow sequences; state-dict formats."""

import io
import random

import pytest
import torch

from fxamp.errors import ConfigError
from fxamp.optim import LossScaler


class ApexScaler:
    """Apex amp's LossScaler.update_scale (apex.amp.scaler), transcribed."""

    def __init__(self, init=2.0**16, window=2000, min_scale=None, max_scale=2.0**24):
        self.scale, self.unskipped = min(max_scale, init), 0
        self.window, self.min, self.max = window, min_scale, max_scale

    def update(self, overflow):
        if overflow:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0


class DeepSpeedScaler:
    """deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale, transcribed
    (raise_error_at_min_scale=False)."""

    def __init__(self, init=2.0**16, window=1000, min_scale=1.0, delayed_shift=2,
                 consecutive=False):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init, 0, -1
        self.scale_window, self.min_scale = window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive

    def update(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1
        return self.cur_scale


def _overflows(seed, n=300, p=0.3):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def _step(scaler, overflow):
    scaler.update(torch.tensor(overflow))
    return scaler.get_scale()


@pytest.mark.parametrize("min_scale,max_scale", [(2.0**-24, 2.0**24), (2.0**14, 2.0**17)])
def test_apex_rule_matches_apex(min_scale, max_scale):
    ours = LossScaler(semantics="apex", growth_interval=3, min_loss_scale=min_scale,
                      max_loss_scale=max_scale, compile=False)
    ref = ApexScaler(window=3, min_scale=min_scale, max_scale=max_scale)
    for overflow in _overflows(0):
        ref.update(overflow)
        assert _step(ours, overflow) == ref.scale
        assert ours.state_dict()["_growth_tracker"] == ref.unskipped


def test_apex_floor_and_cap_hold():
    scaler = LossScaler(min_loss_scale=2.0**10, max_loss_scale=2.0**18, growth_interval=2,
                        compile=False)
    assert [_step(scaler, True) for _ in range(8)][-1] == 2.0**10
    assert [_step(scaler, False) for _ in range(40)][-1] == 2.0**18
    assert LossScaler(max_loss_scale=2.0**12).get_scale() == 2.0**12  # Apex caps the start


def test_torch_rule_matches_amp_update_scale_kernel():
    ours = LossScaler(semantics="torch", growth_interval=3, init_scale=2.0**120, compile=False)
    scale, tracker = torch.tensor(2.0**120), torch.tensor(0, dtype=torch.int32)
    for overflow in _overflows(1, p=0.2):
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5, 3)
        assert _step(ours, overflow) == scale.item()  # no cap; growth stops short of inf
        assert ours.state_dict()["_growth_tracker"] == tracker.item()
    assert max(ours.get_scale(), scale.item()) < float("inf")


@pytest.mark.parametrize("consecutive", [False, True])
def test_deepspeed_hysteresis_matches_deepspeed(consecutive):
    ours = LossScaler(semantics="deepspeed", growth_interval=4, hysteresis=3, min_loss_scale=4.0,
                      consecutive_hysteresis=consecutive, compile=False)
    ref = DeepSpeedScaler(window=4, min_scale=4.0, delayed_shift=3, consecutive=consecutive)
    for overflow in _overflows(2, p=0.35):
        assert _step(ours, overflow) == ref.update(overflow)


def test_deepspeed_defaults_need_two_overflows_to_back_off():
    scaler = LossScaler(semantics="deepspeed", compile=False)
    assert [_step(scaler, True) for _ in range(3)] == [2.0**16, 2.0**15, 2.0**14]


class HysteresisKernel:
    """apex csrc/update_scale_hysteresis.cu (amp_C.update_scale_hysteresis), transcribed: the
    kernel DeepSpeed-style hysteresis runs on; any growth_factor, growth only to a finite fp32."""

    def __init__(self, init, growth_factor, window, hysteresis):
        self.scale, self.tracker, self.left = init, 0, hysteresis
        self.factor, self.window, self.hysteresis = growth_factor, window, hysteresis

    def update(self, overflow):
        if overflow:
            self.left -= 1
            if self.left > 0:
                self.tracker = 0
                return self.scale
            self.scale, self.tracker = self.scale * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == self.window:
                grown = float(torch.tensor(self.scale * self.factor, dtype=torch.float32))
                self.scale = grown if grown != float("inf") else self.scale
                self.tracker = 0
            self.left = self.hysteresis
        return self.scale


@pytest.mark.parametrize("growth_factor", [1.0, 2.0])
def test_hysteresis_matches_the_amp_c_kernel_up_to_the_fp32_top(growth_factor):
    # Issue 12 item 10: growth_factor=1.0 is accepted, and no growth reaches inf.
    ours = LossScaler(semantics="deepspeed", init_scale=2.0**120, growth_factor=growth_factor,
                      growth_interval=2, hysteresis=2, consecutive_hysteresis=True,
                      min_loss_scale=2.0**-24, compile=False)
    ref = HysteresisKernel(2.0**120, growth_factor, window=2, hysteresis=2)
    for overflow in [False] * 30 + _overflows(3, p=0.3):
        assert _step(ours, overflow) == ref.update(overflow)


def test_deepspeed_never_grows_to_inf_and_comes_down_after_overflows():
    scaler = LossScaler(semantics="deepspeed", init_scale=2.0**126, growth_interval=1,
                        compile=False)
    assert [_step(scaler, False) for _ in range(3)] == [2.0**127] * 3  # 2**128 is inf in fp32
    assert [_step(scaler, True) for _ in range(3)] == [2.0**127, 2.0**126, 2.0**125]


def test_static_scale_never_moves():
    scaler = LossScaler(128.0, compile=False)
    assert [_step(scaler, o) for o in (True, False, True)] == [128.0] * 3
    assert LossScaler("256").get_scale() == 256.0


def test_scale_multiplies_on_the_device():
    scaler = LossScaler(compile=False)
    loss = torch.tensor(3.0, dtype=torch.bfloat16, requires_grad=True)
    scaled = scaler.scale(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2**16
    assert scaler.scale_tensor.shape == () and scaler.scale_tensor.device == loss.device


def test_state_dict_round_trips_through_weights_only_load():
    scaler = LossScaler(growth_interval=5, compile=False)
    for overflow in (True, False, False):
        scaler.update(torch.tensor(overflow))
    buf = io.BytesIO()
    torch.save(scaler.state_dict(), buf)
    buf.seek(0)
    fresh = LossScaler(compile=False)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh.state_dict() == scaler.state_dict()


def test_loads_gradscaler_state_dict():
    gs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    gs.scale(torch.ones(()))
    gs._growth_tracker.fill_(3)
    ours = LossScaler(semantics="torch", compile=False)
    ours.load_state_dict(gs.state_dict())
    assert ours.get_scale() == 1024.0 and ours.rule.growth_interval == 7
    assert ours.state_dict()["_growth_tracker"] == 3


def test_loads_apex_state_dict():
    ours = LossScaler(compile=False)
    ours.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 17}})
    assert ours.get_scale() == 512.0 and ours.state_dict()["_growth_tracker"] == 17
    two = {f"loss_scaler{i}": {"loss_scale": 1.0, "unskipped": 0} for i in range(2)}
    with pytest.raises(ConfigError, match="holds 2 loss scalers"):
        ours.load_state_dict(two)


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_scale="auto"), "loss_scale='auto' must be a positive number, a numeric string"),
    (dict(loss_scale=-1.0), "positive finite"),
    (dict(semantics="apx"), "is not one of apex, torch, deepspeed"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "exceeds max_loss_scale"),
    (dict(growth_factor=0.5), "growth_factor=0.5 must be a finite number >= 1"),
    (dict(growth_factor=float("inf")), "growth_factor=inf must be a finite number >= 1"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LossScaler(**kwargs)
