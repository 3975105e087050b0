"""What each rank runs in test_nvfp4_ranks.py: two Linear(32, 32) in NVFP4 with stochastically
rounded gradients (Note [The seed of NVFP4's stochastic rounding] in docs/design.md), wrapped
in DDP or sharded with FSDP2, trained on this rank's own data; returns the seed counter after
every step and one shared batch's input gradient. Imported by name in the spawned ranks (see
dist_harness.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_workers import full
from torch.nn.parallel import DistributedDataParallel as DDP

import fxamp
import fxamp.optim as fo
from fxamp.float8 import Float8Config

SEED = "fxamp_float8_nvfp4_seed"
WIDTH, BATCH = 32, 16  # per rank: M, K, N all multiples of NVFP4's block of 16
GEMMS = 2  # float8 GEMMs a forward: both Linears


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(WIDTH, WIDTH))
    return fxamp.compile(model, opt_level="O2", compiler="aot_eager",
                         float8=Float8Config(recipe="nvfp4", nvfp4_stochastic_rounding=True,
                                             min_dim=16))


def wrap(model, kind, **ddp_kwargs):
    if kind == "ddp":
        return DDP(model, **ddp_kwargs)
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def train(rank, kind, *, steps=3, rank1_counter=None, **ddp_kwargs):
    """`steps` AdamW steps on data of this rank's own (a generator seeded by rank and step).
    `rank1_counter`: a value set into rank 1's counter before DDP / fully_shard. Returns the
    counter before the wrap, after it, after each step, and the parameters after each step.
    Every step's input requires grad, as the probe's does (one compiled graph for both)."""
    model = make_model()
    counter = model.get_buffer(SEED)
    if rank1_counter is not None and rank == 1:
        with torch.no_grad():
            counter.fill_(rank1_counter)
    out = {"before_wrap": counter.item()}
    wrapped = wrap(model, kind, **ddp_kwargs)
    out["after_wrap"] = model.get_buffer(SEED).item()
    opt = fo.AdamW(wrapped.parameters(), lr=1e-2, compile=False, process_group="auto")
    out["counters"], out["params"] = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(BATCH, WIDTH, generator=gen).bfloat16().requires_grad_()
        y = torch.randn(BATCH, WIDTH, generator=gen)
        F.mse_loss(wrapped(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        out["counters"].append(model.get_buffer(SEED).item())
        out["params"].append(torch.cat([full(p) for p in model.parameters()]))
    # A probe: the same batch on every rank. The weights are the same on every rank, so the
    # input's gradient (computed on the rank, never reduced, its quantizations rounded with
    # this step's seeds) is the same only if the ranks drew the same seeds.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH, WIDTH, generator=gen).bfloat16().requires_grad_()
    wrapped(x).float().square().mean().backward()
    out["probe_grad"], out["probe_counter"] = x.grad.float(), model.get_buffer(SEED).item()
    opt.zero_grad()
    out["same_buffer"] = model.get_buffer(SEED) is counter  # the wrap kept the model's tensor
    out["float8_gemms"] = sum(n.meta["fxamp_float8"].float8
                              for g in fxamp.model.prepare.backend_of(model).compiled_graphs
                              for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta)
    out["world"] = dist.get_world_size()
    return out
