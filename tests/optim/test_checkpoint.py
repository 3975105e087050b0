"""Save at step k, load into fresh objects with torch.load(weights_only=True), continue: the run
is bit-identical to the uninterrupted one. torch.optim's state dicts load too, both ways."""

import io

import pytest
import torch
from optim_helpers import bit_identical, make_mlp, snapshot, train

import fxamp.optim as fo
from fxamp.errors import ConfigError

K, STEPS = 5, 10
BAD = (2, 7)  # an overflow before and after the checkpoint moves the scale too


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _o2(seed=0, compile=True):
    model = make_mlp(torch.bfloat16, seed=seed)
    return model, fo.AdamW(model.parameters(), lr=1e-2, compile=compile), fo.LossScaler(
        growth_interval=3, compile=compile)


@pytest.mark.parametrize("model_first", [True, False], ids=["model-then-opt", "opt-then-model"])
def test_resume_is_bit_exact(model_first):
    model, opt, scaler = _o2()
    train(model, opt, STEPS, scaler, bad_steps=BAD)
    expected, expected_scale = snapshot(opt), scaler.state_dict()

    model, opt, scaler = _o2()
    train(model, opt, K, scaler, bad_steps=BAD)
    ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict(),
                       "scaler": scaler.state_dict()})
    model, opt, scaler = _o2(seed=1)  # different initial weights, all overwritten by the load
    loads = [lambda: model.load_state_dict(ckpt["model"]), lambda: opt.load_state_dict(ckpt["opt"])]
    for load in loads if model_first else loads[::-1]:
        load()
    scaler.load_state_dict(ckpt["scaler"])
    train(model, opt, STEPS - K, scaler, bad_steps=BAD, start=K)
    assert bit_identical(snapshot(opt), expected)
    assert scaler.state_dict() == expected_scale


def test_torch_adamw_state_loads_into_fxamp_and_back():
    ref, ours, back = make_mlp(), make_mlp(), make_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    train(ref, ref_opt, K)
    ours.load_state_dict(ref.state_dict())
    opt = fo.AdamW(ours.parameters(), compile=False)
    opt.load_state_dict(_roundtrip(ref_opt.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.step_counts.item() == K
    back.load_state_dict(ref.state_dict())
    back_opt = torch.optim.AdamW(back.parameters())
    back_opt.load_state_dict(_roundtrip(opt.state_dict()))
    for model, o in ((ref, ref_opt), (ours, opt), (back, back_opt)):
        train(model, o, STEPS - K, start=K)
    for a, b, c in zip(ref.parameters(), ours.parameters(), back.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)


def test_torch_sgd_momentum_state_continues_the_buffer():
    ref, ours = make_mlp(), make_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    train(ref, ref_opt, K)
    ours.load_state_dict(ref.state_dict())
    opt = fo.SGD(ours.parameters(), lr=0.05, momentum=0.9, compile=False)
    opt.load_state_dict(ref_opt.state_dict())  # torch's SGD state has no "step"
    train(ref, ref_opt, 3, start=K)
    train(ours, opt, 3, start=K)
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_fp16_optimizer_resume_is_bit_exact():
    def build(seed=0):
        model = make_mlp(torch.bfloat16, seed=seed)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return model, fo.FP16_Optimizer(inner, dynamic_loss_scale=True, compile=False)

    def run(model, opt, start, steps):
        for step in range(start, start + steps):
            opt.zero_grad()
            opt.backward(torch.nn.functional.mse_loss(
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step),
                                  dtype=torch.float32).bfloat16()).float(), torch.zeros(4, 4)))
            opt.step()

    model, opt = build()
    run(model, opt, 0, STEPS)
    expected = [p.clone() for p in model.parameters()] + [s.master.clone() for s in opt._slots]
    model, opt = build()
    run(model, opt, 0, K)
    ckpt = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build(seed=1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    run(model, opt, K, STEPS - K)
    assert bit_identical(list(model.parameters()) + [s.master for s in opt._slots], expected)


def test_mismatched_state_dict_is_refused():
    model = make_mlp()
    opt = fo.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}],
                   compile=False)
    other = fo.AdamW(make_mlp().parameters(), compile=False)
    with pytest.raises(ConfigError, match="has 1 param groups, this AdamW has 2"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match="not an optimizer state dict"):
        opt.load_state_dict({"scale": 1.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_appears_as_torch_optims_does(dtype):
    # Note [State appears when a parameter is stepped]: none before a step, then the entries of
    # the parameters the step had a gradient for, with torch.optim's keys (and the masters)
    model, ref = make_mlp(dtype), make_mlp(torch.float32)
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert opt.state_dict()["state"] == ref_opt.state_dict()["state"] == {} and not opt.state
    for m, o in ((model, opt), (ref, ref_opt)):
        m[0].weight.requires_grad_(False)  # no gradient this step
        m(torch.randn(4, m[0].in_features, dtype=m[0].weight.dtype)).float().sum().backward()
        m[0].weight.requires_grad_(True)
        o.step()
    ours, torchs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(ours) == sorted(torchs) and 0 not in ours
    extra = {"master_param"} if dtype == torch.bfloat16 else set()
    assert all(set(ours[i]) == set(torchs[i]) | extra for i in torchs)
    # a fresh optimizer loading the empty dict of one never stepped stays as it was
    fresh = fo.AdamW(make_mlp(dtype).parameters(), lr=1e-2, compile=False)
    kept = snapshot(fresh)
    fresh.load_state_dict(_roundtrip(fo.AdamW(make_mlp(dtype).parameters(), lr=1e-2,
                                               compile=False).state_dict()))
    assert bit_identical(snapshot(fresh), kept) and not fresh.state
    # and loading a stepped one gives it the same entries
    fresh.load_state_dict(_roundtrip(opt.state_dict()))
    assert sorted(fresh.state_dict()["state"]) == sorted(ours)


def test_torch_distributed_state_dict_helpers_round_trip():
    # torch.distributed.checkpoint.state_dict keys the state by parameter names (torchtitan's
    # checkpoints): get_optimizer_state_dict of a fresh optimizer takes torch's lr-0 step, as
    # it does with torch.optim's, and set_optimizer_state_dict loads by the groups' names
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model, opt, scaler = _o2()
    before = snapshot(opt)[1:]  # all but the step count
    assert list(get_optimizer_state_dict(model, opt)["state"])[0] == "0.weight"
    assert bit_identical(snapshot(opt)[1:], before)
    train(model, opt, 2, scaler=scaler)
    saved = _roundtrip(get_optimizer_state_dict(model, opt))
    other = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    set_optimizer_state_dict(model, other, saved)
    assert bit_identical(snapshot(other), snapshot(opt))
