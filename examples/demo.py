"""The README's demo: what fxamp does to a small CNN, then that CNN trained on scikit-learn's
digits at O0 and at O1/O2/O3 in fp16 and bf16 (the short form of examples/digits.py).

    python -m examples.demo            # about a minute on a 2-core CPU, compiles included
    python -m examples.demo --epochs 3 --dtype fp16

Digits ships inside scikit-learn (1797 8x8 images, no download). On CPU the low-precision
runs are slower than fp32 (most CPUs lack bf16/fp16 matrix units); the point here is the
accuracy and what the passes did. End-to-end speed is a GPU matter: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse


import fxamp
from examples import digits
from examples.models import CNN


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=digits.SHORT.epochs)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                        help="the dtype of the explain part (training runs both)")
    args = parser.parse_args(argv)
    dtype = digits.DTYPES[args.dtype]
    (train_x, _), _ = digits.load()

    for level in ("O1", "O2"):
        report = fxamp.explain(CNN(channels=digits.SHORT.channels), train_x[:4],
                               opt_level=level, dtype=dtype)
        print(f"\n==== what fxamp {level} does to the CNN ({args.dtype}) ====")
        print(f"casts inserted: {report.casts_inserted}, ops kept in fp32: "
              f"{report.ops_in_fp32}, graph breaks: {report.graph_breaks}")
        for row in report.rows:
            print(f"  {row.op:<22} {row.module:<8} {row.policy:<6} "
                  f"{row.inputs} -> {row.output}   ({row.reason})")

    digits.main(["--short", "--epochs", str(args.epochs)])


if __name__ == "__main__":
    main()
