"""Let fxamp choose each GEMM's precision: plan, save, apply, explain, train.

An MLP whose middle layer carries a planted outlier (one input feature of 1e6 that its weight
ignores: harmless in bf16, ruinous in float8, whose scale it sets). Then:

1. `fxamp.plan` measures every GEMM on one calibration batch and models a training step on
   an H100 (costs at a training batch of 16384 rows): the large first GEMM goes to float8,
   the outlier layer stays bf16 for its float8 error, the small head stays bf16 for its
   cost -- each with its reason;
2. the plan is saved as JSON and loaded back;
3. `fxamp.compile(model, plan=plan)` applies it, and `fxamp.explain` shows the plan's
   reasons next to the float8 decisions;
4. a few training steps run.

    python -m examples.planner      # about 40 s on a 2-core CPU

See docs/planner.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fxamp


class Outlier(nn.Module):
    """A linear layer whose input has one huge feature that its (masked) weight ignores."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        spike, mask = torch.zeros(d_in), torch.ones(d_out, d_in)
        spike[0], mask[:, 0] = 1e6, 0
        self.register_buffer("spike", spike)
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.linear(x + self.spike, self.linear.weight * self.mask, self.linear.bias)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), Outlier(8192, 2048), nn.GELU(),
                         nn.Linear(2048, 16))


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(64, 2048, generator=gen), torch.randn(64, 16, generator=gen))

    print("==== 1. the plan (target h100, modeled at 16384 rows a step) ====")
    plan = fxamp.plan(make_model(), batch, F.mse_loss, target="h100", batch_size=16384)
    print(plan)

    print("\n==== 2. saved and loaded ====")
    path = Path(tempfile.mkdtemp()) / "plan.json"
    plan.to_json(str(path))
    loaded = fxamp.PrecisionPlan.from_json(str(path))
    print(f"{path.name}: {path.stat().st_size} bytes, loaded plan equal: {loaded == plan}")

    print("\n==== 3. applied, and explained ====")
    model = fxamp.compile(make_model(), plan=loaded, compiler="aot_eager")  # Inductor: slower
    print(fxamp.explain(model, batch[0]).gemm_report())

    print("\n==== 4. training ====")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        loss = F.mse_loss(model(batch[0]).float(), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
