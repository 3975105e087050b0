"""Tiny models, data and a training loop shared by the optimizer tests (imported by name:
pytest puts this directory on sys.path).

The first compiled optimizer of a kind compiles its step (10-40 s cold on a 2-core CPU); every
later one of the kind in the process reuses it, whatever its sizes (Note [One compiled step per
kind]). Most tests run the same step functions eagerly (`compile=False`, milliseconds) and a
few go through the compiler.
"""

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 32


def make_mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, OUT))
    return model.to(dtype)


def batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, IN, generator=gen)
    y = torch.randn(BATCH, OUT, generator=gen)
    return x.to(dtype), y


def loss_of(model, step):
    dtype = next(model.parameters()).dtype
    x, y = batch(step, dtype)
    return F.mse_loss(model(x).float(), y)


def inject(model, step, bad_steps, value):
    """Put `value` (inf or nan) into one gradient element at each step in `bad_steps`."""
    if step in bad_steps:
        with torch.no_grad():
            model[0].weight.grad[0, 0] = value


def train(model, opt, steps, scaler=None, bad_steps=(), bad_value=float("inf"), start=0,
          schedule=None):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = loss_of(model, step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        inject(model, step, bad_steps, bad_value)
        opt.step(scaler) if scaler is not None else opt.step()
        if schedule is not None:
            schedule.step()
    return model


def snapshot(opt):
    """Every tensor a step may write: weights, masters, model params, states, step, scale."""
    tensors = [opt.step_counts]
    for bucket, held in zip(opt.buckets, opt.bucket_states):
        tensors += [*bucket.params, *(t for bufs in held.states for t in bufs)]
        if bucket.param is not None:  # the flat weights where the weights are their own master
            tensors.append(bucket.param)
        if bucket.master is not None:
            tensors.append(bucket.master)
        if held.correction is not None:
            tensors.append(held.correction)
    return [t.detach().clone() for t in tensors]


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def bit_identical(xs, ys):
    """Same dtype and the same bits (NaN included), tensor by tensor."""
    return len(xs) == len(ys) and all(
        x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(xs, ys))
