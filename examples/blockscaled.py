"""The block-scaled recipes (MXFP8, NVFP4) on a small Llama-style model, on the CPU.

Trains the same model from the same seed in bf16 (fxamp O1) and with `float8="mxfp8"` and
NVFP4 as torchao's training recipe (the grad_weight GEMM's operands Hadamard-rotated, the
output gradient rounded stochastically) on top of O1, where every GEMM of every linear
(output, grad_input and grad_weight) runs block-scaled, emulated (docs/float8.md, "Block-scaled formats"), and prints
each recipe's loss after the same steps next to bf16's. Then it stops each block-scaled run
half way, saves model and optimizer, loads them into a fresh model and optimizer and finishes:
the resumed weights equal the uninterrupted run's bit for bit (NVFP4's stochastic-rounding
counter is a buffer of the model: it is saved and restored with the weights).

    python -m examples.blockscaled            # 100 steps (about a minute on 2 cores)
    python -m examples.blockscaled --steps 10
"""

from __future__ import annotations

import argparse
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.float8 import Float8Config
from fxamp.float8.nvfp4 import NVFP4_RHT_SIGNS

RECIPES = {"bf16": None, "mxfp8": "mxfp8",
           "nvfp4": Float8Config(recipe="nvfp4", nvfp4_rht_signs=NVFP4_RHT_SIGNS,
                                 nvfp4_stochastic_rounding=True)}
VOCAB, DIM, HEADS, FFN, LAYERS, SEQ, BATCH = 128, 64, 4, 128, 2, 32, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Pre-norm attention (causal, no bias) and a SwiGLU MLP, as Llama's."""

    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.gate_up = nn.Linear(DIM, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, DIM))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a fixed random Markov chain over the vocabulary: learnable, not trivial."""
    gen = torch.Generator().manual_seed(1)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    out = []
    for _ in range(steps):
        ids = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        for t in range(SEQ):
            pick = torch.randint(0, 4, (BATCH,), generator=gen)
            ids[:, t + 1] = successors[ids[:, t], pick]
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def build(recipe: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fxamp.compile(TinyLlama(), opt_level="O1", dtype=torch.bfloat16, float8=recipe,
                          compiler="aot_eager")
    return model, fxamp.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer,
          data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for ids, targets in data:
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def resumed(recipe: object, data: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    """The run stopped half way, saved, loaded into fresh objects and finished."""
    half = len(data) // 2
    model, opt = build(recipe)
    train(model, opt, data[:half])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, opt = build(recipe)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, data[half:])
    return model


def main(steps: int = 100) -> dict[str, float]:
    data = batches(steps)
    final: dict[str, float] = {}
    weights = {}
    for name, recipe in RECIPES.items():
        model, opt = build(recipe)
        losses = train(model, opt, data)
        final[name] = sum(losses[-10:]) / len(losses[-10:])  # the last steps' mean
        weights[name] = model.state_dict()
        gap = "" if recipe is None else f"  ({final[name] / final['bf16'] - 1:+.2%} vs bf16)"
        print(f"{name:6s} loss after {steps} steps (mean of the last 10): {final[name]:.4f}{gap}")
    for name in ("mxfp8", "nvfp4"):
        again = resumed(RECIPES[name], data).state_dict()
        exact = all(torch.equal(again[k], v) for k, v in weights[name].items())
        print(f"{name}: resumed half way, weights {'bit-exact' if exact else 'DIFFER'}")
    return final


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    main(parser.parse_args().steps)
