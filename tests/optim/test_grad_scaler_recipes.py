"""torch's "Automatic Mixed Precision examples" recipes, run with torch.amp.GradScaler("cpu")
and with fxamp.LossScaler(semantics="torch") swapped in, fp16 autocast on CPU, same seeds.

Each recipe runs 8 iterations with inf or nan injected into the input at iterations 2 and 5 (a
NaN loss, every gradient non-finite) and a growth interval of 2, so the scale backs off and
grows (some recipes also overflow fp16 on their own at the first scale, 2**16). Checked: the
same iterations are skipped (weights bit-identical across them), the scale after every
iteration is the same, and the weights at the end:
- with the same torch.optim optimizer on both sides: bit-identical (the same unscale kernel and
  the same scale: the LossScaler does what GradScaler does);
- with fxamp's fused optimizers (the step as one compiled graph pair, eager here) against
  torch.optim's: within 1e-6 of each tensor's largest magnitude (fp32 weights; measured
  <= 1.6e-7: the order of a few fp32 roundings in the update, as in test_numerics.py).
"""

import pytest
import torch
import torch.nn.functional as F

import fxamp
import fxamp.optim as fo

STEPS, BAD = 8, {2: float("inf"), 5: float("nan")}
TOL = 1e-6


def _models(n):
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            for _ in range(n)]


def _data(step):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    if step in BAD:
        x[0, 0] = BAD[step]
    return x, y


def _autocast():
    return torch.autocast("cpu", dtype=torch.float16)


def typical(models, opts, scaler, step):
    (model,), (opt,) = models, opts
    x, y = _data(step)
    opt.zero_grad()
    with _autocast():
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def clipping(models, opts, scaler, step):
    (model,), (opt,) = models, opts
    x, y = _data(step)
    opt.zero_grad()
    with _autocast():
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    scaler.step(opt)
    scaler.update()


def accumulation(models, opts, scaler, step, iters=2):
    (model,), (opt,) = models, opts
    for i in range(iters):
        x, y = _data(step + 100 * i)  # the injected inf/nan in the first micro-batch
        with _autocast():
            loss = F.mse_loss(model(x), y) / iters
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def gradient_penalty(models, opts, scaler, step):
    (model,), (opt,) = models, opts
    x, y = _data(step)
    opt.zero_grad()
    with _autocast():
        loss = F.mse_loss(model(x), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()),
                                       create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with _autocast():
        loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def multiple(models, opts, scaler, step):
    x, y = _data(step)
    for opt in opts:
        opt.zero_grad()
    with _autocast():
        out0, out1 = models[0](x), models[1](x)
        loss0 = F.mse_loss(2 * out0 + 3 * out1, y)
        loss1 = F.mse_loss(3 * out0 - 5 * out1, y)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(opts[0])  # as in the recipe: e.g. to clip opts[0]'s gradients
    scaler.step(opts[0])
    scaler.step(opts[1])
    scaler.update()


RECIPES = {"typical": (typical, 1), "clipping": (clipping, 1), "accumulation": (accumulation, 1),
           "gradient_penalty": (gradient_penalty, 1), "multiple": (multiple, 2)}
OPTIMIZERS = {
    "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "torch_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "fxamp_adamw": lambda ps: fo.AdamW(ps, lr=1e-2, compile=False),
    "fxamp_sgd": lambda ps: fo.SGD(ps, lr=0.05, momentum=0.9, compile=False),
}
REFERENCE = {"torch_adamw": "torch_adamw", "torch_sgd": "torch_sgd",
             "fxamp_adamw": "torch_adamw", "fxamp_sgd": "torch_sgd"}


def _run(recipe, optimizer, scaler):
    fn, n = RECIPES[recipe]
    models = _models(n)
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in models]
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for m in models for p in m.parameters()]
        fn(models, opts, scaler, step)
        after = [p.detach() for m in models for p in m.parameters()]
        skipped.append(all(torch.equal(a, b) for a, b in zip(after, before)))
        scales.append(scaler.get_scale())
    return [p.detach() for m in models for p in m.parameters()], scales, skipped


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_gradscaler(recipe, optimizer):
    ours = fxamp.LossScaler(semantics="torch", growth_interval=2, compile=False)
    ref = torch.amp.GradScaler("cpu", growth_interval=2)
    weights, scales, skipped = _run(recipe, optimizer, ours)
    ref_weights, ref_scales, ref_skipped = _run(recipe, REFERENCE[optimizer], ref)
    assert skipped == ref_skipped and all(skipped[s] for s in BAD)
    assert scales == ref_scales
    assert ours.skipped_steps.item() == sum(skipped)
    assert all(torch.isfinite(w).all() for w in weights)
    if optimizer == REFERENCE[optimizer]:
        assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    else:
        for a, b in zip(weights, ref_weights):
            assert (a - b).abs().max() <= TOL * b.abs().max(), recipe
