"""fxamp with torch.distributed: DDP or FSDP2, ranks agreeing on overflow, a DCP checkpoint.

    torchrun --nproc-per-node 2 -m examples.distributed                    # DDP, O2
    torchrun --nproc-per-node 2 -m examples.distributed --strategy fsdp --opt-level O1
    torchrun --nproc-per-node 2 -m examples.distributed --strategy fsdp --float8  # O2 + float8

CPU (gloo over localhost, bf16) when no GPU is visible, else one GPU per rank with nccl (fp16);
the GPU path was not run when this was written. Each rank trains a small MLP on its half of
every global batch. At step 5 an inf is written into rank 1's gradient only: every rank skips
that step and halves its loss scale, because the compiled step all-reduces the overflow flag.
Half-way, model, optimizer (with fp32 masters) and loss scaler are saved with
torch.distributed.checkpoint; a second run from a fresh model loads them and must end
bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxamp
import fxamp.distributed as fd
from examples.models import MLP
from fxamp.float8 import Float8Config
from fxamp.optim import AdamW, LossScaler

IN, OUT, BATCH = 16, 4, 64


def setup() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(strategy: str, opt_level: str, device: torch.device, seed: int = 0,
          float8: bool = False):
    """fxamp.compile first, then DDP or fully_shard, then the fxamp optimizer (the one order
    that works; docs/distributed.md). With `float8`, the GEMMs big enough for it run in float8
    tensorwise, sharded modules included (docs/float8.md, "FSDP2")."""
    torch.manual_seed(seed)
    model = fxamp.compile(MLP(IN, 32, OUT).to(device), opt_level=opt_level,
                          float8=Float8Config(recipe="tensorwise", min_dim=16) if float8 else None)
    if strategy == "ddp":
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.fc1, model.fc2):
            fully_shard(layer)
        wrapped = fully_shard(model)
    opt = AdamW(wrapped.parameters(), lr=3e-3, max_grad_norm=1.0)  # agrees over the world
    return model, wrapped, opt, LossScaler("dynamic")


def batch(step: int, device: torch.device):
    """This rank's half of the global batch of `step`."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, IN, generator=gen)
    y = x[:, :OUT].sin() + 0.1 * torch.randn(BATCH, OUT, generator=gen)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = BATCH // world
    return x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)


def train(model, wrapped, opt, scaler, steps: range, device, log: bool) -> torch.Tensor:
    skipped = torch.zeros((), dtype=torch.int64, device=device)  # counted on the device
    for step in steps:
        x, y = batch(step, device)
        loss = F.mse_loss(wrapped(x).float(), y)
        scaler.scale(loss).backward()
        if step == 5 and dist.get_rank() == 1:  # an overflow on one rank only
            grad = model.fc1.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
        opt.step(scaler)
        opt.zero_grad()
        skipped += opt.found_inf
        if log and step % 5 == 4:
            print(f"  step {step + 1:3d}  loss {loss.item():.4f}  scale {scaler.get_scale():.0f}"
                  f"  grad norm {opt.grad_norm.item():.3f}", flush=True)
    return skipped


def weights(model) -> torch.Tensor:
    """All parameters as one fp32 vector, gathered from the shards under FSDP2."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                      .reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--opt-level", choices=("O1", "O2"), default="O2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--float8", action="store_true",
                        help="GEMMs in float8 tensorwise (on top of --opt-level)")
    args = parser.parse_args()
    device = setup()
    rank, half = dist.get_rank(), args.steps // 2
    try:
        if rank == 0:
            print(f"{args.strategy} over {dist.get_world_size()} ranks ({dist.get_backend()}), "
                  f"{args.opt_level}{' + float8' if args.float8 else ''}", flush=True)
        model, wrapped, opt, scaler = build(args.strategy, args.opt_level, device,
                                            float8=args.float8)
        skipped = train(model, wrapped, opt, scaler, range(half), device, rank == 0)
        if args.float8 and rank == 0:
            print(f"  {float8_gemms(model)}", flush=True)
        ckpt = [tempfile.mkdtemp(prefix="fxamp_dcp_") if rank == 0 else None]
        dist.broadcast_object_list(ckpt)
        fd.save(ckpt[0], model=wrapped, optimizer=opt, scaler=scaler)
        skipped += train(model, wrapped, opt, scaler, range(half, args.steps), device, rank == 0)
        report(model, opt, scaler, skipped)

        model2, wrapped2, opt2, scaler2 = build(args.strategy, args.opt_level, device, seed=1,
                                                float8=args.float8)
        fd.load(ckpt[0], model=wrapped2, optimizer=opt2, scaler=scaler2)
        train(model2, wrapped2, opt2, scaler2, range(half, args.steps), device, False)
        same = torch.equal(weights(model), weights(model2))
        if rank == 0:
            print(f"resumed from a checkpoint of step {half}: bit-identical to the "
                  f"uninterrupted run: {same}", flush=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt[0])
    finally:
        dist.destroy_process_group()


def float8_gemms(model) -> str:
    """Which forward GEMMs of the graphs fxamp compiled for `model` run in float8, and why not."""
    graphs = fxamp.model.prepare.backend_of(model).compiled_graphs
    choices = [node.meta["fxamp_float8"] for graph in graphs
               for node in graph.graph_module.graph.nodes if "fxamp_float8" in node.meta]
    return "float8 GEMMs: " + ", ".join(
        f"{c.module} {'float8' if c.float8 else 'stays (' + c.reason.split(';')[0] + ')'}"
        for c in choices)


def report(model, opt, scaler, skipped) -> None:
    """What each rank saw; every rank must agree."""
    mine = (int(skipped), scaler.get_scale(), int(opt.step_counts.item()),
            round(weights(model).double().sum().item(), 8), str(next(model.parameters()).dtype))
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if dist.get_rank() == 0:
        for r, (s, scale, steps, checksum, dtype) in enumerate(seen):
            print(f"  rank {r}: skipped {s}, scale {scale:.0f}, optimizer steps {steps}, "
                  f"weights ({dtype}) sum {checksum:.8f}")
        print(f"  ranks agree: {all(x == seen[0] for x in seen)}", flush=True)


if __name__ == "__main__":
    main()
