"""Healing during training (Note [Healing] in fxamp/debug/heal.py): the op that keeps fp16
steps skipping is located, promoted to fp32 and recompiled within the first few skips, the run
then trains like fp32; a model whose skips come from the loss scale alone is never touched;
promotions are bounded and survive a resume; refusals change nothing."""

import copy
import logging
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fxamp
from examples import healing
from fxamp.debug.heal import Healer
from fxamp.errors import ConfigError
from fxamp.model.recompile import recompile

LOGGER = "fxamp.debug.heal"
SCORES = "blocks.0.attn.scores"


def _fp16(model):
    return fxamp.compile(model, compiler="aot_eager", opt_level="O1", dtype=torch.float16)


@pytest.fixture(scope="module")
def runs():
    data, model = healing.batches(32), healing.build()
    plain = healing.train(copy.deepcopy(model), data[:12], fp16=True)
    healed = healing.train(copy.deepcopy(model), data, fp16=True, heal=True, every=4)
    return data, model, plain, healed


def test_without_healing_every_step_is_skipped(runs):
    _, _, (losses, scaler, _), _ = runs
    assert int(scaler.skipped_steps) == len(losses) == 12
    assert all(math.isnan(x) for x in losses)


def test_heals_exactly_the_hostile_module_within_the_first_skips(runs):
    _, _, _, (losses, scaler, healer) = runs
    (p,) = healer.promotions
    assert (p.kind, p.key, p.module, p.module_type) == ("module_overrides", SCORES, SCORES,
                                                        "CosineScores")
    assert (p.phase, p.op, p.step, p.loss_scale) == ("forward", "aten.exp.default", 4, 1.0)
    assert "planted: no max subtracted" in p.source_line
    assert int(scaler.skipped_steps) == 4  # the skips before the read at step 4, none after
    assert all(math.isfinite(x) for x in losses[4:])
    assert fxamp.config_of(healer.model).module_overrides[0] == (SCORES, "fp32")


def test_healed_run_trains_like_fp32_from_the_promotion_on(runs):
    # The four skipped steps changed nothing (AdamW did not step), so the healed run is the
    # fp32 run on the batches after them, in fp16 except the promoted module.
    data, model, _, (losses, _, _) = runs
    ref, _, _ = healing.train(copy.deepcopy(model), data[4:], fp16=False)
    tail, ref_tail = sum(losses[-8:]) / 8, sum(ref[-8:]) / 8
    assert abs(tail / ref_tail - 1) < 0.01, (tail, ref_tail)


def test_promotion_is_logged_with_op_module_and_source_line(caplog):
    model = _fp16(healing.build())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        healing.train(model, healing.batches(4), fp16=False, heal=True, every=2, skips=2)
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    text = record.getMessage()
    assert f"promoted module {SCORES!r} to fp32 at step 2" in text
    assert "forward aten.exp.default in module" in text and "(CosineScores)" in text
    assert "healing.py:" in text and "planted" in text


def test_a_skip_at_the_floor_scale_heals_at_once():
    model = _fp16(healing.build())
    scaler = fxamp.LossScaler(init_scale=1.0, compile=False)  # already at the floor
    _, scaler, healer = healing.train(model, healing.batches(4), fp16=False, heal=True,
                                      scaler=scaler, every=2, skips=100)
    assert [(p.key, p.step) for p in healer.promotions] == [(SCORES, 2)]
    assert int(scaler.skipped_steps) == 2


def test_loss_scale_backoff_alone_is_never_healed():
    # No hostile op: a scale that starts at 2**40 and doubles after every 2 clean steps keeps
    # overflowing the backward; the locator runs (at the floor scale) and promotes nothing.
    # Its forward is finite, so it runs the backward of the healer's loss_fn on the fp16
    # output: the loop's own `healing.loss_fn`, in fp32 (torch 2.11's mse_loss of an fp16
    # output and an fp32 target cannot run its backward: "Found dtype Float but expected Half").
    model = healing.build(hostile=())
    scaler = fxamp.LossScaler(init_scale=2.0**40, growth_interval=2, max_loss_scale=None,
                              compile=False)
    losses, scaler, healer = healing.train(model, healing.batches(40), fp16=True, heal=True,
                                           scaler=scaler, every=4, skips=2)
    assert int(scaler.skipped_steps) >= 20 and healer.reports  # it did look
    assert not any(r.found for r in healer.reports) and healer.promotions == []
    assert fxamp.config_of(model).module_overrides == ()


class TopLevelExp(torch.nn.Module):
    """A hand-written softmax at the top level: no module to promote, so the op is."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(healing.DIM, healing.DIM)

    def forward(self, x):
        h = 12 * self.fc(x)
        e = torch.exp(h)  # > 65504 in fp16
        return e / e.sum(dim=-1, keepdim=True)


def test_an_op_outside_every_module_is_promoted_by_name():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _fp16(TopLevelExp())
    losses, scaler, healer = healing.train(model, healing.batches(6), fp16=False, heal=True,
                                           every=2, skips=2)
    (p,) = healer.promotions
    assert (p.kind, p.key, p.module, p.op) == ("op_overrides", "aten.exp", "",
                                               "aten.exp.default")
    assert int(scaler.skipped_steps) == 2 and all(math.isfinite(x) for x in losses[2:])
    assert fxamp.config_of(model).op_overrides == (("aten.exp", "fp32"),)


def test_no_host_read_between_reads():
    model = _fp16(healing.build(hostile=()))
    scaler = fxamp.LossScaler(compile=False)
    with mock.patch.object(Healer, "_read", return_value=(0.0, 2.0**16)) as read:
        healing.train(model, healing.batches(9), fp16=False, scaler=scaler, heal=True,
                      every=4)
    assert read.call_count == 2


def test_promotions_are_bounded_with_a_warning():
    model = _fp16(healing.build(hostile=(0, 1)))
    with pytest.warns(RuntimeWarning, match="healing stops here"):
        losses, scaler, healer = healing.train(model, healing.batches(12), fp16=False,
                                               heal=True, every=2, skips=2, max_promotions=1)
    assert [p.key for p in healer.promotions] == [SCORES] and healer.exhausted
    assert int(scaler.skipped_steps) == 12  # block 1 still overflows: no more healing
    assert len(healer.reports) == 1


def test_each_hostile_module_is_promoted_in_turn():
    model = _fp16(healing.build(hostile=(0, 1)))
    with pytest.warns(RuntimeWarning, match="2 promotions made"):
        losses, scaler, healer = healing.train(model, healing.batches(8), fp16=False,
                                               heal=True, every=2, skips=2, max_promotions=2)
    assert [(p.key, p.step) for p in healer.promotions] == [(SCORES, 2),
                                                             ("blocks.1.attn.scores", 4)]
    assert int(scaler.skipped_steps) == 4 and all(math.isfinite(x) for x in losses[4:])


def test_resumed_run_keeps_the_promotions(runs):
    _, model, _, (_, _, healer) = runs
    state = healer.state_dict()
    assert state["promotions"][0]["key"] == SCORES and state["steps"] == 32
    resumed = _fp16(copy.deepcopy(model))
    scaler = fxamp.LossScaler(compile=False)
    Healer(resumed, scaler, F.mse_loss).load_state_dict(state)
    assert fxamp.config_of(resumed).module_overrides == ((SCORES, "fp32"),)
    healing.train(resumed, healing.batches(3), fp16=False, scaler=scaler)
    assert int(scaler.skipped_steps) == 0


def test_bad_state_and_unknown_module_change_nothing(runs):
    _, model, _, (_, _, healer) = runs
    fresh = _fp16(healing.build(hostile=()))
    before = fxamp.config_of(fresh)
    target = Healer(fresh, fxamp.LossScaler(compile=False), F.mse_loss)
    with pytest.raises(ConfigError, match="names no module"):
        target.load_state_dict(healer.state_dict())  # that model has no blocks.0.attn.scores
    with pytest.raises(ConfigError, match="not a Healer.state_dict"):
        target.load_state_dict({"promotions": []})
    assert fxamp.config_of(fresh) is before and target.promotions == [] and target.steps == 0


@pytest.mark.parametrize("make, match", [
    (lambda: (healing.build(), fxamp.LossScaler()), "prepared by fxamp.compile"),
    (lambda: (fxamp.compile(healing.build(), compiler="aot_eager", opt_level="O2",
                            dtype=torch.float16), fxamp.LossScaler()), "needs O1"),
    (lambda: (_fp16(healing.build()), fxamp.LossScaler(enabled=False)), "enabled"),
    (lambda: (_fp16(healing.build()), torch.amp.GradScaler("cpu")), "LossScaler"),
])
def test_refusals(make, match):
    model, scaler = make()
    with pytest.raises(ConfigError, match=match):
        Healer(model, scaler)


@pytest.mark.parametrize("option", ["every", "skips", "max_promotions"])
def test_bad_counts_are_refused(option):
    with pytest.raises(ConfigError, match=f"{option}=0 must be a positive int"):
        Healer(_fp16(healing.build()), fxamp.LossScaler(), **{option: 0})


def test_recompile_refuses_a_weight_dtype_change_and_leaves_the_model():
    model = fxamp.compile(healing.build(), compiler="aot_eager", opt_level="O2",
                          dtype=torch.float16)
    config, weights = fxamp.config_of(model), [p.detach().clone() for p in model.parameters()]
    promoted = fxamp.config.AmpConfig.from_opt_level("O2", dtype=torch.float16,
                                                     module_overrides={SCORES: "fp32"})
    with pytest.raises(ConfigError, match="instead of torch.float16"):
        recompile(model, promoted)
    assert fxamp.config_of(model) is config
    assert all(torch.equal(a, b) and a.dtype == b.dtype
               for a, b in zip(weights, model.parameters()))


@pytest.mark.slow
def test_300_steps_land_within_one_percent_of_fp32():
    data, model = healing.batches(300), healing.build()
    ref, _, _ = healing.train(copy.deepcopy(model), data, fp16=False)
    healed, scaler, healer = healing.train(copy.deepcopy(model), data, fp16=True, heal=True,
                                           every=4)
    assert [p.key for p in healer.promotions] == [SCORES] and int(scaler.skipped_steps) <= 4
    assert abs(healing.tail(healed) / healing.tail(ref) - 1) < 0.01


@pytest.mark.slow
def test_1000_steps_of_scale_backoff_are_never_healed():
    # Every skip runs the locator (skips=1): the scale grows every 20 clean steps and overflows.
    model = healing.build(hostile=())
    scaler = fxamp.LossScaler(init_scale=2.0**40, growth_interval=20, max_loss_scale=None,
                              compile=False)
    _, scaler, healer = healing.train(model, healing.batches(1000), fp16=True, heal=True,
                                      scaler=scaler, every=10, skips=1)
    assert int(scaler.skipped_steps) >= 40 and len(healer.reports) >= 20
    assert healer.promotions == [] and fxamp.config_of(model).module_overrides == ()
