"""Skipped-step reporting: a device counter, a log line at most once per N steps with the new
loss scale, no host read per step when nobody listens, the locator after K skips in a row."""

import logging
from unittest import mock

import pytest
import torch

import fxamp
from examples import models
from fxamp.debug import SkipMonitor
from fxamp.optim import SGD, FP16_Optimizer, LossScaler

LOGGER = "fxamp.debug.skips"


def _train(model, opt, scaler, steps, bad_steps, x=None):
    x = torch.randn(8, 16) if x is None else x
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(model(x).float().sum()).backward()
        if step in bad_steps:
            with torch.no_grad():
                model.fc1.weight.grad[0, 0] = float("inf")
        opt.step(scaler)


def _setup():
    model, _ = models.mlp()
    return model, SGD(model.parameters(), lr=1e-3, compile=False), LossScaler(compile=False)


def test_counts_skips_and_logs_at_most_once_per_n_steps(caplog):
    model, opt, scaler = _setup()
    monitor = SkipMonitor(opt, every=5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(model, opt, scaler, 20, bad_steps={1, 2, 3, 12})
    assert monitor.skipped_steps == 4 and monitor.steps == 20
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages == [
        "fxamp: 3 of the last 5 optimizer steps skipped for inf/nan gradients (3 of 5 in all); "
        "loss scale now 8192",
        "fxamp: 1 of the last 5 optimizer steps skipped for inf/nan gradients (4 of 15 in all); "
        "loss scale now 4096",
    ]
    monitor.close()
    _train(model, opt, scaler, 1, bad_steps={0})
    assert monitor.steps == 20  # the hook is gone


def test_no_host_read_per_step_unless_someone_listens():
    model, opt, scaler = _setup()
    quiet = logging.getLogger("test_debug_skips.quiet")
    quiet.setLevel(logging.ERROR)
    monitor = SkipMonitor(opt, every=1, logger=quiet)
    with mock.patch.object(SkipMonitor, "_read", side_effect=AssertionError("host read")):
        _train(model, opt, scaler, 6, bad_steps={2, 3})
    assert monitor.skipped_steps == 2  # counted on the device all along
    loud = SkipMonitor(opt, every=3)
    with mock.patch.object(SkipMonitor, "_read") as read:
        _train(model, opt, scaler, 6, bad_steps=set())
    assert read.call_count == 2 and loud.steps == 6


def test_locator_runs_after_k_consecutive_skips(caplog):
    model, (x,) = models.mlp()
    with torch.no_grad():
        model.fc1.weight.mul_(1e5)  # every forward overflows fp16: every step is skipped
    fxamp.compile(model, compiler="aot_eager", dtype=torch.float16)
    opt, scaler = SGD(model.parameters(), lr=1e-3, compile=False), LossScaler(compile=False)
    monitor = SkipMonitor(opt, every=2, locate_after=3, locate=lambda scale:
                          fxamp.locate_overflow(model, x, loss_scale=scale))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _train(model, opt, scaler, 4, bad_steps=set(), x=x)
    assert monitor.skipped_steps == 4 and len(monitor.reports) == 1
    site = monitor.reports[0].site
    assert (site.phase, site.module, site.source_op) == ("forward", "fc1",
                                                         "aten.linear.default")
    assert monitor.reports[0].loss_scale == 2.0**16 / 2**4
    assert any("4 consecutive steps skipped; overflow locator:" in r.getMessage()
               and "fc1" in r.getMessage() for r in caplog.records)


def test_fp16_optimizer_is_updated_by_hand():
    model, _ = models.mlp()
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt = FP16_Optimizer(inner, dynamic_loss_scale=True, compile=False)
    monitor = SkipMonitor(opt, every=1)
    for step in range(3):
        opt.zero_grad()
        opt.backward(model(torch.randn(8, 16)).sum(), update_master_grads=False)
        if step == 1:
            model.fc2.bias.grad[0] = float("nan")
        opt.step()
        monitor.update()
    assert monitor.skipped_steps == 1 and monitor.steps == 3


def test_rejects_what_it_cannot_watch():
    model, _ = models.mlp()
    with pytest.raises(fxamp.ConfigError, match="no device overflow flag"):
        SkipMonitor(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = SGD(model.parameters(), lr=1e-3, compile=False)
    with pytest.raises(fxamp.ConfigError, match="every=0 must be a positive int"):
        SkipMonitor(opt, every=0)
    with pytest.raises(fxamp.ConfigError, match="locate_after=3 needs"):
        SkipMonitor(opt, locate_after=3)
