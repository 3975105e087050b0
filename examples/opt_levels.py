"""Apex's opt levels O0-O3 as fxamp applies them, on CPU with bfloat16.

Prints `fxamp.explain` for a tiny transformer block and a tiny CNN at every level, then trains
the MLP for a few steps with `fxamp.compile` at O1 and O2 beside a plain fp32 run.

    python examples/opt_levels.py          # about 20 s on a 2-core CPU

See docs/opt_levels.md for what each level does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script

import fxamp  # noqa: E402
from examples import models  # noqa: E402

LEVELS = ("O0", "O1", "O2", "O3")
STEPS = 5
LR = 0.1
# aot_eager runs fxamp's passes and AOTAutograd but no Inductor codegen: the cast graphs are the
# same, and each compile takes well under a second instead of 5-25 s with Inductor on a small
# CPU. Use compiler="inductor" (fxamp.compile's default) for real kernels.
COMPILER = "aot_eager"


def explain_all() -> None:
    for factory in (models.attention, models.cnn):
        for level in LEVELS:
            model, inputs = factory()
            report = fxamp.explain(model, *inputs, opt_level=level, dtype=torch.bfloat16)
            print(f"\n######## {factory.__name__} at {level} ########\n{report}")


def train(opt_level: str | None) -> list[float]:
    """Losses of STEPS SGD steps on the MLP; opt_level None is plain fp32 eager."""
    model, (x,) = models.mlp()
    target = torch.randn(x.shape[0], 4, generator=torch.Generator().manual_seed(1))
    if opt_level is not None:
        model = fxamp.compile(model, opt_level=opt_level, dtype=torch.bfloat16,
                              compiler=COMPILER)
    # Plain SGD updates the weights in their storage dtype, bf16 at O2. O2's fp32 master
    # weights (master_weights=True) are the optimizer's job: see docs/optimizer.md.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(model(x).float(), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_all() -> None:
    runs = {"fp32": train(None), "O1": train("O1"), "O2": train("O2")}
    print(f"\n######## MLP, {STEPS} SGD steps (lr {LR}), loss per step ########")
    print("step  " + "  ".join(f"{name:>8}" for name in runs))
    for step in range(STEPS):
        print(f"{step:>4}  " + "  ".join(f"{losses[step]:8.4f}" for losses in runs.values()))


if __name__ == "__main__":
    explain_all()
    train_all()
