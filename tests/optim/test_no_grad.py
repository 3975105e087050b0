"""A parameter whose `.grad` is None at step() is left alone, as torch.optim leaves it: weights,
masters and states keep every bit (Note [A parameter without a gradient] in buffers/flat.py).

Side by side with torch.optim in fp32 over 3 steps: `head_a` gets no gradient on step 2,
`head_b` never gets one. fxamp counts steps per param group (the group's count advances on
step 2), torch.optim per parameter (head_a's stays at 1): so for Adam and AdamW the torch
reference's step of head_a is set to the group's after step 2, which leaves the rest of the
comparison exact (SGD has no step count in its update).
"""

import pytest
import torch
from optim_helpers import bit_identical, snapshot

import fxamp.optim as fo

TOL = 1e-6  # relative to each tensor's largest magnitude, as test_numerics.py


class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(6, 5)
        self.head_a = torch.nn.Linear(5, 3)
        self.head_b = torch.nn.Linear(5, 3)

    def forward(self, x, use_a=True):
        z = torch.tanh(self.body(x))
        out = z.square().mean()
        return out + self.head_a(z).square().mean() if use_a else out


def _loss(model, step):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
    return model(x.to(model.body.weight.dtype), use_a=step != 1)


CASES = {"AdamW": (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
         "Adam": (fo.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
         "SGD": (fo.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1,
                                               weight_decay=0.1, nesterov=False))}


def _run(make, model, steps=3, scheduled=False, align_steps=False, **kw):
    opt = make(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduled else None
    history = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        if align_steps and step == 1 and "step" in opt.state[model.head_a.weight]:
            for p in model.head_a.parameters():  # fxamp's count is the group's (module doc)
                opt.state[p]["step"] += 1
        if sched is not None:
            sched.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return opt, history


def _close(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    assert ((got - want).abs().max() / scale).item() <= TOL


@pytest.mark.parametrize("scheduled", [False, True], ids=["constant-lr", "StepLR"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_with_a_parameter_skipped_and_one_never_stepped(name, scheduled):
    ours_cls, torch_cls, kw = CASES[name]
    ours_model, ref_model = Heads(), Heads()
    initial = [p.detach().clone() for p in ref_model.parameters()]
    ours, ours_hist = _run(lambda p, **k: ours_cls(p, compile=False, **k), ours_model,
                           scheduled=scheduled, **kw)
    ref, ref_hist = _run(torch_cls, ref_model, scheduled=scheduled,
                         align_steps=name != "SGD", **kw)
    for got_step, want_step in zip(ours_hist, ref_hist):
        for got, want in zip(got_step, want_step):
            _close(got, want)
    names = [n for n, _ in ours_model.named_parameters()]
    a_w, a_b = names.index("head_a.weight"), names.index("head_a.bias")
    for i in (a_w, a_b):  # step 2 (index 1) left head_a as step 1 left it
        assert torch.equal(ours_hist[1][i], ours_hist[0][i])
    for p, p0, q in zip(ours_model.head_b.parameters(), initial[-2:],
                        ref_model.head_b.parameters()):
        assert torch.equal(p, p0) and torch.equal(q, p0) and p.grad is None
        assert q not in ref.state  # torch never made state for it; fxamp's is still zero
        assert all(not v.any() for k, v in ours.state[p].items() if k != "step")
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        for key, value in ref.state[q].items() if q in ref.state else ():
            if key != "step":
                _close(ours.state[p][key], value)


def test_skipped_step_leaves_states_bit_identical_when_a_parameter_had_no_gradient():
    model = Heads()
    opt = fo.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.head_a.parameters()]
    states = {k: v.clone() for k, v in opt.state[model.head_a.weight].items()}
    opt.zero_grad()
    _loss(model, 1).backward()  # head_a and head_b get no gradient
    assert model.head_a.weight.grad is None and model.body.weight.grad is not None
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.head_a.parameters(), before))
    assert all(torch.equal(opt.state[model.head_a.weight][k], v) for k, v in states.items()
               if k != "step")
    scaler = fo.LossScaler("dynamic")
    opt.zero_grad()
    scaler.scale(_loss(model, 1)).backward()
    model.body.weight.grad[0, 0] = float("inf")
    snap = snapshot(opt)
    opt.step(scaler)
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), snap)


@pytest.mark.parametrize("cls,kw", [(fo.LAMB, {}), (fo.AdamW, {"state_format": "low_memory"})],
                         ids=["LAMB", "AdamW-low_memory"])
def test_other_rules_and_formats_leave_it_alone(cls, kw):
    model = Heads().to(torch.bfloat16) if kw else Heads()
    opt = cls(model.parameters(), lr=1e-2, compile=False, **kw)
    heads = list(model.head_a.parameters())
    for step in (0, 1):
        opt.zero_grad()
        _loss(model, step).float().backward()
        if step == 0:  # after this step's backward, head_a has no gradient on the next
            opt.step()
            kept = [[t.detach().clone() for t in (p, *_tensors(opt.state[p]))] for p in heads]
            body = model.body.weight.detach().clone()
            continue
        assert all(p.grad is None for p in heads)
        opt.step()
    for p, before in zip(heads, kept):
        assert bit_identical([t.detach() for t in (p, *_tensors(opt.state[p]))], before)
    assert not torch.equal(model.body.weight, body)
    blocks = opt._device_state.slots[0].grad_mask()
    assert blocks.any() and not blocks.all() and blocks.dtype == torch.float32


def _tensors(state):
    return [v for k, v in sorted(state.items()) if k != "step" and isinstance(v, torch.Tensor)]


def test_grad_is_none_after_zero_grad_and_the_flat_view_after_backward():
    model = Heads()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _loss(model, 0).backward()
    flat = opt.buckets[0].grad
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(start <= p.grad.data_ptr() < end for p in model.body.parameters())
    assert model.head_b.weight.grad is None
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_a_gradient_dropped_by_model_zero_grad_counts_as_none():
    """model.zero_grad() drops head_a's gradient: the stale values left in the flat buffer must
    neither step it nor enter the clipping norm (compared with torch's clip_grad_norm_)."""
    ours_model, ref_model = Heads(), Heads()
    ours = fo.SGD(ours_model.parameters(), lr=0.1, max_grad_norm=0.05, compile=False)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for model, opt in ((ours_model, ours), (ref_model, ref)):
        for step in (0, 1):
            model.zero_grad()
            _loss(model, step).backward()
            if opt is ref:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
    for p, q in zip(ours_model.parameters(), ref_model.parameters()):
        _close(p.detach(), q.detach())


def test_compiled_step_skips_a_parameter_without_gradient():
    ours_model, ref_model = Heads(), Heads()
    _, ours_hist = _run(fo.AdamW, ours_model, lr=1e-2)
    _, ref_hist = _run(torch.optim.AdamW, ref_model, align_steps=True, lr=1e-2)
    for got, want in zip(ours_hist[-1], ref_hist[-1]):
        _close(got, want)


def test_a_dropped_optimizer_is_freed_while_its_model_lives():
    # the parameters' gradient hooks (Note [A parameter without a gradient]) must not keep
    # the optimizer's buckets (fp32 masters, flat buffers) alive once the user drops it
    import gc
    import weakref

    import fxamp.optim

    model = torch.nn.Linear(8, 8)
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-2, compile=False)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    dropped = [weakref.ref(opt), *map(weakref.ref, opt.buckets)]
    del opt
    gc.collect()
    assert [ref() for ref in dropped] == [None] * len(dropped)
    model(torch.randn(2, 8)).sum().backward()  # the hooks left behind do nothing
    assert model.weight.grad is not None
