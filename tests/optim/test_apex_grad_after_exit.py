"""`.grad` when `scale_loss` exits holds the unscaled gradients, as in Apex (issue 24 item 10).

Apex unscaled at every exit, so Apex scripts read `.grad` right after the block: they clip
`model.parameters()`, log gradient norms, check values. The first test is Apex's L0 cast-cache
test (tests/L0/run_amp/test_cache.py) ported: O1, a module whose op is in the fp16, fp32 or
promote list, an fp16 or fp32 weight, loss scale 4, train / no_grad eval / train, and `.grad`
right after the block against the fp32 gradient (Apex's tolerance: assert_close's default for
the gradient's dtype). The others hold the exit to Apex's rule and to fp32 references: several
losses and scalers, an overflow inside the block still skipping the step, clipping
`model.parameters()` at the exit against torch.optim in fp32, and O2 with fp16 stepping the
exact fp32 sums unless `.grad` was written (Note [.grad after a scale_loss exit]).
"""

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot

import fxamp as amp
import fxamp.optim as fo

pytest.importorskip("fxamp.backend")


class WhitelistModule(torch.nn.Module):  # Apex's names: mm is in the fp16 list
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(8 * 8, dtype=dtype).view(8, 8))

    @staticmethod
    def ops(input, weight):
        return (input.mm(weight)).mm(weight).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


class BlacklistModule(torch.nn.Module):  # pow is in the fp32 list
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(2 * 8, dtype=dtype).view(2, 8))

    @staticmethod
    def ops(input, weight):
        return (input + torch.pow(weight, 2) + torch.pow(weight, 2)).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


class PromoteModule(torch.nn.Module):  # mul promotes
    def __init__(self, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(2 * 8, dtype=dtype).view(2, 8))

    @staticmethod
    def ops(input, weight):
        return ((input * weight) * weight).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


def _reference_grad(x, w, ops):
    w32 = w.detach().clone().float().requires_grad_()
    ops(x.detach().clone().float(), w32).backward()
    return w32.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("module", [WhitelistModule, BlacklistModule, PromoteModule])
def test_apex_cache_grad_after_exit(module, dtype):
    x = torch.ones((2, 8))
    model = module(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", dtype=torch.float16,
                                      verbosity=0, compiler="aot_eager")

    def training_step():
        for param in model.parameters():
            param.grad = None
        loss = model(x).sum()
        optimizer.loss_scalers[0].set_scale(4.0)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        assert len([p.grad for p in model.parameters() if p.grad is not None]) == 1
        assert model.weight.grad.dtype == model.weight.dtype
        torch.testing.assert_close(model.weight.grad.float(),
                                   _reference_grad(x, model.weight, model.ops))
        model.weight.data -= 1.0

    training_step()
    with torch.no_grad():
        model(x).sum()
    training_step()


def _two_models(level, num_losses):
    m0, m1 = make_mlp(), make_mlp(seed=1)
    opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25},
                           {"params": m1.parameters(), "lr": 0.5}], momentum=0.125)
    (m0, m1), opt = fo.initialize([m0, m1], opt, opt_level=level, loss_scale="dynamic",
                                  num_losses=num_losses, compiler="aot_eager", verbosity=0)
    for scaler, scale in zip(opt.loss_scalers, (4.0, 16.0)):
        scaler.set_scale(scale)
    return m0, m1, opt


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("level", ["O0", "O1"])
def test_two_losses_leave_the_unscaled_sum_in_grad(level, num_losses):
    """Apex's test_2models2losses1optimizer shape, `.grad` read after each exit: the first
    model's gradient after the first loss, both after the second (the sum; loss ids 0, 1),
    against fp32 backward passes. O0 exact; O1 bf16 within 2e-2 of the largest gradient."""
    m0, m1, opt = _two_models(level, num_losses)
    r0, r1 = make_mlp(), make_mlp(seed=1)
    ref_opt = torch.optim.SGD([{"params": r0.parameters(), "lr": 0.25},
                               {"params": r1.parameters(), "lr": 0.5}], momentum=0.125)
    tol = dict(rtol=0, atol=0) if level == "O0" else None
    for step in range(2):
        for m in (m0, m1, r0, r1):
            m.zero_grad()
        with fo.scale_loss(loss_of(m0, step), opt, loss_id=0) as scaled:
            scaled.backward()
        loss_of(r0, step).backward()
        _assert_grads(m0, r0, tol)
        with fo.scale_loss(loss_of(m1, step + 10), opt, loss_id=num_losses - 1) as scaled:
            scaled.backward()
        loss_of(r1, step + 10).backward()
        _assert_grads(m0, r0, tol)
        _assert_grads(m1, r1, tol)
        opt.step()
        ref_opt.step()
    assert not opt.last_step_skipped()


def _assert_grads(model, ref, tol):
    for p, r in zip(model.parameters(), ref.parameters()):
        t = tol or dict(rtol=0, atol=2e-2 * r.grad.abs().max().item())
        torch.testing.assert_close(p.grad.float(), r.grad, **t)


def test_an_overflow_inside_the_block_skips_and_halves_the_scale():
    """Apex's tests put the inf into `.grad` inside the block: that exit sees it, halves the
    scale and the step is skipped, every tensor bit-identical."""
    model = make_mlp()
    model, opt = fo.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               opt_level="O0", loss_scale="dynamic", compiler="aot_eager")
    before, scale = snapshot(opt), opt.loss_scalers[0].get_scale()
    with fo.scale_loss(loss_of(model, 0), opt) as scaled:
        scaled.backward()
        model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)
    assert opt.loss_scalers[0].get_scale() == scale / 2


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_clipping_model_parameters_at_the_exit_matches_torch(level):
    """The Apex O1 script: `clip_grad_norm_(model.parameters(), 0.05)` right after the block,
    then `opt.step()`; against torch.optim.SGD in fp32 clipping the same way. The norm it
    returns is the unscaled one (within 1e-6 relative at O0; the O1 forward runs in bf16)."""
    model, ref = make_mlp(), make_mlp()
    model, opt = fo.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               opt_level=level, loss_scale="dynamic", compiler="aot_eager")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        with fo.scale_loss(loss_of(model, step), opt) as scaled:
            scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        loss_of(ref, step).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert ref_norm > 0.05  # the clip acts
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6 if level == "O0" else 2e-2, atol=0)
        opt.step()
        ref_opt.step()
    tol = 1e-6 if level == "O0" else 2e-3
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=tol)


def _o2_fp16_run(unscale_on_exit, clip=None, steps=3):
    model = make_mlp()
    model, opt = fo.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                               opt_level="O2", dtype=torch.float16, compiler="aot_eager")
    for step in range(steps):
        opt.zero_grad()
        # a loss so small that its unscaled fp16 gradients would be subnormal or zero
        with fo.scale_loss(loss_of(model, step) * 2.0**-20, opt,
                           unscale_on_exit=unscale_on_exit) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


def test_o2_fp16_steps_the_exact_fp32_sums_not_the_rounded_grad():
    """At O2 `.grad` (fp16) holds the unscaled gradients rounded, which for this loss flush
    many to zero; Adam steps the fp32 sums the exit kept: bit-identical to the deferred unscale
    (`unscale_on_exit=False`), and the weights moved where the rounded gradient is 0."""
    model, opt = _o2_fp16_run(None)
    deferred, deferred_opt = _o2_fp16_run(False)
    assert bit_identical(snapshot(opt), snapshot(deferred_opt))
    with fo.scale_loss(loss_of(model, 9) * 2.0**-20, opt) as scaled:
        scaled.backward()
    assert (model[0].weight.grad == 0).float().mean() > 0.1  # the rounded copy lost them


def test_o2_a_clip_of_model_parameters_is_stepped():
    """A write to `.grad` after the exit (clipping the model's fp16 gradients) is what the
    step takes: it differs from the unclipped run, and equals the deferred path given the same
    clipped gradients through `fxamp.optim.unscale_` (which rounds to fp16 as well)."""
    clipped, clipped_opt = _o2_fp16_run(None, clip=1e-7, steps=1)
    free, free_opt = _o2_fp16_run(None, steps=1)
    assert not bit_identical(snapshot(clipped_opt), snapshot(free_opt))
    model = make_mlp()
    model, opt = fo.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                               opt_level="O2", dtype=torch.float16, compiler="aot_eager")
    with fo.scale_loss(loss_of(model, 0) * 2.0**-20, opt, unscale_on_exit=False) as scaled:
        scaled.backward()
    fo.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-7)
    opt.step()
    assert bit_identical(snapshot(opt), snapshot(clipped_opt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_exit_unscale_equals_the_eager_one(dtype):
    """`unscale_grads` through torch.compile (the optimizer's own compiled functions): `.grad`
    after the first exit bit-identical to the eager function's (a power-of-two scale divides
    exactly), and after two steps the weights as close as test_compile.py holds the compiled
    step to the eager one (1e-5 relative; bf16: assert_close's default, about 1 ulp)."""
    results = []
    for compile in (True, False):
        model = make_mlp(dtype)
        opt = fo.AdamW(model.parameters(), lr=1e-2, compile=compile)
        opt.set_loss_scalers([fo.LossScaler()])
        grads = None
        for step in range(2):
            opt.zero_grad()
            with fo.scale_loss(loss_of(model, step), opt) as scaled:
                scaled.backward()
            grads = grads or [p.grad.clone() for p in model.parameters()]
            opt.step()
        results.append((grads, [p.detach().clone() for p in model.parameters()]))
    assert bit_identical(results[0][0], results[1][0])
    tol = {} if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, **tol)


def test_a_wrapped_optimizer_gets_the_unscaled_sum_in_grad_too():
    """A torch optimizer with no fused counterpart (RMSprop: FP16_Optimizer) at O0: after two
    exits `.grad` is the unscaled sum and three steps equal torch.optim.RMSprop in fp32 exactly
    (power-of-two scales divide exactly)."""
    model, ref = make_mlp(), make_mlp()
    model, opt = fo.initialize(model, torch.optim.RMSprop(model.parameters(), lr=1e-3),
                               opt_level="O0", loss_scale="dynamic", compiler="aot_eager")
    assert isinstance(opt, fo.FP16_Optimizer)
    ref_opt = torch.optim.RMSprop(ref.parameters(), lr=1e-3)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in (step, step + 5):
            with fo.scale_loss(loss_of(model, k), opt) as scaled:
                scaled.backward()
        (loss_of(ref, step) + loss_of(ref, step + 5)).backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)
        opt.step()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=0)
