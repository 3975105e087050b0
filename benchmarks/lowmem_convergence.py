"""Convergence of the optimizer's state formats (issue 14) against fp32 masters and moments.

Two workloads, every state format on the same data, seed and initial weights, bf16 models:
  digits   the examples' CNN on scikit-learn's digits (AdamW, 25 epochs, 1100 steps),
           test accuracy and loss
  gpt2     a 2-layer transformers GPT-2 (~1M parameters) on the bytes of this repository's
           docs (a shipped corpus, no download), 1000 steps of AdamW, held-out loss
and prints per run the final training loss (mean of the last 100 steps), the held-out numbers
and the difference to the "default" run, writes every loss curve to a CSV and, with
matplotlib, a plot. Not part of the test suite (minutes of CPU):

    python -m benchmarks.lowmem_convergence --out docs/img/lowmem_convergence   # both workloads
    python -m benchmarks.lowmem_convergence --workloads digits --seeds 3        # docs' table
    python -m benchmarks.lowmem_convergence --workloads digits --steps 200      # quicker look

With --seeds N every format runs on seeds 0..N-1 (initial weights and batches) and the table
compares each seed with the default run of the same seed.

The models' parameters and gradients are bf16 (what the formats act on) but the forward and
backward run in fp32 on an fp32 twin of the model (`Fp32Compute`): on this machine's CPU a bf16
matmul is 10-20x slower than fp32, and the formats only change the optimizer.
"""

from __future__ import annotations

import argparse
import copy
import csv
import glob
import math
import os
import statistics
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import fxamp.optim as fo

RUNS = {  # name -> optimizer keywords
    "default": dict(state_format="default"),
    "low_memory": dict(state_format="low_memory"),
    "kahan+int8": dict(state_format=fo.StateFormat("kahan", "int8")),
    "compensated": dict(state_format="compensated"),
    "stochastic+int8": dict(state_format=fo.StateFormat("stochastic", "int8")),
    "fp32+int8": dict(state_format=fo.StateFormat("fp32", "int8")),
    "no master": dict(master_weights=False),
}


# ------------------------------------------------------------------------------------- digits
def digits_task(steps: int):
    from examples.digits import load
    from examples.models import CNN

    (x, y), (tx, ty) = load(0)

    def build(seed: int):
        torch.manual_seed(seed)
        return CNN(channels=16).bfloat16()  # BatchNorm too: every parameter is bf16

    def batch(step: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(y), (32,), generator=gen)
        return x[idx], y[idx]

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch[0]).float(), batch[1])

    @torch.no_grad()
    def evaluate(model):
        model.eval()
        logits = model(tx).float()
        model.train()
        return {"test loss": F.cross_entropy(logits, ty).item(),
                "test acc %": (logits.argmax(-1) == ty).float().mean().item() * 100}
    return build, batch, loss_fn, evaluate, dict(lr=3e-3, weight_decay=1e-4)


# --------------------------------------------------------------------------------------- gpt2
SEQ, BATCH = 64, 16


def _corpus() -> torch.Tensor:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = b"".join(open(p, "rb").read() for p in sorted(glob.glob(f"{root}/docs/*.md")))
    return torch.tensor(list(text), dtype=torch.long)


def gpt2_task(steps: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    data = _corpus()
    split = int(0.9 * len(data))
    train, held = data[:split], data[split:]
    config = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=192, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def build(seed: int):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config).bfloat16()

    def windows(source, gen, n):
        starts = torch.randint(0, len(source) - SEQ - 1, (n,), generator=gen)
        return torch.stack([source[s:s + SEQ] for s in starts])

    def batch(step: int, seed: int):
        return windows(train, torch.Generator().manual_seed(seed * 1_000_003 + step), BATCH)

    def loss_fn(model, ids):
        return model(input_ids=ids, labels=ids).loss.float()

    @torch.no_grad()
    def evaluate(model):
        ids = windows(held, torch.Generator().manual_seed(-1 % 2**31), 64)
        return {"held-out loss": loss_fn(model, ids).item()}
    return build, batch, loss_fn, evaluate, dict(lr=1e-3, weight_decay=0.01)


# ---------------------------------------------------------------------------------- training
class Fp32Compute:
    """bf16 parameters and gradients, fp32 arithmetic: before each forward the bf16 weights are
    copied into an fp32 twin of the model, and after its backward the twin's gradients are
    rounded into the bf16 gradients. The optimizer sees exactly a bf16 model; the forward avoids
    this CPU's slow bf16 matmuls (Note in the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.twin = copy.deepcopy(model).float()
        self.pairs = list(zip(model.parameters(), self.twin.parameters()))

    def loss(self, loss_fn, batch):
        with torch.no_grad():
            for p16, p32 in self.pairs:
                p32.copy_(p16)
        return loss_fn(self.twin, batch)

    def take_grads(self) -> None:
        with torch.no_grad():
            for p16, p32 in self.pairs:
                p16.grad.copy_(p32.grad)
                p32.grad = None


def train(task, steps: int, options: dict, seed: int = 0) -> tuple[list[float], dict]:
    """One run: initial weights and batches from `seed` (the same for every state format)."""
    build, batch, loss_fn, evaluate, hyper = task
    model = build(seed)
    opt = fo.AdamW(model.parameters(), **hyper, compile=False, **options)
    run = Fp32Compute(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # warm up, then cosine to 10 %
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.55 + 0.45 * math.cos(math.pi * s / steps)))
    losses = []
    for step in range(steps):
        loss = run.loss(loss_fn, batch(step, seed))
        loss.backward()
        run.take_grads()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    run.loss(lambda m, b: None, None)  # the final weights into the twin
    return losses, evaluate(run.twin)


def _final(losses: list[float]) -> float:
    return statistics.mean(losses[-100:])


def table(name: str, results: dict[str, list[tuple[list[float], dict]]]) -> list[str]:
    """One row per run: final train loss and held-out numbers as means over the seeds, and the
    final loss against the default's of the same seed (mean, and [min, max] over seeds)."""
    ref = [_final(losses) for losses, _ in results["default"]]
    keys = list(results["default"][0][1])
    seeds = len(ref)
    lines = [f"\n{name}: {len(results['default'][0][0])} steps, {seeds} seed(s)",
             "| run | bytes/param | final train loss | vs default | "
             + " | ".join(keys) + " |", "|---|---:|---:|---:|" + "---:|" * len(keys)]
    for run, per_seed in results.items():
        finals = [_final(losses) for losses, _ in per_seed]
        rel = [100 * (f / r - 1) for f, r in zip(finals, ref)]
        spread = f" [{min(rel):+.2f}, {max(rel):+.2f}]" if seeds > 1 else ""
        fmt = RUNS[run].get("state_format", "default")
        fmt = fo.StateFormat.from_preset(fmt) if isinstance(fmt, str) else fmt
        size = 8.0 if run == "no master" else fmt.bytes_per_param()
        evals = [statistics.mean(e[k] for _, e in per_seed) for k in keys]
        lines.append(f"| {run} | {size:.2f} | {statistics.mean(finals):.4f} | "
                     f"{statistics.mean(rel):+.2f} %{spread} | "
                     + " | ".join(f"{v:.4f}" for v in evals) + " |")
    if seeds > 1:
        lines.append(f"default's final loss over the seeds: {min(ref):.4f} to {max(ref):.4f} "
                     f"({100 * (max(ref) / min(ref) - 1):.1f} % apart)")
    return lines


def save(out: str, name: str, results: dict) -> None:
    with open(f"{out}_{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *results])
        for step, row in enumerate(zip(*(r[0] for r in results.values()))):
            writer.writerow([step, *(f"{v:.5f}" for v in row)])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, (losses, _) in results.items():
        window = 50
        smooth = [statistics.mean(losses[max(0, i - window):i + 1]) for i in range(len(losses))]
        ax.plot(smooth, label=run, lw=1)
    ax.set(title=f"{name}: training loss (running mean of 50 steps)", xlabel="step",
           ylabel="loss", yscale="log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{out}_{name}.png", dpi=100)


TASKS: dict[str, Callable] = {"digits": digits_task, "gpt2": gpt2_task}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="digits,gpt2")
    parser.add_argument("--steps", type=int, default=None, help="default: 1100 / 1000")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per format, seeds 0..N-1 (initial weights and batches)")
    parser.add_argument("--out", default="out/lowmem",
                        help="prefix of the CSV and PNG files (seed 0's curves)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for name in args.workloads.split(","):
        steps = args.steps or (1100 if name == "digits" else 1000)
        task = TASKS[name](steps)
        results = {run: [train(task, steps, RUNS[run], seed) for seed in range(args.seeds)]
                   for run in args.runs.split(",")}
        print("\n".join(table(name, results)), flush=True)
        save(args.out, name, {run: per_seed[0] for run, per_seed in results.items()})


if __name__ == "__main__":
    main()
