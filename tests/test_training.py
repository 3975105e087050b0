"""Training with fxamp tracks fp32 training: every example model, O1/O2/O3, bf16 and fp16.

Tolerance (stated, and why): over 5 SGD steps the loss stays within 3 % (bf16) or 1 % (fp16)
of the fp32 run's, relative. bf16 keeps 8 mantissa bits (rounding 2**-9 ~ 0.2 % per op), fp16
11 (2**-12); matmuls, activations and, at O2/O3 without master weights, the SGD update itself
are rounded every step, so a few rounding units per layer accumulate. Measured here: at most
1.1e-2 (cnn, O1, bf16: lr 0.05 moves its loss by 2.0 in 5 steps) and 1.6e-3 for fp16, so the
bounds hold with 3x / 6x margin yet fail on a wrong cast (a gradient lost, a model left fp32
where it should be 16-bit shows 0 difference and fails the dtype tests instead).
The matrix runs eagerly (compiler="aot_eager": the same graphs, no Inductor compile) and
two cases go through Inductor to check the compiled kernels agree.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import fxamp
from examples import models

STEPS = 5
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def _loss(name, out, target):
    out = out.float()
    return F.mse_loss(out, target) if name == "attention" else F.cross_entropy(out, target)


def _data(name, inputs, out_features):
    gen = torch.Generator().manual_seed(1)
    x = inputs[0]
    if name == "attention":
        return x, torch.randn(x.shape, generator=gen)
    return x, torch.randint(0, out_features, (x.shape[0],), generator=gen)


def _train(name, model, x, target, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        loss = _loss(name, model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(name):
    model, inputs = getattr(models, name)()
    out_features = model(*inputs).shape[-1]
    x, target = _data(name, inputs, out_features)
    return model, x, target, _train(name, copy.deepcopy(model), x, target)


@pytest.fixture(scope="module")
def references():
    return {name: _reference(name) for name in ("mlp", "cnn", "attention")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "attention"])
def test_training_tracks_fp32(references, name, opt_level, dtype):
    model, x, target, expected = references[name]
    compiled = fxamp.compile(copy.deepcopy(model), opt_level=opt_level, dtype=dtype,
                             compiler="aot_eager")
    losses = _train(name, compiled, x, target)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected)]
    assert max(rel) <= TOLERANCE[dtype], (losses, expected)


@pytest.mark.parametrize("name,opt_level", [("mlp", "O1"), ("cnn", "O2")])
def test_training_through_inductor(references, name, opt_level):
    model, x, target, expected = references[name]
    compiled = fxamp.compile(copy.deepcopy(model), opt_level=opt_level)
    losses = _train(name, compiled, x, target)
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, expected)]
    assert max(rel) <= TOLERANCE[torch.bfloat16], (losses, expected)


def test_o1_gradients_reach_fp32_params(references):
    model, x, target, _ = references["mlp"]
    compiled = fxamp.compile(copy.deepcopy(model), opt_level="O1", compiler="aot_eager")
    _loss("mlp", compiled(x), target).backward()
    for name, param in compiled.named_parameters():
        assert param.dtype == torch.float32 and param.grad.dtype == torch.float32, name
        assert param.grad.abs().sum() > 0, name


def _classifier():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 16, generator=gen) * 3, torch.randint(0, 10, (32,), generator=gen)


def test_a_loss_module_outside_the_model_at_o1_fp16_trains_as_under_autocast():
    # Note [O1's outputs are fp32]: the loss a plain loop computes on the output (here
    # nn.CrossEntropyLoss, outside what fxamp compiled) is fp32, as under torch.autocast, so
    # GradScaler's first scale (2**16) is taken, not skipped by construction: the reference is
    # autocast fp16 + torch.amp.GradScaler("cpu") + torch.optim.SGD on the same loop.
    base, x, y = _classifier()
    criterion = torch.nn.CrossEntropyLoss()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, ref_scaler = torch.optim.SGD(ref.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    fxamp.compile(model, opt_level="O1", dtype=torch.float16, compiler="aot_eager")
    opt, scaler = fxamp.optim.SGD(model.parameters(), lr=0.1), fxamp.LossScaler(semantics="torch")
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = criterion(ref(x), y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt), ref_scaler.update(), ref_opt.zero_grad()
        out = model(x)
        loss = criterion(out, y)
        assert out.dtype == loss.dtype == torch.float32
        scaler.scale(loss).backward()
        opt.step(scaler), opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-3 * ref_loss.item()
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0 ** 16  # no step skipped
    assert int(scaler.skipped_steps) == 0
    # fp16 GEMMs on both sides, summed in another order: within 1 % of how far SGD moved them
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), base.parameters()):
        assert (p - q).norm() <= 1e-2 * (q - p0).norm(), name


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_cast_model_outputs_false_leaves_the_outputs_as_computed(level):
    model, x, _ = _classifier()
    fxamp.compile(model, opt_level=level, cast_model_outputs=False, compiler="aot_eager")
    assert model(x).dtype == torch.bfloat16  # the last linear's, not O1/O2's fp32
