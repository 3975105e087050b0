"""fxamp's optimizers against torch.optim (and GradScaler, clip_grad_norm_, a LAMB reference)
over 20 steps of a tiny MLP.

Tolerances: fp32 runs agree to 1e-6 of each tensor's largest magnitude (measured: ~3e-7; the
per-step scalars are computed on the device in float64 like torch's Python floats, and the
remaining difference is the order of a few fp32 roundings). O2 (bf16 model, fp32 masters) tracks
the fp32 run to 1e-2 relative (measured ~3e-3): the forward and backward run in bf16 (8 bits of
mantissa, 2**-9 relative rounding per op) while the update itself is fp32.
"""

import copy

import pytest
import torch
from optim_helpers import loss_of, make_mlp, train

import fxamp.optim as fo

STEPS = 20


def assert_rel(ours, ref, tol, what=""):
    for a, b in zip(ours, ref):
        err = (a.detach().float() - b.detach().float()).abs().max()
        scale = b.detach().float().abs().max().clamp_min(1e-30)
        assert err <= tol * scale, f"{what}: max error {err.item():.3g} vs scale {scale.item():.3g}"


def _torch_state(opt, key):
    return [opt.state[p][key] for g in opt.param_groups for p in g["params"]]


CASES = {
    "adamw": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam": (fo.Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "sgd": (fo.SGD, torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum": (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1,
                                                   weight_decay=0.01)),
    "sgd_nesterov": (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_optim_fp32(case):
    ours_cls, ref_cls, kwargs = CASES[case]
    ours, ref = make_mlp(), make_mlp()
    opt = ours_cls(ours.parameters(), compile=False, **kwargs)
    ref_opt = ref_cls(ref.parameters(), **kwargs)
    train(ours, opt, STEPS)
    train(ref, ref_opt, STEPS)
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, case)
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if key in ref_opt.state[ref[0].weight]:
            assert_rel(_torch_state(opt, key), _torch_state(ref_opt, key), 1e-6, key)


def _two_groups(model, **kwargs):
    return [{"params": model[0].parameters(), "lr": 2e-2, **kwargs},
            {"params": model[2].parameters(), "weight_decay": 0.0}]


def test_compiled_adamw_with_two_groups_matches_torch():
    ours, ref = make_mlp(), make_mlp()
    opt = fo.AdamW(_two_groups(ours), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(_two_groups(ref), lr=1e-2, weight_decay=0.1)
    train(ours, opt, STEPS)
    train(ref, ref_opt, STEPS)
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, "compiled")


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "inductor"])
def test_o2_bf16_with_masters_tracks_fp32(compile):
    ours, ref = make_mlp(torch.bfloat16), make_mlp()
    opt = fo.AdamW(ours.parameters(), lr=1e-3, compile=compile)
    train(ours, opt, STEPS, scaler=fo.LossScaler(compile=compile))
    train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), STEPS)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    masters = [s["master_param"] for s in opt.state.values()]
    assert all(m.dtype == torch.float32 for m in masters)
    for m, r in zip(masters, ref.parameters()):
        assert (m - r).norm() <= 1e-2 * r.norm()
    loss, ref_loss = loss_of(ours, STEPS), loss_of(ref, STEPS)
    assert abs(loss - ref_loss) <= 1e-3 * ref_loss
    # the model holds the masters rounded to bf16
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(ours.parameters(), masters))


def test_clipping_matches_clip_grad_norm_with_a_static_scale():
    ours, ref = make_mlp(), make_mlp()
    opt = fo.AdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.05, compile=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = fo.LossScaler(1024.0, compile=False)
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(loss_of(ours, step)).backward()
        opt.step(scaler)
        ref_opt.zero_grad()
        loss_of(ref, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-5, atol=0)
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, "clipped")


def test_torch_semantics_match_gradscaler_with_fused_adamw():
    ours, ref = make_mlp(), make_mlp()
    opt = fo.AdamW(ours.parameters(), lr=1e-2, compile=False)
    scaler = fo.LossScaler(semantics="torch", growth_interval=4, compile=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    gs = torch.amp.GradScaler("cpu", growth_interval=4)
    bad = {3: float("inf"), 9: float("nan")}
    for step in range(STEPS):
        for model, o, s in ((ours, opt, scaler), (ref, ref_opt, gs)):
            o.zero_grad()
            s.scale(loss_of(model, step)).backward()
            if step in bad:
                model[0].weight.grad[1, 2] = bad[step]
            o.step(s) if s is scaler else (s.step(o), s.update())
        assert scaler.get_scale() == gs.get_scale()
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, "vs GradScaler")


def _reference_lamb(model, steps, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, wd=0.01, max_norm=1.0):
    params = list(model.parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step in range(1, steps + 1):
        for p in params:
            p.grad = None
        loss_of(model, step - 1).backward()
        norm = torch.cat([p.grad.flatten() for p in params]).norm()
        coef = min(1.0, max_norm / (norm.item() + 1e-6))
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                g = p.grad * coef
                m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
                v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                u = (m / (1 - betas[0] ** step)) / ((v / (1 - betas[1] ** step)).sqrt() + eps)
                u = u + wd * p
                pn, un = p.norm(), u.norm()
                ratio = pn / un if pn > 0 and un > 0 else 1.0
                p.sub_(lr * ratio * u)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "inductor"])
def test_lamb_matches_a_per_tensor_reference(compile):
    ours, ref = make_mlp(), make_mlp()
    train(ours, fo.LAMB(ours.parameters(), lr=1e-2, compile=compile), STEPS)
    _reference_lamb(ref, STEPS)
    assert_rel(ours.parameters(), ref.parameters(), 2e-6, "LAMB")


def test_bf16_without_masters_updates_the_model_directly():
    model = make_mlp(torch.bfloat16)
    start = copy.deepcopy(model)
    opt = fo.AdamW(model.parameters(), lr=1e-2, master_weights=False, compile=False)
    train(model, opt, 3)
    assert all(b.master is None for b in opt.buckets)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(model[0].weight, start[0].weight)


def test_gradient_accumulation_over_micro_batches():
    ours, ref = make_mlp(), make_mlp()
    opt = fo.AdamW(ours.parameters(), lr=1e-3, compile=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler = fo.LossScaler(compile=False)
    for step in range(5):
        opt.zero_grad()
        for micro in range(3):  # three backward passes, one step
            scaler.scale(loss_of(ours, 10 * step + micro) / 3).backward()
        opt.step(scaler)
        ref_opt.zero_grad()
        sum(loss_of(ref, 10 * step + micro) / 3 for micro in range(3)).backward()
        ref_opt.step()
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, "accumulated")


def test_tensor_lr_and_scaler_from_an_opt_level():
    from fxamp.config import AmpConfig

    ours, ref = make_mlp(), make_mlp()
    opt = fo.SGD(ours.parameters(), lr=torch.tensor(0.05), compile=False)
    scaler = fo.LossScaler.from_config(AmpConfig.from_opt_level("O2", loss_scale=128.0),
                                       compile=False)
    assert scaler.get_scale() == 128.0 and not scaler.dynamic
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        opt.param_groups[0]["lr"].fill_(0.05 / (step + 1))  # what schedulers do to tensor lrs
        ref_opt.param_groups[0]["lr"] = 0.05 / (step + 1)
        train(ours, opt, 1, scaler, start=step)
        train(ref, ref_opt, 1, start=step)
    assert_rel(ours.parameters(), ref.parameters(), 1e-6, "tensor lr")
