"""fxamp's graphs in Google's Model Explorer: a tiny GPT-2 and a planted fp16 overflow.

    pip install "fxamp[viewer]"        # Model Explorer; saving a view needs nothing extra
    python -m examples.viewer          # saves both views to out/, then shows the overflow one
    python -m examples.viewer --save-only
    python -m fxamp view out/planted_overflow.fxamp.json      # a saved view, later or elsewhere

The same from the shell, straight from the factories below:

    python -m fxamp explain examples.viewer:gpt2 --view
    python -m fxamp explain examples.viewer:planted_overflow --dtype fp16 --ranges \\
        --locate-overflow --view

In the page: layers (modules) unfold with a click, every node is filled with the colour of the
dtype it runs in, fxamp's casts are outlined, and a node's side panel says which policy it got
and why. The overlays (right, "node data providers") show what was measured: fp16 headroom
(65504 / max|x|, red at overflow) and the op `locate_overflow` found; the one whose eye icon
is open colours the graph. See docs/explain.md, "In a graph viewer".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script

import fxamp  # noqa: E402
from examples import debug_overflow  # noqa: E402

OUT = Path("out")


def gpt2() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A 2-layer GPT-2 of width 16 from a transformers config (no download) and a batch."""
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                         n_positions=8, use_cache=False)
        return transformers.GPT2LMHeadModel(config), (torch.randint(0, 64, (2, 8)),)


def planted_overflow() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """examples/debug_overflow.py's block, whose attention scores exceed 65504 in fp16."""
    model, (x, _) = debug_overflow.planted_model()
    return model, (x,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-only", action="store_true", help="save the views, serve none")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)

    model, inputs = gpt2()
    report = fxamp.explain(model, *inputs, opt_level="O1")
    print(report.headline)
    print("saved", report.save(str(OUT / "gpt2.fxamp.json")))

    model, (x, target) = debug_overflow.planted_model()
    located = fxamp.locate_overflow(model, (x, target), F.mse_loss, dtype=torch.float16)
    print(located.site.headline)
    report = fxamp.explain(model, x, dtype=torch.float16, ranges=True)
    path = report.save(str(OUT / "planted_overflow.fxamp.json"), overflow=located)
    print("saved", path)
    if not args.save_only:
        fxamp.viewer.show(path)  # until Ctrl+C; report.view(overflow=located) does the same


if __name__ == "__main__":
    main()
