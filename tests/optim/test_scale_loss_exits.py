"""Apex's `amp.scale_loss` semantics with one loss scaler shared by several optimizers and
several losses (issue 12 items 1, 2, 12).

The reference is Apex's rule, written by hand (apex.amp.handle, apex.amp.scaler): each
`scale_loss` exit unscales the gradients of *its* backward with the scale the loss was
multiplied by, checks them, moves the scale (`update_scale`) and, on overflow, makes the next
`step()` of every optimizer passed to that call a skip. fp32 models (O0) compare exactly with a
plain fp32 SGD run that skips the same steps; O2 in fp16 and bf16 within a stated tolerance.
"""

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot

import fxamp.optim as fo
from fxamp import ConfigError
from fxamp.optim.scaling.scale_round import ExitState

pytest.importorskip("fxamp.backend")

INF = float("inf")
LEVELS = {"O0": dict(opt_level="O0", loss_scale="dynamic"),
          "O2-bf16": dict(opt_level="O2", dtype=torch.bfloat16),
          "O2-fp16": dict(opt_level="O2", dtype=torch.float16)}
# Weights after a few SGD steps (lr 0.1) against fp32: O0 exact (measured 0); O2 carries the
# 16-bit forward and model copy (measured 1.8e-3 bf16, 2.2e-4 fp16). The bugs these tests catch
# (a step with a 2x gradient, a skipped step) move a weight by ~7e-3.
ATOL = {"O0": 1e-6, "O2-bf16": 3.5e-3, "O2-fp16": 1e-3}


class ApexScaler:
    """Apex amp's LossScaler.update_scale (apex.amp.scaler), called at every scale_loss exit."""

    def __init__(self, scale=2.0**16, window=2000):
        self.scale, self.unskipped, self.window = scale, 0, window

    def exit(self, overflow):
        if overflow:
            self.scale, self.unskipped = max(1.0, self.scale / 2), 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale, self.unskipped = min(2.0**24, self.scale * 2), 0
        return overflow  # should_skip: the optimizers of this call skip their next step


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _pair(level):
    m0, m1 = make_mlp(), make_mlp(seed=1)
    models, opts = fo.initialize([m0, m1], [_sgd(m0), _sgd(m1)], compiler="aot_eager",
                                 **LEVELS[level])
    return models, opts, [make_mlp(), make_mlp(seed=1)]


# Each exit as scale_loss does it by default (unscaled in .grad at once) and deferred to the
# step (unscale_on_exit=False): the same rule either way.
EXITS = pytest.mark.parametrize("exit_mode", [None, False], ids=["unscaled-grad", "deferred"])


def _backward(loss, opts, used, bad_model=None, exit_mode=None):
    """One scale_loss call; records the scale the loss was multiplied by (scaled / loss)."""
    hook = None if bad_model is None else bad_model[0].weight.register_hook(
        lambda g: torch.full_like(g, INF))
    with fo.scale_loss(loss, opts, unscale_on_exit=exit_mode) as scaled:
        used.append((scaled.detach() / loss.detach().float()).item())
        scaled.backward()
    if hook is not None:
        hook.remove()


def _ref_step(refs, losses, skip):
    for ref in refs:
        ref.zero_grad()
    sum(losses).backward()
    with torch.no_grad():
        for ref, skipped in zip(refs, skip):
            for p in ref.parameters():
                p -= 0 if skipped else 0.1 * p.grad


def _assert_close(models, refs, level):
    for model, ref in zip(models, refs):
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.float(), r, rtol=0, atol=ATOL[level])


@EXITS
@pytest.mark.parametrize("level", list(LEVELS))
def test_two_optimizers_each_unscale_with_the_scale_of_their_loss(level, exit_mode):
    # Item 1: loss0 over [opt0] overflows at step 1; Apex halves the scale at that exit, so
    # loss1 is scaled by 2**15 and opt1 unscales by 2**15 (fxamp used to unscale by the scale
    # opt0's step had just halved: a 2x update).
    (m0, m1), (o0, o1), refs = _pair(level)
    apex, used, expected = ApexScaler(), [], []
    for step in range(4):
        bad = step == 1
        expected.append(apex.scale)
        _backward(loss_of(m0, step), o0, used, bad_model=m0 if bad else None,
                  exit_mode=exit_mode)
        skip0 = apex.exit(bad)
        expected.append(apex.scale)
        _backward(loss_of(m1, step + 50), o1, used, exit_mode=exit_mode)
        skip1 = apex.exit(False)
        before = snapshot(o0)
        o0.step()
        o1.step()
        assert bit_identical(snapshot(o0), before) == skip0
        assert o0.last_step_skipped() == skip0 and o1.last_step_skipped() == skip1
        o0.zero_grad()
        o1.zero_grad()
        _ref_step(refs, [loss_of(refs[0], step), loss_of(refs[1], step + 50)], [skip0, skip1])
    _assert_close([m0, m1], refs, level)
    assert used == expected
    assert fo.amp_state_dict(o0)["loss_scaler0"] == {"loss_scale": apex.scale,
                                                     "unskipped": apex.unskipped}


@EXITS
@pytest.mark.parametrize("level", list(LEVELS))
def test_overflow_is_decided_per_scale_loss_call(level, exit_mode):
    # Item 2: loss A over [opt0] overflows, loss B over [opt0, opt1] is clean: Apex skips
    # opt0 (A's exit patched its step) and steps opt1 with B's gradients, unscaled by the scale
    # A's exit halved.
    (m0, m1), (o0, o1), refs = _pair(level)
    apex, used, expected = ApexScaler(), [], []
    for step in range(3):
        bad = step == 1
        expected.append(apex.scale)
        _backward(loss_of(m0, step), o0, used, bad_model=m0 if bad else None,
                  exit_mode=exit_mode)
        skip0 = apex.exit(bad)
        expected.append(apex.scale)
        _backward(loss_of(m0, step + 50) + loss_of(m1, step + 50), [o0, o1], used,
                  exit_mode=exit_mode)
        apex.exit(False)
        before = snapshot(o0), snapshot(o1)
        o0.step()
        o1.step()
        assert bit_identical(snapshot(o0), before[0]) == skip0
        assert not bit_identical(snapshot(o1), before[1])
        o0.zero_grad()
        o1.zero_grad()
        _ref_step(refs, [loss_of(refs[0], step), loss_of(refs[0], step + 50),
                         loss_of(refs[1], step + 50)], [skip0, False])
    assert used == expected
    assert fo.amp_state_dict(o1)["loss_scaler0"] == {"loss_scale": apex.scale,
                                                     "unskipped": apex.unskipped}
    _assert_close([m0, m1], refs, level)


@EXITS
def test_one_call_over_two_optimizers_skips_both_when_one_overflows(exit_mode):
    # Apex's flag is per call: an overflow in opt1's parameters alone skips opt0 as well.
    (m0, m1), (o0, o1), _ = _pair("O0")
    before = snapshot(o0), snapshot(o1)
    _backward(loss_of(m0, 0) + loss_of(m1, 0), [o0, o1], [], bad_model=m1,
              exit_mode=exit_mode)
    o0.step()
    o1.step()
    assert bit_identical(snapshot(o0), before[0]) and bit_identical(snapshot(o1), before[1])
    assert o0.loss_scalers[0].get_scale() == 2.0**15


# --- item 12: `.grad` of model.parameters() between the backward and the step -----------------
O1_LEVELS = {"O0": dict(opt_level="O0", loss_scale="dynamic"),
             "O1-bf16": dict(opt_level="O1", dtype=torch.bfloat16),
             "O1-fp16": dict(opt_level="O1", dtype=torch.float16)}
# Gradients against fp32, relative to the largest: O0 exact; O1 runs the matmuls in 16 bits
# (measured 4.4e-3 bf16, 7.4e-4 fp16). A scaled gradient is 65536x off.
GRAD_RTOL = {"O0": 1e-6, "O1-bf16": 1.5e-2, "O1-fp16": 3e-3}


def _one(level):
    model = make_mlp()
    model, opt = fo.initialize(model, _sgd(model), compiler="aot_eager", **O1_LEVELS[level])
    return model, opt, make_mlp()


def _assert_grads(model, ref, level):
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.float(), r.grad, rtol=0,
                                   atol=GRAD_RTOL[level] * r.grad.abs().max().item())


@pytest.mark.parametrize("level", list(O1_LEVELS))
def test_unscale_on_exit_leaves_unscaled_grads_to_clip_like_apex_o1(level):
    # Apex O1 unscaled `.grad` in place at the exit, so O1 scripts clip model.parameters().
    model, opt, ref = _one(level)
    for step in range(3):
        with fo.scale_loss(loss_of(model, step), opt, unscale_on_exit=True) as scaled:
            scaled.backward()
        ref.zero_grad()
        loss_of(ref, step).backward()
        _assert_grads(model, ref, level)
        fo.unscale_(opt)  # idempotent: the step below must not unscale twice either
        _assert_grads(model, ref, level)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        _assert_grads(model, ref, level)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for r in ref.parameters():
                r -= 0.1 * r.grad
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, r, rtol=0, atol=10 * GRAD_RTOL[level] * 0.1 * 0.05)
    assert opt.loss_scalers[0].get_scale() == 2.0**16


@pytest.mark.parametrize("level", ["O0", "O1-fp16"])
def test_unscale_on_exit_overflow_skips_once_and_halves_once(level):
    model, opt, _ = _one(level)
    before = snapshot(opt)
    hook = model[0].weight.register_hook(lambda g: torch.full_like(g, INF))
    with fo.scale_loss(loss_of(model, 0), opt, unscale_on_exit=True) as scaled:
        scaled.backward()
    hook.remove()
    assert not torch.isfinite(model[0].weight.grad).all()
    opt.step()
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)
    assert fo.amp_state_dict(opt)["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}


def test_unscale_before_the_step_without_scale_loss_like_gradscaler():
    # torch's GradScaler idiom: backward, unscale_, clip the model's grads, step.
    model, ref = make_mlp(torch.bfloat16), make_mlp(torch.bfloat16)
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    ref_opt = fo.SGD(ref.parameters(), lr=0.1, max_grad_norm=0.05, compile=False)
    scaler, ref_scaler = fo.LossScaler(compile=False), fo.LossScaler(compile=False)
    for step in range(3):
        scaler.scale(loss_of(model, step)).backward()
        fo.unscale_(opt, scaler)
        fo.unscale_(opt, scaler)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step(scaler)
        opt.zero_grad()
        ref_scaler.scale(loss_of(ref, step)).backward()
        ref_opt.step(ref_scaler)
        ref_opt.zero_grad()
    # The fused clip of the same gradients, on the fp32 masters: measured 1.2e-5 apart (the
    # unscaled grads are rounded to bf16 in .grad); a clipped step moves an element ~3e-4, and
    # unscaling twice would move it ~0.
    torch.testing.assert_close(opt.buckets[0].weights, ref_opt.buckets[0].weights, rtol=0,
                               atol=5e-5)
    assert scaler.state_dict()["_growth_tracker"] == 3


def test_delay_unscale_accumulates_and_moves_the_scale_once_per_exit():
    # Apex: update_scale runs at each exit without delay_unscale (2 per iteration here), at the
    # last one only with it (1 per iteration).
    for delay, expected in ((False, 6), (True, 3)):
        model, opt, _ = _one("O0")
        for step in range(3):
            with fo.scale_loss(loss_of(model, step), opt, delay_unscale=delay) as scaled:
                scaled.backward()
            with fo.scale_loss(loss_of(model, step + 50), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        assert fo.amp_state_dict(opt)["loss_scaler0"]["unskipped"] == expected


def test_scale_loss_refusals_change_nothing():
    model, opt, _ = _one("O0")
    before = snapshot(opt)
    with pytest.raises(ConfigError, match="unscale_on_exit=True with delay_unscale=True"):
        with fo.scale_loss(loss_of(model, 0), opt, delay_unscale=True, unscale_on_exit=True):
            pass
    with pytest.raises(ConfigError, match="unscale_ takes an fxamp optimizer"):
        fo.unscale_(torch.optim.SGD(make_mlp().parameters(), lr=0.1))
    assert bit_identical(snapshot(opt), before) and opt.folding.folds_nothing()
    assert opt.loss_scalers[0].scale_round.exit_state is ExitState.NONE


def test_a_loss_scaler_passed_as_loss_id_is_refused_not_ignored():
    # Without initialize the optimizer has no scalers and scale_loss yields the loss as it is;
    # a LossScaler in loss_id's place would have been silently ignored (an fp16 run unscaled).
    model = make_mlp()
    opt, scaler = fo.AdamW(model.parameters(), compile=False), fo.LossScaler(compile=False)
    loss = loss_of(model, 0)
    with pytest.raises(ConfigError, match=r"the third argument is loss_id \(an int\), not a "
                                          r"LossScaler.*opt.step\(scaler\)"):
        with fo.scale_loss(loss, opt, scaler):
            pass
    with pytest.raises(ConfigError, match="loss_id='0' must be an int"):
        with fo.scale_loss(loss, opt, "0"):
            pass
    with fo.scale_loss(loss, opt) as same:  # no initialize: the loss unchanged, as before
        assert same is loss
