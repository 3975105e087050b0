"""Run a function on N spawned ranks with gloo over 127.0.0.1, bounded in time.

Each rank joins a process group with a short collective timeout, runs the function, sends its
result (or its traceback) back through a queue, and always destroys the group. The parent
waits for every rank until a deadline; as soon as one rank fails, the others (which may be
blocked in a collective) are terminated, so a failing rank fails the test in seconds rather
than hanging it. Imported by name (pytest puts this directory on sys.path; spawned children
inherit it).

The default bounds (300 s for the ranks, 120 s for one collective) leave room for CI, where the
2.11 and 2.14 legs run side by side on two cores, so two ranks share a core with another leg's
compiles (a 90 s bound failed there once); a failing rank still fails the test in seconds.
"""

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import traceback

import torch
import torch.distributed as dist

WORLD = 2


class RankFailed(RuntimeError):
    """A rank raised, died or ran past the deadline; the message holds what it said."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results, collective_timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            results.put((rank, "ok", _to_bytes(fn(rank, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def _to_bytes(value) -> bytes:
    # Tensors through the queue as bytes: torch's shared-memory handles would outlive the rank.
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def run_ranks(fn, *args, world=WORLD, timeout_s=300.0, collective_timeout_s=120.0):
    """`fn(rank, *args)` on `world` ranks; returns the results by rank.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), exited without a result,
            or the ranks did not finish within `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world, port, fn, args, results, collective_timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _collect(procs, results, world, timeout_s):
    import time

    deadline = time.monotonic() + timeout_s
    out = {}
    while len(out) < world:
        try:
            rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
            if dead:
                raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(set(range(world)) - set(out))} did not finish "
                                 f"within {timeout_s} s")
            continue
        if status == "error":
            raise RankFailed(_errors(results, {rank: value}))
        out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    return [out[r] for r in range(world)]


def _errors(results, errors, grace_s=3.0):
    # The other ranks usually fail soon after (a peer reset in a collective): report them all,
    # so that the rank that failed by its own fault is named whichever message came first.
    import time

    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = value
    return "\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items()))
