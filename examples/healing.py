"""Healing an fp16 overflow during training: fxamp finds the op and promotes it to fp32.

A small transformer whose attention is a scaled cosine attention written out by hand
(`exp(60 * cos(q, k)) / sum`, as Swin-v2-style attention with a large logit scale), without
subtracting the row max: fine in fp32 (exp(60) ~ 1e26), but exp overflows fp16 above 11.09,
so at fp16 O1 every step is skipped. Three 300-step runs on the same data:

1. fp32 (the reference);
2. fp16 at O1 with a dynamic LossScaler: every step skipped, the loss never moves;
3. the same with `fxamp.Healer`: after the first few skips it locates the `exp` in module
   `blocks.0.attn.scores`, promotes that module to fp32, recompiles, and the run lands within
   1 % of fp32's loss.

    python examples/healing.py [steps]      # 1 to 4 minutes on a 2-core CPU, by load

See docs/debugging_overflow.md ("Healing during training").
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script

import fxamp  # noqa: E402

FP16 = torch.float16  # the CPU default is bf16, which would not overflow here
DIM, HEADS, SEQ, BATCH = 16, 2, 8, 8


class CosineScores(nn.Module):
    """softmax(logit_scale * cos(q, k)) @ v, exponentiating without subtracting the max."""

    def __init__(self, logit_scale: float = 60.0):
        super().__init__()
        self.logit_scale = logit_scale

    def forward(self, q, k, v):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        e = (self.logit_scale * (q @ k.transpose(-2, -1))).exp()  # planted: no max subtracted
        return (e / e.sum(dim=-1, keepdim=True)) @ v


class Attention(nn.Module):
    def __init__(self, hostile: bool):
        super().__init__()
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.scores = CosineScores() if hostile else None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, HEADS, d // HEADS).transpose(1, 2)
                   for y in self.qkv(x).chunk(3, dim=-1))
        out = self.scores(q, k, v) if self.scores is not None else \
            F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, hostile: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(hostile)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, hostile: tuple[int, ...] = (0,), layers: int = 2):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(i in hostile) for i in range(layers)))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.head(self.blocks(x))


def build(hostile: tuple[int, ...] = (0,), seed: int = 0) -> nn.Module:
    """The transformer, with the hostile attention in the blocks numbered in `hostile`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(hostile)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed regression task: the target is a fixed smooth function of the sequence."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    data = []
    for _ in range(steps):
        x = torch.randn(BATCH, SEQ, DIM, generator=g)
        data.append((x, torch.tanh(x.cumsum(dim=1) / SEQ**0.5 @ mix)))
    return data


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loop's loss, in fp32. The healer gets this same function: it reruns the step."""
    return F.mse_loss(output.float(), target)


def train(model: nn.Module, data, *, fp16: bool, heal: bool = False, lr: float = 3e-3,
          scaler: "fxamp.LossScaler | None" = None, **heal_options):
    """Train with torch.optim.AdamW through LossScaler's GradScaler protocol. Returns
    (losses, scaler, healer); skipped steps count as nan losses."""
    if fp16:
        fxamp.compile(model, compiler="aot_eager", opt_level="O1", dtype=FP16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = scaler or fxamp.LossScaler(compile=False)
    healer = fxamp.Healer(model, scaler, loss_fn, **heal_options) if heal else None
    losses = []
    for batch in data:
        x, y = batch
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # for the printout only: a real loop logs every N steps
        if healer is not None:
            healer.observe(batch)
    return losses, scaler, healer


def tail(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / n


def main(steps: int = 300) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data, model = batches(steps), build()
    ref, _, _ = train(copy.deepcopy(model), data, fp16=False)
    plain, plain_scaler, _ = train(copy.deepcopy(model), data, fp16=True)
    healed, heal_scaler, healer = train(copy.deepcopy(model), data, fp16=True, heal=True,
                                        every=4)
    print(f"fp32                  loss (mean of last 20 steps) {tail(ref):.5f}")
    print(f"fp16 O1               loss {tail(plain):.5f}, "
          f"{int(plain_scaler.skipped_steps)}/{steps} steps skipped")
    print(f"fp16 O1 + fxamp.Healer loss {tail(healed):.5f}, "
          f"{int(heal_scaler.skipped_steps)}/{steps} steps skipped, "
          f"{abs(tail(healed) / tail(ref) - 1):.2%} from fp32")
    for p in healer.promotions:
        print(" ", p)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
