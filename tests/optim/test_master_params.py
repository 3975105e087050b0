"""`amp.master_params(opt)` as Apex defined it, at every opt level.

Apex yielded the tensors the optimizer steps, in the optimizer's parameter order (fp32 masters
at O2, the model's own parameters at O0/O1/O3, 16-bit ones included), with unscaled
gradients, so `clip_grad_norm_(amp.master_params(opt), max_norm)` works at every level and
code may pair them with `model.parameters()` by position. The gradients it gathers are the
model's gradients at that moment: if those are then dropped (`model.zero_grad()`, `p.grad =
None`) the next step must not apply them.
"""

import pytest
import torch
import torch.nn.functional as F
from optim_helpers import batch, loss_of, make_mlp

import fxamp.optim as fo

pytest.importorskip("fxamp.backend")

LOW = [torch.bfloat16, torch.float16]


def _init(model, opt, **kw):
    return fo.initialize(model, opt, compiler="aot_eager", **kw)


def _backward(model, opt, step):
    with fo.scale_loss(loss_of(model, step), opt) as scaled:
        scaled.backward()


def _bn_mlp(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # frozen, but in the optimizer's group
    return model


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("level", [dict(opt_level="O3", loss_scale=128.0),
                                   dict(opt_level="O0", loss_scale=128.0)])
def test_sixteen_bit_params_without_masters_are_yielded_and_clipped(dtype, level):
    """O3, and O0 with a 16-bit cast_model_type: Apex yielded the 16-bit params with their
    unscaled 16-bit gradients; clipping them clips the step (SGD: w - lr * clipped g)."""
    model = make_mlp()
    extra = {"cast_model_type": dtype} if level["opt_level"] == "O0" else {"dtype": dtype}
    _, opt = _init(model, torch.optim.SGD(model.parameters(), lr=0.5), **level, **extra)
    assert all(p.dtype == dtype for p in model.parameters())
    _backward(model, opt, 0)
    raw = [p.grad.double() for p in model.parameters()]  # unscaled by the exit, as in Apex
    before = [p.double() for p in model.parameters()]
    masters = list(fo.master_params(opt))
    assert [m.dtype for m in masters] == [dtype] * 4
    assert [m.shape for m in masters] == [p.shape for p in model.parameters()]
    tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=2 ** -10, atol=0)
    for m, g in zip(masters, raw):
        torch.testing.assert_close(m.grad.double(), g, **tol)
    total = torch.cat([g.flatten() for g in raw]).norm()
    norm = torch.nn.utils.clip_grad_norm_(masters, 0.1)
    torch.testing.assert_close(norm.double(), total, rtol=1e-2, atol=0)
    opt.step()
    coef = min(1.0, 0.1 / (total.item() + 1e-6))
    for p, w, g in zip(model.parameters(), before, raw):
        expected = w - 0.5 * coef * g
        # one rounding of the update into the 16-bit weight, one of the clipped gradient
        torch.testing.assert_close(p.double(), expected, rtol=2 * tol["rtol"], atol=1e-3)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_master_params_follow_the_optimizers_parameter_order(opt_level):
    """O2 keeps BatchNorm fp32 between bf16 Linears: the buckets are per dtype, but Apex kept
    the param groups' order (frozen parameters included), which code zips with
    model.parameters()."""
    model = _bn_mlp()
    kw = dict(loss_scale="dynamic") if opt_level == "O0" else {}
    _, opt = _init(model, torch.optim.AdamW(model.parameters(), lr=1e-3), opt_level=opt_level,
                   **kw)
    x, y = batch(0)
    with fo.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    masters = list(fo.master_params(opt))
    assert [m.shape for m in masters] == [p.shape for p in model.parameters()]
    assert masters[1] is model[0].bias and masters[1].grad is None  # the frozen one, itself
    trained = [m for m, p in zip(masters, model.parameters()) if p.requires_grad]
    assert all(m.dtype == torch.float32 and m.grad is not None for m in trained)
    for m, p in zip(trained, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(m.detach().to(p.dtype), p.detach(), rtol=0, atol=0)


def _pair(level, dtype=torch.float32):
    """A model + optimizer from initialize, and an identical reference pair."""
    out = []
    for _ in range(2):
        model = make_mlp()
        out.append(_init(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **level))
    return out


def _drop(model, how):
    if how == "set_to_none":
        model.zero_grad(set_to_none=True)
    elif how == "in_place":
        model.zero_grad(set_to_none=False)
    else:
        for p in model.parameters():
            p.grad = None


LEVELS = [dict(opt_level="O0", loss_scale="dynamic"), dict(opt_level="O2")]


@pytest.mark.parametrize("level,how", [
    (LEVELS[0], "set_to_none"), (LEVELS[0], "in_place"), (LEVELS[1], "in_place"),
    (LEVELS[1], "grad_none")], ids=["O0-set_to_none", "O0-in_place", "O2-in_place",
                                    "O2-grad_none"])
def test_gathered_gradients_do_not_survive_model_zero_grad(level, how):
    """master_params, then no step, then the model's gradients are dropped: the next step
    applies only the new gradients (Apex's master grads were the model's, unscaled)."""
    (model, opt), (ref, ref_opt) = _pair(level)
    _backward(model, opt, 0)
    norm = torch.nn.utils.clip_grad_norm_(fo.master_params(opt), 1e9)  # looked at, dropped
    assert norm > 0
    _drop(model, how)
    _backward(model, opt, 1)
    opt.step()
    _backward(ref, ref_opt, 1)
    ref_opt.step()
    _assert_same_weights(opt, ref_opt)


def _assert_same_weights(opt, ref_opt, atol=0.0):
    # The fp32 weights the step wrote (masters at O2): bf16 model weights could hide a change.
    for b, r in zip(opt.buckets, ref_opt.buckets):
        torch.testing.assert_close(b.weights, r.weights, rtol=0, atol=atol)


@pytest.mark.parametrize("level", LEVELS, ids=["O0", "O2"])
def test_gradients_accumulated_after_master_params_all_count(level):
    """master_params between two backward passes of one step (gradient accumulation): the
    step applies both, as Apex's stashed master grads did."""
    (model, opt), (ref, ref_opt) = _pair(level)
    _backward(model, opt, 0)
    list(fo.master_params(opt))
    _backward(model, opt, 1)
    opt.step()
    _backward(ref, ref_opt, 0)
    _backward(ref, ref_opt, 1)
    ref_opt.step()
    # At O2 the two bf16 gradients may be summed before or after unscaling into fp32 (Apex
    # added the new one to its stashed fp32 master grads): a rounding apart (measured 1.5e-8),
    # where a lost or doubled gradient moves the weights by ~lr = 1e-2.
    _assert_same_weights(opt, ref_opt, atol=1e-6)


@pytest.mark.parametrize("level", LEVELS, ids=["O0", "O2"])
def test_clipping_through_master_params_is_the_step(level):
    """The Apex idiom: backward, clip the master grads, step; equal to max_grad_norm's
    clipping inside the fused step."""
    (model, opt), (ref, ref_opt) = _pair(level)
    ref_opt.max_grad_norm = 1e-2
    for step in range(3):
        opt.zero_grad()
        _backward(model, opt, step)
        torch.nn.utils.clip_grad_norm_(fo.master_params(opt), 1e-2)
        opt.step()
        ref_opt.zero_grad()
        _backward(ref, ref_opt, step)
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
