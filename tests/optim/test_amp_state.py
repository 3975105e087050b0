"""Apex's `amp.state_dict()` / `amp.load_state_dict(sd)` with Apex's call shapes (issue 24
item 5): no argument means the loss scalers of the one live `initialize` call, found through
the optimizers it returned (Note [Where amp.state_dict() finds its scalers]); no call, or
several, is refused with the fix, and a bad dict is refused before any scaler changes. Also:
the pending-scale record follows the gradients (`model.zero_grad()` drops it), and
`master_params` refused after a scaled backward names a call that exists."""

import gc

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot

import fxamp as amp
import fxamp.optim as fo
from fxamp import ConfigError

pytest.importorskip("fxamp.backend")


@pytest.fixture(autouse=True)
def _no_live_optimizers():
    gc.collect()  # optimizers of earlier tests (reference cycles) are not this test's
    yield


def _init(num_losses=1, **kw):
    model = make_mlp()
    return fo.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O0",
                         loss_scale="dynamic", num_losses=num_losses, compiler="aot_eager",
                         verbosity=0, **kw)


def test_state_dict_of_the_one_initialize_call_round_trips():
    model, opt = _init(num_losses=2)
    opt.loss_scalers[1].set_scale(2.0**10)
    with amp.scale_loss(loss_of(model, 0), opt, loss_id=0) as scaled:
        scaled.backward()
    opt.step()
    saved = amp.state_dict()
    assert saved == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 1},
                     "loss_scaler1": {"loss_scale": 2.0**10, "unskipped": 0}}
    assert saved == amp.state_dict(opt) == fo.amp_state_dict(opt)
    del model, opt
    _, fresh = _init(num_losses=2)
    amp.load_state_dict(saved)
    assert amp.state_dict() == saved
    assert [s.get_scale() for s in fresh.loss_scalers] == [2.0**16, 2.0**10]


def test_no_initialize_call_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"no optimizer returned by fxamp.initialize.*"
                                          r"call initialize\(models, optimizers"):
        amp.state_dict()
    with pytest.raises(ConfigError, match="amp.load_state_dict"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def test_two_live_initialize_calls_are_ambiguous_until_one_dies():
    _, first = _init()
    _, second = _init()
    first.loss_scalers[0].set_scale(8.0)
    for call in (lambda: amp.state_dict(),
                 lambda: amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0,
                                                               "unskipped": 0}})):
        with pytest.raises(ConfigError, match=r"ambiguous: 2 initialize calls .* Pass the "
                                              r"optimizer"):
            call()
    assert [o.loss_scalers[0].get_scale() for o in (first, second)] == [8.0, 2.0**16]
    assert amp.state_dict(first)["loss_scaler0"]["loss_scale"] == 8.0  # the fix works
    del second
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0


def test_optimizers_of_one_call_are_one_state():
    m0, m1 = make_mlp(), make_mlp(seed=1)
    _, opts = fo.initialize([m0, m1], [torch.optim.SGD(m0.parameters(), lr=0.1),
                                       torch.optim.RMSprop(m1.parameters())],
                            opt_level="O0", loss_scale="dynamic", compiler="aot_eager")
    assert isinstance(opts[1], fo.FP16_Optimizer)
    assert list(amp.state_dict()) == ["loss_scaler0"]


@pytest.mark.parametrize("bad,words", [
    ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}}, ["loss_scaler1", "num_losses=2"]),
    ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
      "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}}, ["'loss_scaler1'", "-1"]),
    ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
      "scaler1": {"loss_scale": 4.0, "unskipped": 0}}, ["scaler1", "loss_scaler1"]),
    ([1, 2], ["list"]),
])
def test_a_bad_amp_state_dict_changes_no_scaler(bad, words):
    _, opt = _init(num_losses=2)
    before = [s.state_dict() for s in opt.loss_scalers]
    with pytest.raises(ConfigError) as e:
        amp.load_state_dict(bad)
    for word in words:
        assert word in str(e.value)
    assert [s.state_dict() for s in opt.loss_scalers] == before


def _gan_pair():
    d, g = make_mlp(), torch.nn.Linear(4, 8)
    return d, g, fo.SGD(d.parameters(), lr=0.1, compile=False), fo.SGD(g.parameters(),
                                                                        lr=0.1, compile=False)


@pytest.mark.parametrize("drop", [True, False])
def test_module_zero_grad_drops_the_pending_scale(drop):
    """A generator's scaled loss reaches the discriminator's gradients; the generator steps
    with the scaler. `D.zero_grad()` (set_to_none) drops those gradients, so a plain
    `opt_d.step()` is not refused; without it the step is refused, nothing changed."""
    d, g, opt_d, opt_g = _gan_pair()
    scaler = fo.LossScaler()
    scaler.scale(d(g(torch.randn(5, 4))).square().mean()).backward()
    opt_g.step(scaler)
    if drop:
        d.zero_grad()
        opt_d.step()  # no gradients: nothing to refuse (SGD without decay leaves d as it is)
        return
    before = snapshot(opt_d)
    with pytest.raises(ConfigError, match="SGD.step.. was called without a scaler"):
        opt_d.step()
    assert bit_identical(snapshot(opt_d), before)


def test_master_params_refusal_names_a_call_that_exists():
    """After `scaler.scale(loss).backward()`, `master_params(opt)` of an optimizer with no
    scaler of its own is refused; the message's fix (`fxamp.optim.unscale_(opt, scaler)`
    first) works and yields the unscaled gradients."""
    model, ref = make_mlp(), make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    scaler = fo.LossScaler(init_scale=2.0**8)
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(ConfigError) as e:
        list(amp.master_params(opt))
    message = str(e.value)
    assert "master_params(SGD) was called without a scaler" in message
    assert "master_params(scaler)" not in message and "unscale_(optimizer, scaler)" in message
    fo.unscale_(opt, scaler)
    loss_of(ref, 0).backward()
    for m, r in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(m.grad, r.grad, rtol=1e-6, atol=1e-7)
