"""LossScaler's torch.amp.GradScaler protocol: the per-optimizer states, the refusals (each
before anything changes), update(new_scale), enabled=False, the getters and setters, the
skipped-step counter, state dicts both ways, and the guard for 16-bit weights without masters.
(The AMP recipes against GradScaler are in test_grad_scaler_recipes.py.)"""

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxamp
import fxamp.optim as fo
from fxamp.errors import ConfigError
from fxamp.optim.scaling.loss_scaler import OptState
from fxamp.errors import MasterWeightsWarning


def _setup(dtype=torch.float32, fused=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(dtype)
    opt = (fo.SGD(model.parameters(), lr=0.1, compile=False) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    return model, opt, fxamp.LossScaler(semantics="torch", compile=False)


def _backward(model, scaler, bad=False):
    x = torch.ones(2, 4, dtype=next(model.parameters()).dtype)
    if bad:
        x[0, 0] = float("inf")
    scaler.scale(model(x).float().sum()).backward()


def _state(model, scaler):
    return ([p.detach().clone() for p in model.parameters()]
            + [p.grad.clone() for p in model.parameters() if p.grad is not None]
            + [t.clone() for t in scaler.state_tensors(torch.device("cpu"))])


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fused", [False, True])
def test_states_are_named_and_reset_by_update(fused):
    model, opt, scaler = _setup(fused=fused)
    assert scaler.optimizer_state(opt) is OptState.READY
    _backward(model, scaler)
    scaler.unscale_(opt)
    assert scaler.optimizer_state(opt) is OptState.UNSCALED
    assert torch.equal(model.bias.grad, torch.full((3,), 2.0))  # unscaled in .grad
    scaler.step(opt)
    assert scaler.optimizer_state(opt) is OptState.STEPPED
    scaler.update()
    assert scaler.optimizer_state(opt) is OptState.READY
    assert torch.equal(model.bias.detach(), _setup()[0].bias.detach() - 0.2)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("misuse", ["unscale_twice", "step_twice", "closure", "update_alone"])
def test_misuse_is_refused_before_anything_changes(fused, misuse):
    model, opt, scaler = _setup(fused=fused)
    _backward(model, scaler)
    if misuse == "unscale_twice":
        scaler.unscale_(opt)
        call, match = (lambda: scaler.unscale_(opt)), "after unscale_\\(\\) since the last"
    elif misuse == "step_twice":
        scaler.step(opt)
        call, match = (lambda: scaler.step(opt)), "called twice"
    elif misuse == "closure":
        call, match = (lambda: scaler.step(opt, closure=lambda: 0.0)), "closure"
    else:
        call, match = scaler.update, "found no scaler.step"
    before = _state(model, scaler)
    with pytest.raises(ConfigError, match=match):
        call()
    assert _same(_state(model, scaler), before)


def test_update_after_fxamp_own_step_is_refused():
    model, opt, scaler = _setup(fused=True)
    _backward(model, scaler)
    opt.step(scaler)  # fxamp's own form moves the scale in the step
    with pytest.raises(ConfigError, match="moved in the step already"):
        scaler.update()


@pytest.mark.parametrize("fused", [False, True])
def test_overflow_skips_counts_and_backs_off(fused):
    model, opt, scaler = _setup(fused=fused)
    weights = [p.detach().clone() for p in model.parameters()]
    _backward(model, scaler, bad=True)
    scaler.step(opt)
    scaler.update()
    assert _same([p.detach() for p in model.parameters()], weights)
    assert scaler.get_scale() == 2.0**15 and scaler.skipped_steps.item() == 1
    assert scaler.skipped_steps.dtype == torch.int64 and scaler.skipped_steps.shape == ()


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unscale", [False, True])
def test_fused_protocol_reads_nothing_back(unscale):
    model, opt, scaler = _setup(fused=True)
    for bad in (False, True, False):
        _backward(model, scaler, bad=bad)
        with _HostReads() as mode:
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert mode.reads == 0
        opt.zero_grad()
    assert scaler.skipped_steps.item() == 1


def test_update_new_scale_sets_it():
    model, opt, scaler = _setup()
    _backward(model, scaler)
    scaler.step(opt)
    scaler.update(1024.0)
    assert scaler.get_scale() == 1024.0
    scaler.update(torch.tensor([8.0]))
    assert scaler.get_scale() == 8.0
    for bad in (0.0, float("inf"), torch.ones(2)):
        with pytest.raises(ConfigError):
            scaler.update(bad)
    assert scaler.get_scale() == 8.0


def test_disabled_is_a_no_op():
    model, opt, _ = _setup()
    scaler = fxamp.LossScaler(enabled=False)
    loss = model(torch.ones(2, 4)).sum()
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
    loss.backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    assert torch.equal(model.bias.detach(), _setup()[0].bias.detach() - 0.2)
    with pytest.raises(ConfigError, match="empty"):
        fxamp.LossScaler().load_state_dict({})


def test_scale_takes_lists_and_iterables():
    scaler = fxamp.LossScaler(init_scale=4.0)
    a, b = torch.tensor(1.0), torch.tensor(2.0)
    assert [t.item() for t in scaler.scale([a, b])] == [4.0, 8.0]
    assert isinstance(scaler.scale((a, b)), tuple)
    assert [t.item() for t in scaler.scale(iter([a]))] == [4.0]


def test_getters_and_setters_checked():
    scaler = fxamp.LossScaler(semantics="torch")
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(3)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (4.0, 0.25, 3)
    rule = scaler.rule
    for setter, bad in ((scaler.set_growth_factor, 0.5), (scaler.set_backoff_factor, 1.5),
                        (scaler.set_growth_interval, 0)):
        with pytest.raises(ConfigError, match=f"={bad}"):
            setter(bad)
    assert scaler.rule == rule


def test_state_dicts_go_both_ways_with_gradscaler():
    model, opt, scaler = _setup()
    _backward(model, scaler, bad=True)
    scaler.step(opt)
    scaler.update()
    sd = scaler.state_dict()
    assert sd["skipped_steps"] == 1 and sd["scale"] == 2.0**15
    fresh = fxamp.LossScaler(semantics="torch")
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.state_dict() == sd and fresh.skipped_steps.item() == 1
    gs = torch.amp.GradScaler("cpu")
    gs.load_state_dict(sd)  # GradScaler ignores fxamp's extra keys
    assert gs.get_scale() == 2.0**15
    with pytest.raises(ConfigError, match="skipped_steps=-1"):
        fresh.load_state_dict({**sd, "skipped_steps": -1})
    assert fresh.state_dict() == sd


def test_fp16_weights_without_masters_are_refused_untouched():
    model, opt, scaler = _setup(torch.float16)
    _backward(model, scaler)
    before = _state(model, scaler)
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt)):
        with pytest.raises(ConfigError, match="fxamp.optim.AdamW.*opt_level='O1'"):
            call()
        assert _same(_state(model, scaler), before)


def test_bf16_weights_without_masters_warn_once():
    model, opt, scaler = _setup(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _backward(model, scaler)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    hits = [w for w in caught if issubclass(w.category, MasterWeightsWarning)]
    assert len(hits) == 1 and "fxamp.optim.AdamW" in str(hits[0].message)


def test_fp16_optimizer_and_non_optimizers_are_refused():
    scaler = fxamp.LossScaler()
    with pytest.raises(ConfigError, match="takes a torch.optim.Optimizer"):
        scaler.step(object())


def test_compiled_fused_protocol_matches_eager():
    runs = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = fo.AdamW(model.parameters(), lr=0.1, compile=compile)
        scaler = fxamp.LossScaler(semantics="torch", growth_interval=1, compile=compile)
        for bad in (False, True, False):
            _backward(model, scaler, bad=bad)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(([p.detach() for p in model.parameters()], scaler.state_dict()))
    (eager, eager_sd), (compiled, compiled_sd) = runs
    assert compiled_sd == eager_sd and eager_sd["skipped_steps"] == 1
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_fxamp_own_step_counts_skips_in_the_step(loss_scale):
    model, opt, _ = _setup(fused=True)
    scaler = fxamp.LossScaler(loss_scale, compile=False)
    for bad in (False, True, True, False):
        _backward(model, scaler, bad=bad)
        opt.step(scaler)  # the prologue moves the scale and counts the skip
        opt.zero_grad()
    assert scaler.skipped_steps.item() == 2
    assert scaler.get_scale() == (2.0**14 if loss_scale == "dynamic" else 128.0)


def test_scale_loss_exits_count_skips():
    model = torch.nn.Linear(4, 3)
    model, opt = fo.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               opt_level="O0", loss_scale="dynamic", compiler="aot_eager")
    for bad in (True, False):
        x = torch.ones(2, 4)
        x[0, 0] = float("inf") if bad else 1.0
        with fo.scale_loss(model(x).sum(), opt, unscale_on_exit=True) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert opt.loss_scalers[0].skipped_steps.item() == 1
