"""fxamp under torch.distributed, on 2 spawned ranks with gloo over 127.0.0.1 (CPU, bf16).

DDP and FSDP2 training match a single process on the same global batch; an overflow on one rank
makes every rank skip with the same scale; a DCP checkpoint resumes bit-identically; a failing
rank fails the test in seconds. Every run is bounded (dist_harness.run_ranks: deadline, gloo
timeout, process groups destroyed in `finally`). About 90 s on a 2-core CPU.
"""

import functools

import pytest
import torch
import torch.distributed as dist
from dist_harness import RankFailed, run_ranks

import dist_workers as w
import fxamp.optim as fo
from fxamp.errors import ConfigError

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# Max |distributed - single process| over the parameters after 3 AdamW steps (lr 1e-2), measured
# here: DDP O1 9.6e-5, FSDP2 O1 3.3e-4 (fp32 params; O1's bf16 matmuls round the half batches
# differently from the whole one); O2 4.9e-4 for both, one bf16 ulp of the largest weights (the
# bf16 gradients are summed across ranks in bf16). The fp32 masters at O2: 1.4e-4 for both.
TOLERANCE = {"O1": 1e-3, "O2": 2e-3}


def _run(fn, **kwargs):
    return run_ranks(functools.partial(fn, **kwargs))


# The default tier: DDP at O1, FSDP2 at O2 and under FSDP2's own mixed precision; the other
# two pairs (each ~10 s of two ranks on two cores) are the slow tier.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind, level", [("ddp", "O1"), pytest.param("ddp", "O2", marks=_SLOW),
                                         pytest.param("fsdp", "O1", marks=_SLOW),
                                         ("fsdp", "O2"), ("fsdp_mp", "O1")])
def test_training_matches_a_single_process(kind, level):
    # fsdp_mp: fxamp O1 under FSDP2's MixedPrecisionPolicy(bf16 params, fp32 reduce): FSDP2
    # keeps the fp32 shards (they are the masters); measured 9.6e-5 from the single O1 run.
    ranks = _run(w.run_with_reference, kind=kind, level=level)
    single = ranks[0]["single"]
    for out in (r["dist"] for r in ranks):
        assert out["dtype"] == (torch.float32 if level == "O1" else torch.bfloat16)
        assert out["skipped"] == [False] * 3 and out["step"] == 3
        diff = (out["params"] - single["params"]).abs().max().item()
        assert diff <= TOLERANCE[level], diff
        if level == "O2":
            assert (out["masters"] - single["masters"]).abs().max().item() <= TOLERANCE[level]
    # Every rank holds the same model (DDP: replicas; FSDP2: the gathered shards).
    assert torch.equal(ranks[0]["dist"]["params"], ranks[1]["dist"]["params"])


def _check_all_skipped_together(ranks, single, sharded):
    a, b = (r["dist"] for r in ranks)
    assert a["skipped"] == b["skipped"] == [False, True, False]
    assert a["step"] == b["step"] == 2
    assert a["scale"] == b["scale"] == 2.0**15  # halved once, on both ranks
    assert single["scale"] == 2.0**16 and single["skipped"] == [False] * 3
    assert torch.equal(a["params"], b["params"]) and torch.equal(a["masters"], b["masters"])
    assert torch.equal(a["moments"], b["moments"])
    # The clipping norm is the global one on every rank: the same number on both, and at step 0
    # (before the runs part ways at the skip) that of the single process up to O2's bf16
    # gradients (measured: 2.7e-4 relative).
    assert a["norms"][0] == b["norms"][0] and a["norms"][2] == b["norms"][2]
    assert a["norms"][0] == pytest.approx(single["norms"][0], rel=2e-3)
    if sharded:  # FSDP2's overflow was in one shard: the reduced norm is inf on both ranks
        assert a["norms"][1] == b["norms"][1] == float("inf")


# DDP in the default tier, FSDP2 (each ~10 s of two ranks) and the compiled step's agreement
# below in the slow tier
@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp", marks=_SLOW)])
def test_overflow_on_one_rank_skips_on_all(kind):
    # The inf goes into rank 1's gradient after backward, past DDP's allreduce: only the step's
    # own agreement can make rank 0 skip.
    ranks = _run(w.run_with_reference, kind=kind, level="O2", bad=((1, 1),), max_grad_norm=0.5)
    _check_all_skipped_together(ranks, ranks[0]["single"], sharded=kind == "fsdp")


@pytest.mark.slow  # ~25 s per kind: two ranks compiling the step with Inductor
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_compiled_step_agrees_with_collectives_traced_into_it(kind):
    # The same through Inductor: the all-reduces are functional collectives inside the compiled
    # prologue (fullgraph=True, so a graph break would raise). About 20 s per kind here.
    ranks = _run(w.run_with_reference, kind=kind, level="O2", bad=((1, 1),), max_grad_norm=0.5,
                 compile_step=True)
    _check_all_skipped_together(ranks, ranks[0]["single"], sharded=kind == "fsdp")


@pytest.mark.parametrize("kind, level", [("ddp", "O1"), pytest.param("ddp", "O2", marks=_SLOW),
                                         pytest.param("fsdp", "O1", marks=_SLOW),
                                         ("fsdp", "O2")])
def test_dcp_checkpoint_resumes_bit_identically(kind, level, tmp_path):
    ranks = _run(w.resume, kind=kind, level=level, path=str(tmp_path / "ckpt"))
    for straight, resumed in ranks:
        assert straight["skipped"] == resumed["skipped"] == [False, True, False, False]
        assert straight["scale"] == resumed["scale"] and straight["step"] == resumed["step"]
        for key in ("params", "masters", "moments"):
            if straight[key] is not None:
                assert torch.equal(straight[key], resumed[key]), key


def _fail_on_rank_1(rank):
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def test_a_failing_rank_fails_fast():
    # Rank 0 would wait at the barrier for the 600 s collective timeout; a harness that waited
    # for every rank would end at its own 60 s deadline with "did not finish" instead of
    # rank 1's error. (No clock: how long spawning takes depends on the machine's load.)
    with pytest.raises(RankFailed, match="rank 1 gives up"):
        run_ranks(_fail_on_rank_1, timeout_s=60, collective_timeout_s=600)


def test_ddp_before_fxamp_compile_is_refused():
    ranks = run_ranks(w.wrong_orders)
    assert ranks[0] == ranks[1] == ["compile(DDP)", "DDP then compile"]


def test_what_sharded_parameters_refuse():
    refused = run_ranks(w.sharded_refusals)[1]
    assert "trust ratio needs whole-parameter norms" in refused["LAMB"]
    assert "does not step sharded (DTensor, FSDP2)" in refused["FP16_Optimizer"]
    assert "parameters are sharded over 2 ranks" in refused["process_group=None"]


def test_process_group_argument():
    model = torch.nn.Linear(4, 4)
    # Without torch.distributed initialized, "auto" means no group: today's single-process step.
    assert fo.AdamW(model.parameters(), compile=False)._group is None
    assert fo.SGD(model.parameters(), compile=False, process_group=None)._group is None
    with pytest.raises(ConfigError, match="process_group='world' is not 'auto'"):
        fo.AdamW(model.parameters(), compile=False, process_group="world")


# The low_memory state (int8_error masters, int8 moments) against the same single process with
# fp32 state, after 3 steps: parameters within 2 bf16 ulps of the largest weight (|w| < 0.5);
# moments within 2 code steps where the compander is coarsest (2 x 2/127 of the largest
# moment: stochastic rounding lands up to one step away, Note [Rounding compact moments
# stochastically]). Measured here: parameters 1.95e-3 (one ulp) for DDP, FSDP2 and the single
# low_memory run alike; moments 3.5e-4 (DDP and single) and 1.07e-3 (FSDP2, whose shards have
# their own block scales and random streams), of at most 0.061.
LOW_MEMORY_TOLERANCE = {"params": 2 * 2.0**-9, "decoded": 4 / 127}


@pytest.mark.parametrize("kind", [pytest.param("ddp", marks=_SLOW), "fsdp"])
def test_low_memory_state_trains_like_one_process_and_resumes_bit_identically(kind, tmp_path):
    trained, resumed = zip(*_run(w.low_memory, kind=kind, path=str(tmp_path / "ckpt")))
    fp32_state = trained[0]["fp32_state"]
    scale = {"params": 1.0, "decoded": fp32_state["decoded"].abs().max().item()}
    for out in (trained[0]["single"], *(t["dist"] for t in trained)):
        assert out["masters"] is None and out["skipped"] == [False] * 3
        for key, tol in LOW_MEMORY_TOLERANCE.items():
            diff = (out[key] - fp32_state[key]).abs().max().item()
            assert diff <= tol * scale[key], (key, diff)
    assert torch.equal(trained[0]["dist"]["params"], trained[1]["dist"]["params"])
    for straight, again in resumed:
        assert straight["skipped"] == again["skipped"] == [False, True, False, False]
        assert straight["scale"] == again["scale"] and straight["step"] == again["step"]
        for key in ("params", "moments", "extra"):  # codes, block scales, master corrections
            assert torch.equal(straight[key], again[key]), key


# 2 -> 1 in the default suite; 2 -> 3 (three more ranks to spawn, ~20 s on one core) is slow.
@pytest.mark.parametrize("load_world", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_low_memory_checkpoint_from_other_world_size_is_refused_before_loading(load_world,
                                                                                tmp_path):
    # Note [Block scales of sharded parameters]: 8-bit block scales describe one sharding's
    # blocks. DCP itself stops only where a parameter's count of scales differs between the
    # two shardings (here it would: "Size mismatch ... exp_avg_scale"); where the counts agree
    # and the blocks do not (a 17 x 4 weight: 2 x 1 blocks over 2 ranks, 1 x 2 over one), it
    # loaded the scales of other blocks without a word. Refused now by what the checkpoint
    # says of its sharding, with the reason and the fix, before anything is read into the
    # model, the optimizer or the scaler.
    path = str(tmp_path / "ckpt")
    run_ranks(functools.partial(w.save_low_memory, path=path))
    results = run_ranks(functools.partial(w.load_low_memory, path=path), world=load_world)
    for refusal, unchanged in results:
        assert refusal is not None and unchanged
        assert (f"saved with block scales over 2 rank(s), and this AdamW shards its parameters "
                f"over {load_world}") in refusal and "Load it with 2 rank(s)" in refusal
    same = run_ranks(functools.partial(w.load_low_memory, path=path))  # 2 ranks: loads
    assert all(refusal is None and not unchanged for refusal, unchanged in same)


def test_low_memory_over_replicated_dtensors_steps_as_one_process():
    # Note [Block scales of sharded parameters]: a replicated DTensor parameter's block scales
    # are one Replicate DTensor of its own blocks (not ranks x them), and its gradient counts
    # once in the clipping norm (every rank holds all of it).
    ranks = run_ranks(w.replicated_low_memory)
    single = ranks[0]["single"]
    for out in (r["dist"] for r in ranks):
        assert out["scales"] == [("DTensor", (7,), ["R"])] * 2 + \
            [("DTensor", (1,), ["R"])] * 2
        assert out["norm"] == pytest.approx(single["norm"], rel=1e-6)
        for got, want in zip(out["params"] + out["state"], single["params"] + single["state"]):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_float8_reaches_fsdp2_sharded_modules():
    # Note [Sharded modules are compiled one by one]: FSDP2's hooks are dynamo-disabled, so
    # before, a fully_shard-ed nn.Linear and the head after a loop over sharded blocks ran
    # eagerly in bf16. Now every GEMM runs in float8: the sharded model is bitwise the
    # unsharded float8 one (outputs and averaged gradients), at its first call and its second.
    for r in run_ranks(w.float8_under_fsdp):
        assert r["float8_differs"], r  # the unsharded float8 model does run float8 GEMMs
        assert r["as_float8"] and not r["as_bf16"], r
        # every GEMM named by its path in the model, blocks.2.down skipped by that path
        assert r["choices"] == {"blocks.0.up": True, "blocks.0.down": True,
                                "blocks.1.up": True, "blocks.1.down": True,
                                "blocks.2.up": True, "blocks.2.down": False, "head": True}, r
        # the live weights: 16-bit at O2 (Note [The state dict is the live weights]); no float8
        assert r["state_dtypes"] == ["torch.bfloat16"], r
        assert r["warnings"] == [], r
        # delayed scaling's histories would differ per rank: refused at the first call
        assert r["delayed_refusal"].startswith("float8 scaling='delayed' under FSDP2: each rank")
        assert "use Float8Config(scaling='dynamic') with fully_shard" in r["delayed_refusal"]
        assert r["delayed_untouched"], r  # the refused model's shards as they were
        # sharded after its first call: its sharded modules would run eagerly, refused
        assert r["late_refusal"].startswith(
            "blocks.0 of Blocks sharded with fully_shard after the model's first call"), r
        # explain() runs a private copy, which FSDP2 refuses (AssertionError): said plainly
        assert r["explain_refusal"].startswith(
            "<root>, blocks.0, blocks.1, blocks.1.up, blocks.2 of Blocks sharded with "
            "fully_shard: fxamp.explain, locate_overflow and range_stats run a private copy"), r


# The slow tier (~35 s of two ranks on 2 cores for O1; O2 with float8 is the largest compile
# here): FSDP2 itself is the default tier's in test_training_matches_a_single_process and
# test_float8_reaches_fsdp2_sharded_modules.
@pytest.mark.parametrize("level, float8", [pytest.param("O1", False, marks=pytest.mark.slow),
                                           pytest.param("O2", True, marks=pytest.mark.slow)])
def test_a_sharded_gpt2_runs_as_the_unsharded_one(level, float8):
    # transformers' GPT-2 under FSDP2 (each block, then the root), bitwise the unsharded model:
    # with float8, the blocks' Conv1D addmms and the tied lm_head (run after a loop over the
    # blocks) in float8. Its embeddings share a class but not shapes: they must not share a
    # compiled forward, or Dynamo recompiles with dynamic shapes that float8 refuses.
    for r in run_ranks(w.gpt2_under_fsdp, level, float8):
        assert r["same"] and r["stays"] == [], r
        assert r["float8"] == (2 * 4 + 1 if float8 else 0), r  # 4 Conv1D per block, lm_head


@pytest.mark.slow  # float8 in FSDP2 modules: test_float8_reaches_fsdp2_sharded_modules
def test_the_distributed_example_runs_fsdp2_with_float8():
    # examples/distributed.py as docs/distributed.md runs it (torchrun, 2 ranks, Inductor):
    # FSDP2 + O2 + float8, an overflow on one rank, a DCP resume.
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "examples.distributed", "--strategy", "fsdp", "--float8"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "fsdp over 2 ranks (gloo), O2 + float8" in out, out
    assert "float8 GEMMs: fc1 float8, fc2 stays (M x K x N = 32 x 32 x 4" in out, out
    assert "rank 0: skipped 1," in out and "ranks agree: True" in out, out
    assert "bit-identical to the uninterrupted run: True" in out, out
