"""fxamp's compiled mixed-precision optimizer on scikit-learn's digits: the native API, the
Apex-style one, an overflow skipped on the device, and a bit-exact checkpoint resume.

    python -m examples.optimizer_demo            # about a minute on a 2-core CPU
    python -m examples.optimizer_demo --epochs 5

At O2 the model holds bf16 weights (fp16 on CUDA); the optimizer keeps fp32 masters, and one
compiled step unscales, checks for inf/nan, clips, updates, skips on overflow, copies the
masters to the model and moves the loss scale, with no host synchronisation.
"""

from __future__ import annotations

import argparse
import io

import torch
import torch.nn.functional as F

import fxamp
from examples import digits
from examples.models import CNN
from fxamp.optim import AdamW, LossScaler, initialize, scale_loss


def batches(train_set, size=64):
    x, y = train_set
    for i in range(0, len(y), size):
        yield x[i:i + size], y[i:i + size]


def accuracy(model, test_set) -> float:
    with torch.no_grad():
        x, y = test_set
        return (model(x).float().argmax(-1) == y).float().mean().item()


def native(train_set, test_set, epochs: int) -> None:
    torch.manual_seed(0)
    model = fxamp.compile(CNN(channels=8), opt_level="O2")
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, max_grad_norm=1.0)
    scaler = LossScaler("dynamic")
    steps = epochs * len(list(batches(train_set)))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    skipped = torch.zeros((), dtype=torch.int64)  # counted on the device, read once per epoch
    for epoch in range(epochs):
        for step, (x, y) in enumerate(batches(train_set)):
            loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if epoch == 0 and step == 5:  # a gradient overflow, as fp16 training meets them
                model.fc.weight.grad[0, 0] = float("inf")
            opt.step(scaler)
            opt.zero_grad()
            sched.step()  # a new lr every step, and no recompile
            skipped += opt.found_inf
        print(f"  epoch {epoch}: loss {loss.item():.4f}  scale {scaler.get_scale():.0f}  "
              f"skipped {int(skipped)}  grad norm {opt.grad_norm.item():.3f}")
    print(f"  weights {model.fc.weight.dtype}, masters "
          f"{opt.state[model.fc.weight]['master_param'].dtype}, "
          f"test accuracy {accuracy(model, test_set):.3f}")
    resume(model, opt, scaler, train_set)


def resume(model, opt, scaler, train_set) -> None:
    """Save, load into fresh objects (weights_only=True), continue: the same bits as going on."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buf)
    fresh = fxamp.compile(CNN(channels=8), opt_level="O2")
    fresh_opt = AdamW(fresh.parameters(), max_grad_norm=1.0)
    fresh_scaler = LossScaler("dynamic")
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["opt"])
    fresh_scaler.load_state_dict(ckpt["scaler"])
    x, y = next(batches(train_set))
    for m, o, s in ((model, opt, scaler), (fresh, fresh_opt, fresh_scaler)):
        s.scale(F.cross_entropy(m(x), y)).backward()
        o.step(s)
        o.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    print(f"  resumed from a checkpoint: next step bit-identical: {same}")


def apex_style(train_set, test_set, epochs: int) -> None:
    torch.manual_seed(0)
    model = CNN(channels=8)
    model, opt = initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                            opt_level="O2")
    for epoch in range(epochs):
        for x, y in batches(train_set):
            loss = F.cross_entropy(model(x), y)
            with scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        print(f"  epoch {epoch}: loss {loss.item():.4f}")
    print(f"  {type(opt).__module__}.{type(opt).__name__}, test accuracy "
          f"{accuracy(model, test_set):.3f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    train_set, test_set = digits.load()
    print("== native: fxamp.compile(O2) + fxamp.optim.AdamW + LossScaler ==")
    native(train_set, test_set, args.epochs)
    print("== Apex-style: initialize + scale_loss ==")
    apex_style(train_set, test_set, args.epochs)


if __name__ == "__main__":
    main()
