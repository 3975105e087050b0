"""`fxamp.optim.LARC`: Apex's `apex.parallel.LARC` (trust-ratio clipping or scaling of each
parameter's learning rate) inside the fused step, against a float64 transcription of Apex's
`LARC.step`."""

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot, train

import fxamp.optim as fo
from fxamp import ConfigError


def apex_larc_sgd(model, steps, *, lr, momentum, weight_decay, trust_coefficient, clip, eps):
    """Apex's LARC.step around torch.optim.SGD, in float64: per parameter, when both norms
    are non-zero, adaptive_lr = tc * |w| / (|g| + |w| * wd + eps), clipped to lr
    (min(adaptive_lr / lr, 1)) with clip=True; g = (g + wd * w) * adaptive_lr; then SGD with
    weight_decay=0 (LARC takes the decay over)."""
    model = model.double()
    bufs = {}
    for step in range(steps):
        model.zero_grad()
        loss_of(model, step).backward()
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad.clone()
                w_norm, g_norm = p.norm(), g.norm()
                if w_norm != 0 and g_norm != 0:
                    adaptive = trust_coefficient * w_norm / (g_norm + w_norm * weight_decay + eps)
                    if clip:
                        adaptive = min(adaptive / lr, 1)
                    g = (g + weight_decay * p) * adaptive
                if momentum:
                    bufs[p] = g if p not in bufs else momentum * bufs[p] + g
                    g = bufs[p]
                p -= lr * g
    return model


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-2)])
def test_larc_matches_apex_formula_in_float64(clip, momentum, weight_decay):
    """fp32 fused step vs the float64 transcription over 6 steps: within 1e-5 of each tensor's
    largest value. tc=0.02 (Apex's default) with lr=0.05: at the first step the local lr is
    above lr for three tensors (clipped to it) and below for the last bias (ratios 2.8, 5.6,
    1.3, 0.56). Measured 1.6e-7; plain SGD ends 0.15-0.6 away."""
    kw = dict(lr=0.05, momentum=momentum, weight_decay=weight_decay)
    larc = dict(trust_coefficient=0.02, clip=clip, eps=1e-8)
    model = make_mlp()
    opt = fo.LARC(fo.SGD(model.parameters(), compile=False, **kw), **larc)
    assert isinstance(opt, fo.SGD) and opt.larc.trust_coefficient == 0.02
    train(model, opt, 6)
    ref = apex_larc_sgd(make_mlp(), 6, **kw, **larc)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.double(), r, rtol=0, atol=1e-5 * r.abs().max().item())
    assert opt.param_groups[0]["weight_decay"] == weight_decay  # the group keeps its decay


def test_larc_changes_the_step():
    """The formula is applied at all: plain SGD ends elsewhere."""
    model, plain = make_mlp(), make_mlp()
    train(model, fo.LARC(fo.SGD(model.parameters(), lr=0.5, compile=False)), 3)
    train(plain, fo.SGD(plain.parameters(), lr=0.5, compile=False), 3)
    assert not torch.allclose(model[0].weight, plain[0].weight, rtol=0, atol=1e-4)


def test_apex_flow_larc_then_initialize_at_o2():
    """Apex: `optimizer = LARC(torch.optim.SGD(...))`, then `amp.initialize(model, optimizer,
    opt_level="O2")`: bf16 weights, fp32 masters, LARC in the compiled step. Against the
    float64 reference: bf16 inputs and forward put it within 2e-2 of each tensor's largest
    value (measured 5.3e-3; the same O2 run without LARC is 5.3e-3 from plain SGD in float64)."""
    kw = dict(lr=0.5, momentum=0.9, weight_decay=1e-2)
    model = make_mlp()
    opt = fo.LARC(torch.optim.SGD(model.parameters(), **kw), trust_coefficient=0.02)
    model, opt = fo.initialize(model, opt, opt_level="O2")
    assert isinstance(opt, fo.SGD) and opt.larc.trust_coefficient == 0.02
    for step in range(4):
        opt.zero_grad()
        with fo.scale_loss(loss_of(model, step), opt) as scaled:
            scaled.backward()
        opt.step()
    ref = apex_larc_sgd(make_mlp(), 4, **kw, trust_coefficient=0.02, clip=True, eps=1e-8)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.double(), r, rtol=0, atol=2e-2 * r.abs().max().item())
    before = snapshot(opt)
    opt.zero_grad()
    with fo.scale_loss(loss_of(model, 9), opt) as scaled:
        scaled.backward()
    model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)


@pytest.mark.parametrize("inner", ["adam", "lamb"])
def test_larc_wraps_the_other_rules(inner):
    """Adam (the decay taken over by LARC, as Apex zeroed group['weight_decay']) and LAMB
    step and keep their states."""
    model = make_mlp()
    base = (fo.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2, compile=False)
            if inner == "adam" else fo.LAMB(model.parameters(), lr=1e-2, compile=False))
    opt = fo.LARC(base, clip=False)
    train(model, opt, 2)
    assert opt.state[model[0].weight]["exp_avg"].abs().sum() > 0
    assert torch.isfinite(model[0].weight).all()


@pytest.mark.parametrize("make,words", [
    (lambda m: fo.LARC(fo.SGD(m.parameters(), compile=False)), ["already steps with LARC"]),
    (lambda m: torch.optim.RMSprop(m.parameters()), ["RMSprop", "SGD"]),
    (lambda m: fo.SGD(m.parameters(), compile=False), None),
])
def test_larc_refusals_change_nothing(make, words):
    model = make_mlp()
    opt = make(model)
    if words is None:  # bad settings
        for bad, word in [(dict(trust_coefficient=-1.0), "trust_coefficient=-1.0"),
                          (dict(eps=float("nan")), "eps=nan"), (dict(clip="yes"), "clip='yes'")]:
            with pytest.raises(ConfigError, match=word):
                fo.LARC(opt, **bad)
            assert opt.larc is None
        return
    before = None if not isinstance(opt, fo.SGD) else (snapshot(opt), opt.algorithm, opt.larc)
    with pytest.raises(ConfigError) as e:
        fo.LARC(opt)
    for word in words:
        assert word in str(e.value)
    if before is not None:
        assert bit_identical(snapshot(opt), before[0])
        assert (opt.algorithm, opt.larc) == before[1:]
