"""NVFP4's stochastic rounding under DDP and FSDP2, on 2 spawned ranks with gloo (CPU): every
rank draws the same seeds (Note [The seed of NVFP4's stochastic rounding] in docs/design.md).
After each step on data of each rank's own, every rank's counter is (float8 GEMMs a forward) x
(steps); an input gradient of one shared batch (rounded with the drawn seeds, never reduced) is
the same on every rank; DDP's replicas keep the same weights; and DDP's broadcast at
construction brings a rank whose counter differed back to rank 0's. The slow tier: ~10 s a
case on 2 cores (spawning 2 ranks ~3.5 s, then compiling NVFP4's graphs ~6 s).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

import nvfp4_workers as w

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo"),  # as test_distributed
              pytest.mark.slow]

STEPS = 3


def _check_ranks_agree(ranks):
    for r in ranks:
        assert r["world"] == 2 and r["float8_gemms"] == w.GEMMS, r["float8_gemms"]
        assert r["same_buffer"]  # the counter the wrapped model advances is the model's buffer
        # The GEMMs of step s drew keys GEMMS * s .. GEMMS * (s + 1) - 1 on every rank.
        assert r["counters"] == [w.GEMMS * (s + 1) for s in range(STEPS)], r["counters"]
        assert r["probe_counter"] == w.GEMMS * (STEPS + 1)
    a, b = ranks
    for step, (p, q) in enumerate(zip(a["params"], b["params"])):
        assert torch.equal(p, q), step  # DDP's replicas / FSDP2's gathered shards
    assert a["probe_grad"].abs().sum() > 0
    # Measured: with rank 1's counter 5 ahead (DDP(broadcast_buffers=False)) these differ.
    assert torch.equal(a["probe_grad"], b["probe_grad"])


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_ranks_draw_the_same_seeds(kind):
    ranks = run_ranks(functools.partial(w.train, kind=kind, steps=STEPS))
    assert [(r["before_wrap"], r["after_wrap"]) for r in ranks] == [(0, 0), (0, 0)]
    _check_ranks_agree(ranks)


def test_ddp_broadcast_brings_a_differing_counter_back():
    # Rank 1's counter is 5 before DistributedDataParallel(model): the constructor broadcasts
    # rank 0's buffers (DDP's default, broadcast_buffers=True), so both start at 0.
    ranks = run_ranks(functools.partial(w.train, kind="ddp", steps=STEPS, rank1_counter=5))
    assert [(r["before_wrap"], r["after_wrap"]) for r in ranks] == [(0, 0), (5, 0)]
    _check_ranks_agree(ranks)
