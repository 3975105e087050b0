"""The README's demo: train a small CNN on scikit-learn's digits at O0, O1 and O2, and show
what fxamp did (casts inserted, ops kept in fp32, the dtype each op ran in).

    python -m examples.demo            # about a minute on a 2-core CPU
    python -m examples.demo --epochs 5 --dtype fp16

Digits ships inside scikit-learn (1797 8x8 images, no download). On CPU the low-precision
runs are slower than fp32 (most CPUs lack bf16/fp16 matrix units); the point here is the
accuracy and what the passes did. End-to-end speed is a GPU matter: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import fxamp
from examples.models import CNN


def digits(seed: int = 0):
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(y))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def train(opt_level: str, dtype: torch.dtype, epochs: int, train_set, test_set):
    torch.manual_seed(0)
    model = fxamp.compile(CNN(channels=8), opt_level=opt_level, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = train_set
    start = time.perf_counter()
    for _ in range(epochs):
        for i in range(0, len(y), 64):
            loss = F.cross_entropy(model(x[i:i + 64]).float(), y[i:i + 64])
            loss.backward()
            opt.step()
            opt.zero_grad()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        test_x, test_y = test_set
        logits = model(test_x).float()
        accuracy = (logits.argmax(-1) == test_y).float().mean().item()
    return loss.item(), accuracy, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    train_set, test_set = digits()

    sample = train_set[0][:4]
    for level in ("O1", "O2"):
        report = fxamp.explain(CNN(channels=8), sample, opt_level=level, dtype=dtype)
        print(f"\n==== what fxamp {level} does to the CNN ({args.dtype}) ====")
        print(f"casts inserted: {report.casts_inserted}, ops kept in fp32: "
              f"{report.ops_in_fp32}, graph breaks: {report.graph_breaks}")
        for row in report.rows:
            print(f"  {row.op:<22} {row.module:<8} {row.policy:<6} "
                  f"{row.inputs} -> {row.output}   ({row.reason})")

    print(f"\n==== training {args.epochs} epochs on digits (1437 train / 360 test) ====")
    print(f"{'opt level':<10}{'final loss':>12}{'test acc':>10}{'seconds*':>10}")
    for level in ("O0", "O1", "O2"):
        loss, accuracy, seconds = train(level, dtype, args.epochs, train_set, test_set)
        print(f"{level:<10}{loss:>12.4f}{accuracy:>10.3f}{seconds:>10.1f}")
    print("* including the first step's compile; on CPU low precision is no faster (no bf16 units)")


if __name__ == "__main__":
    main()
