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


def test_storage_bytes_counts_windows_into_a_buffer_once():
    # fxamp's parameters: storages of their own over the optimizer's flat weights
    from fxamp.optim.buffers.flat import window
    flat = torch.zeros(128)
    windows = [window(flat, 0, torch.Size([8, 8])), window(flat, 64, torch.Size([60]))]
    spans = {(w.untyped_storage().data_ptr(), w.untyped_storage().nbytes()) for w in windows}
    assert spans == {(flat.data_ptr(), 256), (flat.data_ptr() + 256, 240)}
    assert bench.storage_bytes(windows) == 4 * 124
    assert bench.storage_bytes(windows + [flat]) == 4 * 128


def _fake(nbytes: int):
    def build(shape_list):
        kept = [torch.zeros(nbytes, dtype=torch.uint8)]
        return bench.Built(lambda: None, lambda: kept)
    return build


def _time_mode(builders, budget, monkeypatch=None):
    from types import SimpleNamespace

    from benchmarks import optimizer_groups

    saved = []
    rows, skipped = optimizer_groups.time_mode(
        builders, [], 1, torch.device("cpu"), SimpleNamespace(warmup=0, reps=3),
        budget_bytes=budget, save=lambda r, s: saved.append((dict(r), dict(s))))
    return rows, skipped, saved


def test_methods_that_do_not_fit_together_take_turns_in_groups_beside_fxamp():
    # Note [Groups that fit]: 100 bytes of budget; fxamp keeps 40, the others 30, 30, 50, 70.
    builders = {"fxamp": _fake(40), "a": _fake(30), "b": _fake(30), "c": _fake(50),
                "d": _fake(70)}
    rows, skipped, saved = _time_mode(builders, 100)
    assert {k: r["group"] for k, r in rows.items()} == {"fxamp": 0, "a": 0, "b": 0, "c": 1}
    assert set(skipped) == {"d"} and "does not fit" in skipped["d"]
    assert rows["c"]["ratio"][0] > 0 and len(saved) >= 2  # saved after each group


def test_methods_left_when_the_deadline_nears_are_recorded_as_skipped(monkeypatch):
    from benchmarks import deadline

    monkeypatch.setenv(deadline.ENV, "0")  # long past
    rows, skipped, _ = _time_mode({"fxamp": _fake(4), "a": _fake(4)}, 100)
    assert set(rows) == {"fxamp"} and "deadline" in skipped["a"]


def test_a_method_is_expected_to_take_what_the_last_of_its_kind_took():
    # Note [What readying a method costs]: the first report expected every method to take twice
    # the anchor's cold compile, and skipped torch's eager baselines, which take under a second.
    from benchmarks.optimizer_groups import EAGER_GUESS_S, ReadyCost

    cost = ReadyCost(bench.compiles)
    cost.record("fxamp", 38.0)  # the first compile in the process
    assert cost.expected("eager O2") == EAGER_GUESS_S
    assert cost.expected("fxamp low_memory") == cost.expected("torchao AdamW8bit") == 38.0
    cost.record("eager O2", 0.7)
    cost.record("fxamp low_memory", 12.0)
    assert cost.expected("fused+GS") == 0.7 and cost.expected("fxamp compensated") == 12.0
