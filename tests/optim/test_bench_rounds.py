"""benchmarks/optimizer_step.py takes turns (Note [Taking turns]) and counts bytes honestly."""

import torch

from benchmarks import optimizer_step as bench


def test_methods_take_turns_and_rotate():
    order = []
    steps = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = bench.interleaved(steps, torch.device("cpu"), warmup=0, reps=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_ratios_are_taken_within_a_round():
    # Round 2 is slow for everyone: per-round ratios stay 2.0, a ratio of medians would not.
    med, lo, hi = bench.ratio_stats([2.0, 20.0, 2.0], [1.0, 10.0, 1.0])
    assert (med, lo, hi) == (2.0, 2.0, 2.0)


def test_storage_bytes_counts_a_flat_buffer_once():
    flat = torch.zeros(100)
    views = [flat[:50], flat[50:], flat]
    assert bench.storage_bytes(views + [torch.zeros(10, dtype=torch.bfloat16)]) == 420
