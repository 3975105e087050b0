"""Debugging an fp16 overflow: which op, in which module, and what to do about it.

Plants the classic fp16 overflow in a small transformer block: attention written out as
`softmax(q @ k.T) @ v` without the 1/sqrt(head_dim) factor, with query and key weights grown
large (as a diverging run leaves them), so the attention scores exceed 65504. Then:

1. `fxamp.locate_overflow` names the op that produced the first inf, with its module path,
   source line, input and output ranges, and a suggested override;
2. the suggested override keeps the step finite;
3. `fxamp.range_stats` shows how close every op runs to the fp16 limits (measured in bf16,
   which has fp32's exponent range, so values beyond fp16's are visible), exported as CSV;
4. a training loop with `fxamp.SkipMonitor` logs the skipped steps and runs the locator
   itself after three skips in a row.

    python examples/debug_overflow.py      # about 15 s on a 2-core CPU

See docs/debugging_overflow.md.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script

import fxamp  # noqa: E402
from examples import models  # noqa: E402
from fxamp.optim import SGD, LossScaler  # noqa: E402

FP16 = torch.float16  # the CPU default is bf16, which would not overflow here


class Attention(nn.Module):
    """Attention written out, as many models do instead of calling the fused kernel."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)  # planted: no / sqrt(head_dim)
        return scores.softmax(dim=-1) @ v


class Block(models.AttentionBlock):
    """examples.models.AttentionBlock with its attention in a submodule, `attn`."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        x = x + self.proj(self.attn(q, k, v).transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.ln2(x))


def planted_model():
    torch.manual_seed(0)
    model, x, target = Block(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    with torch.no_grad():
        model.qkv.weight[:32].mul_(200)  # the query and key rows
    return model, (x, target)


def locate(model, batch) -> dict:
    report = fxamp.locate_overflow(model, batch, F.mse_loss, dtype=FP16)
    print(report)
    return dict(report.site.fix)


def fixed(model, batch, fix: dict) -> None:
    report = fxamp.locate_overflow(model, batch, F.mse_loss, dtype=FP16, **fix)
    print(f"\nwith {fix}:\n{report}")


def ranges(model, batch) -> None:
    table = fxamp.range_stats(model, [batch], F.mse_loss, dtype=torch.bfloat16)
    print(dataclasses.replace(table, rows=tuple(table.at_risk())))
    path = Path(tempfile.gettempdir()) / "fxamp_ranges.csv"
    table.to_csv(str(path))
    print(f"all {len(table.rows)} rows: {path}")


def train(model, batch, steps: int = 4) -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    fxamp.compile(model, dtype=FP16, compiler="aot_eager")
    opt, scaler = SGD(model.parameters(), lr=1e-3, compile=False), LossScaler(compile=False)
    monitor = fxamp.SkipMonitor(opt, every=2, locate_after=3, locate=lambda scale:
                                fxamp.locate_overflow(model, batch, F.mse_loss,
                                                      loss_scale=scale))
    x, target = batch
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), target)).backward()
        opt.step(scaler)
    print(f"\n{monitor.skipped_steps} of {monitor.steps} steps skipped")


def main() -> None:
    model, batch = planted_model()
    print("######## 1. locate the overflow ########")
    fix = locate(model, batch)
    print("\n######## 2. apply the suggested fix ########")
    fixed(model, batch, fix)
    print("\n######## 3. value ranges against the fp16 limits ########")
    ranges(model, batch)
    print("\n######## 4. a training loop that keeps skipping ########")
    train(model, batch)


if __name__ == "__main__":
    main()
