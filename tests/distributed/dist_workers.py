"""What each rank runs in the distributed tests: a tiny MLP compiled by fxamp, wrapped in DDP or
sharded with FSDP2, trained a few steps on its slice of a global batch. Imported by name in the
spawned ranks (see dist_harness.py).

The models compile with compiler="aot_eager" and the steps with compile=False (the same
functions, eagerly) so that a test costs seconds; `compile_step=True` runs the step through
Inductor with the collectives traced into it.
"""

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fxamp
import fxamp.optim as fo

IN, HIDDEN, OUT, GLOBAL_BATCH = 8, 16, 4, 8
INF = float("inf")


def make_model(level, seed=0, hidden=HIDDEN):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, OUT))
    return fxamp.compile(model, opt_level=level, compiler="aot_eager")


def global_batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, OUT,
                                                                      generator=gen)


def rank_slice(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def wrap(model, kind):
    """DDP, FSDP2 (fully_shard per Linear, then the root; "fsdp_mp" with FSDP2's own bf16
    MixedPrecisionPolicy, whose fp32 shards are the masters), or nothing ("single")."""
    if kind == "ddp":
        return DDP(model)
    if kind.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": policy} if kind == "fsdp_mp" else {}
        for layer in (model[0], model[2]):
            fully_shard(layer, **kwargs)
        return fully_shard(model, **kwargs)
    return model


def full(t):
    """A parameter or state as one plain fp32 tensor (all-gathered if it is a DTensor)."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float().reshape(-1)


def poison_grad(model, kind):
    """Put an inf into one local gradient element, on this rank only (after backward, so past
    DDP's allreduce: only the step's own agreement can make the other rank skip)."""
    grad = getattr(model, "module", model)[0].weight.grad
    local = grad.to_local() if kind.startswith("fsdp") else grad
    with torch.no_grad():
        local.view(-1)[0] = INF


def train(model, opt, scaler, steps, *, rank=0, world=1, kind="single", start=0, bad=()):
    """Steps `start`..`start + steps - 1`; `bad` holds (step, rank) pairs to poison."""
    skipped, norms = [], []
    for step in range(start, start + steps):
        x, y = (rank_slice(t, rank, world) for t in global_batch(step))
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        if (step, rank) in bad:
            poison_grad(model, kind)
        opt.step(scaler)
        opt.zero_grad()
        skipped.append(bool(opt.found_inf))
        norms.append(opt.grad_norm.item())
    return skipped, norms


def summary(model, opt, scaler, skipped, norms):
    masters = [full(e["master_param"]) for e in opt.state.values() if "master_param" in e]
    moments = [full(e[k]) for e in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    # Everything else a state format keeps: 8-bit moments' scales, masters' corrections.
    extra = [full(v) for e in opt.state.values() for k, v in sorted(e.items())
             if k.endswith(("_scale", "_correction"))]
    return dict(params=torch.cat([full(p) for p in model.parameters()]),
                masters=torch.cat(masters) if masters else None, moments=torch.cat(moments),
                extra=torch.cat(extra) if extra else None, decoded=decoded_moments(opt),
                dtype=next(model.parameters()).dtype, scale=scaler.get_scale(),
                skipped=skipped, norms=norms, step=opt.step_counts.item())


def decoded_moments(opt):
    """Adam's m and v of every parameter in fp32, whole (8-bit ones decoded per shard)."""
    from fxamp.optim.functional import codecs

    out = []
    for bucket, held in zip(opt.buckets, opt.bucket_states):
        for key, bufs in zip(opt.algorithm.state_keys, held.states):
            flat = codecs.decode_state(bufs, key == "exp_avg_sq")
            out += [full(v) for v in bucket.views(flat)]
    return torch.cat(out)


def run(rank, kind, level, *, steps=3, bad=(), max_grad_norm=None, compile_step=False,
        state_format=None, hidden=HIDDEN):
    """Train `kind` ("ddp", "fsdp", "single") on this rank's slice of each global batch."""
    world = dist.get_world_size() if kind != "single" else 1
    model = make_model(level, hidden=hidden)
    wrapped = wrap(model, kind)
    opt = fo.AdamW(wrapped.parameters(), lr=1e-2, max_grad_norm=max_grad_norm,
                   compile=compile_step, process_group="auto" if kind != "single" else None,
                   state_format=state_format)
    scaler = fo.LossScaler()
    skipped, norms = train(wrapped, opt, scaler, steps, rank=rank if kind != "single" else 0,
                           world=world, kind=kind, bad=bad)
    return summary(model, opt, scaler, skipped, norms)


def run_with_reference(rank, kind, level, **kwargs):
    """This rank's run, and on rank 0 also the single-process run on the whole global batch."""
    out = {"dist": run(rank, kind, level, **kwargs)}
    if rank == 0:
        out["single"] = run(0, "single", level, **{k: v for k, v in kwargs.items()
                                                    if k != "bad"})
    return out


def build(kind, level, *, seed=0, compile_step=False, max_grad_norm=None, state_format=None,
          hidden=HIDDEN):
    model = make_model(level, seed=seed, hidden=hidden)
    wrapped = wrap(model, kind)
    opt = fo.AdamW(wrapped.parameters(), lr=1e-2, max_grad_norm=max_grad_norm,
                   compile=compile_step, state_format=state_format)
    return model, wrapped, opt, fo.LossScaler()


def resume(rank, kind, level, path, *, steps=4, bad=((1, 1),), **build_kwargs):
    """An uninterrupted run of `steps`, and one saved half-way with fxamp.distributed.save,
    loaded into a model built from another seed, and continued."""
    from fxamp import distributed as fd

    world, half = dist.get_world_size(), steps // 2
    model, wrapped, opt, scaler = build(kind, level, **build_kwargs)
    done = train(wrapped, opt, scaler, steps, rank=rank, world=world, kind=kind, bad=bad)
    straight = summary(model, opt, scaler, *done)

    model, wrapped, opt, scaler = build(kind, level, **build_kwargs)
    first = train(wrapped, opt, scaler, half, rank=rank, world=world, kind=kind, bad=bad)
    fd.save(path, model=wrapped, optimizer=opt, scaler=scaler)
    model, wrapped, opt, scaler = build(kind, level, seed=1, **build_kwargs)
    fd.load(path, model=wrapped, optimizer=opt, scaler=scaler)
    rest = train(wrapped, opt, scaler, steps - half, rank=rank, world=world, kind=kind,
                 start=half, bad=bad)
    resumed = summary(model, opt, scaler, first[0] + rest[0], first[1] + rest[1])
    return straight, resumed


def low_memory(rank, kind, path):
    """Training with the low_memory state format (int8_error masters, int8 moments) beside the
    single process's, and a resume, in one spawn. Hidden width 17: FSDP2's shards of the first
    layer are uneven (9 and 8 rows: 2 blocks of scales and 1, padded to 2)."""
    fmt = dict(state_format="low_memory", hidden=17)
    trained = run_with_reference(rank, kind, "O2", **fmt)
    if rank == 0:  # the same single process with fp32 masters and moments
        trained["fp32_state"] = run(0, "single", "O2", hidden=17)
    return trained, resume(rank, kind, "O2", path, **fmt)


def wrong_orders(rank):
    """The orders fxamp refuses, by the words of what was refused."""
    from fxamp.errors import ConfigError

    refused = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                torch.nn.Linear(HIDDEN, OUT))
    try:
        fxamp.compile(DDP(model), opt_level="O2")
    except ConfigError:
        refused.append("compile(DDP)")
    ddp = DDP(model)
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")
    try:
        ddp(global_batch(0)[0])
    except Exception as e:  # Dynamo reports a backend's error as BackendCompilerFailed
        if "Call fxamp.compile(model) first, then DistributedDataParallel(model)" in str(e):
            refused.append("DDP then compile")
        else:
            raise
    return refused


def sharded_refusals(rank):
    """What fxamp refuses with FSDP2-sharded parameters, by the start of each message."""
    from fxamp.errors import ConfigError

    model = wrap(make_model("O2"), "fsdp")
    attempts = {
        "LAMB": lambda: fo.LAMB(model.parameters(), compile=False),
        "FP16_Optimizer": lambda: fo.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
        "process_group=None": lambda: fo.AdamW(model.parameters(), compile=False,
                                               process_group=None),
    }
    refused = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ConfigError as e:
            refused[name] = str(e)
    return refused


def save_low_memory(rank, path):
    """Two low_memory FSDP2 steps on uneven shards (width 17), saved with fxamp.distributed."""
    from fxamp import distributed as fd

    model, wrapped, opt, scaler = build("fsdp", "O2", state_format="low_memory", hidden=17)
    train(wrapped, opt, scaler, 2, rank=rank, world=dist.get_world_size(), kind="fsdp")
    fd.save(path, model=wrapped, optimizer=opt, scaler=scaler)


def load_low_memory(rank, path):
    """Load save_low_memory's checkpoint into however many ranks run this; returns the refusal
    (or None) and whether model, optimizer state and scale stayed bit-identical."""
    from fxamp import distributed as fd
    from fxamp.errors import ConfigError

    model, wrapped, opt, scaler = build("fsdp", "O2", state_format="low_memory", hidden=17,
                                        seed=1)
    train(wrapped, opt, scaler, 1, rank=rank, world=dist.get_world_size(), kind="fsdp")

    def tensors():
        sd = fd.state_dict(wrapped, opt, scaler)
        flat = [*sd["model"].values(), *(v for e in sd["optimizer"]["state"].values()
                                         for v in e.values())]
        return [t.to_local().clone() if hasattr(t, "to_local") else torch.as_tensor(t).clone()
                for t in flat] + [torch.tensor(scaler.get_scale())]

    before = tensors()
    try:
        fd.load(path, model=wrapped, optimizer=opt, scaler=scaler)
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    after = tensors()
    unchanged = len(before) == len(after) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))
    return refusal, unchanged



def replicated_low_memory(rank):
    """low_memory AdamW with clipping over DTensor parameters replicated on the mesh (as
    tensor-parallel code leaves the parameters it does not split), every rank stepping the same
    gradients; rank 0 also runs the same steps on plain parameters. Returns the weights, the
    8-bit state and what the state dict holds of the scales."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    def steps(replicated):
        torch.manual_seed(0)
        model = torch.nn.Linear(24, 17).bfloat16()  # 408 + 17 elements: 7 + 1 blocks
        if replicated:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for name, p in list(model.named_parameters()):
                setattr(model, name, torch.nn.Parameter(
                    distribute_tensor(p.detach(), mesh, [Replicate()])))
        group = {} if replicated else {"process_group": None}  # the single run: no group
        opt = fo.AdamW(model.parameters(), lr=1e-2, state_format="low_memory",
                       max_grad_norm=0.01, compile=False, **group)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                g = (torch.randn(p.shape, generator=gen) * 0.1).bfloat16()
                p.grad = DTensor.from_local(g, p.device_mesh, p.placements) if replicated else g
            opt.step()
            opt.zero_grad()
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        state = opt.state_dict()["state"]
        return {"params": [local(p.detach()).clone() for p in model.parameters()],
                "state": [local(v).clone() for e in state.values() for k, v in sorted(e.items())
                          if k != "step"],
                "scales": [(type(v).__name__, tuple(v.shape),
                            [str(x) for x in getattr(v, "placements", ())])
                           for e in state.values() for k, v in sorted(e.items())
                           if k.endswith("_scale")],
                "norm": opt.grad_norm.item()}

    out = {"dist": steps(True)}
    if rank == 0:
        out["single"] = steps(False)
    return out


class Block(torch.nn.Module):
    """A residual MLP block: a module of the user's code (Dynamo compiles its frame)."""

    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Blocks(torch.nn.Module):
    """Blocks called in a loop, then a head (whose input is wider than the blocks'): the shape
    of a transformer under FSDP2."""

    def __init__(self, width=32, depth=3, out=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(2 * width, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(torch.cat([x, x.square()], -1))


def _doubled(forward, x):
    return 2 * forward(x)


def float8_under_fsdp(rank):
    """fxamp O2 + float8 tensorwise on `Blocks` sharded with FSDP2 after fxamp.compile: every
    block, one block's own nn.Linear inside it, and the root (the head stays in the root's
    unit), vs the same model unsharded with and without float8, every rank fed the same batch
    (Note [Sharded modules are compiled one by one])."""
    from torch.distributed.fsdp import fully_shard

    from fxamp.float8 import Float8Config

    def build(f8):
        # skip_modules by path: the sharded graphs must name modules as the model does
        recipe = Float8Config(recipe="tensorwise", min_dim=16, skip_modules=("blocks.2.down",))
        torch.manual_seed(0)
        model = Blocks()
        # a forward set on the instance (as hook libraries do) must survive the sharding
        model.head.forward = functools.partial(_doubled, model.head.forward)
        return fxamp.compile(model, opt_level="O2", compiler="aot_eager",
                             float8=recipe if f8 else None)

    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(7))

    def run(model):
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.float().square().mean().backward()
        return out.detach(), [full(p.grad) for p in model.parameters()]

    sharded = build(True)
    fully_shard(sharded.blocks[1].up)  # a torch.nn module: Dynamo skips its frame
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = {"sharded": run(sharded), "sharded_again": run(sharded)}
    runs.update({"float8": run(build(True)), "bf16": run(build(False))})
    choices = {n.meta["fxamp_float8"].module: n.meta["fxamp_float8"].float8
               for g in fxamp.model.prepare.backend_of(sharded).compiled_graphs
               for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta}

    def same(a, b):
        return torch.equal(runs[a][0], runs[b][0]) and all(
            torch.equal(g, h) for g, h in zip(runs[a][1], runs[b][1]))

    delayed = fxamp.compile(Blocks(), opt_level="O2", compiler="aot_eager",
                            float8=Float8Config(scaling="delayed", min_dim=16))
    fully_shard(delayed)
    before = [p.to_local().clone() for p in delayed.parameters()]
    try:
        delayed(x)
        refusal = None
    except fxamp.ConfigError as e:
        refusal = str(e)
    untouched = all(torch.equal(a, p.to_local()) and a.dtype == p.dtype
                    for a, p in zip(before, delayed.parameters()))
    try:
        fxamp.explain(sharded, x)
        explain_refusal = None
    except fxamp.ConfigError as e:
        explain_refusal = str(e)
    late = fxamp.compile(Blocks(), opt_level="O2", compiler="aot_eager")
    late(x)
    fully_shard(late.blocks[0])
    try:
        late(x)
        late_refusal = None
    except fxamp.ConfigError as e:
        late_refusal = str(e)
    return {"as_float8": same("sharded", "float8") and same("sharded_again", "float8"),
            "delayed_refusal": refusal, "delayed_untouched": untouched,
            "late_refusal": late_refusal,
            "explain_refusal": explain_refusal,
            "as_bf16": same("sharded", "bf16"),
            "float8_differs": not same("float8", "bf16"), "choices": choices,
            "state_dtypes": sorted({str(v.dtype) for v in sharded.state_dict().values()}),
            "warnings": [str(c.message) for c in caught]}


def gpt2_under_fsdp(rank, level, float8):
    """A transformers GPT-2 (2 layers, random weights, no dropout) at `level` (+ float8
    tensorwise), each block and the root sharded with FSDP2, vs the same model unsharded: with
    float8, the GEMMs of the blocks (transformers' Conv1D: addmm) and the tied lm_head."""
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from fxamp.float8 import Float8Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def build():
        torch.manual_seed(0)
        return fxamp.compile(GPT2LMHeadModel(config), opt_level=level, compiler="aot_eager",
                             float8=Float8Config(recipe="tensorwise", min_dim=16)
                             if float8 else None)

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def run(model):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.loss.detach(), out.logits.detach()] + [full(p.grad)
                                                           for p in model.parameters()]

    sharded = build()
    for block in sharded.transformer.h:
        fully_shard(block)
    fully_shard(sharded)
    got, want = run(sharded), run(build())
    choices = [n.meta["fxamp_float8"] for g in fxamp.model.prepare.backend_of(sharded).compiled_graphs
               for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta]
    return {"same": all(torch.equal(a, b) for a, b in zip(got, want)),
            "float8": sum(c.float8 for c in choices),
            "stays": [c.reason for c in choices if not c.float8]}
