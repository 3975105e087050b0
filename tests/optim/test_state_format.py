"""StateFormat: 16-bit masters and 8-bit / bf16 moments inside the fused step (issue 14).

Tolerances come from the encodings (codecs.py): an int8 moment is off by at most half a code
step of its compander times the block's absmax (plus the bf16 scale's 2**-9); a 16-bit master
with a correction term keeps about 16 bits (kahan) or 8 bits below bf16's last place
(int8_error).
"""

import io

import re

import pytest
import torch
from optim_helpers import bit_identical, make_mlp, snapshot, train

import fxamp.optim as fo
from fxamp._compat import run_and_get_code
from fxamp.errors import ConfigError
from fxamp.optim.functional import codecs
from fxamp.optim.buffers.state_format import StateFormat

FORMATS = [StateFormat("kahan", "bf16"), StateFormat("int8_error", "int8"),
           StateFormat("stochastic", "int8"), StateFormat("fp32", "int8")]
IDS = [f"{f.master}-{f.moments}" for f in FORMATS]


def _wide(n=4096, seed=0):
    # Blocks whose values span six orders of magnitude, as moments do.
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 0, (n,), generator=gen)


@pytest.mark.parametrize("unsigned", [False, True])
def test_int8_moments_within_the_quantisation_bound(unsigned):
    x = _wide().abs() if unsigned else _wide()
    bufs = codecs.new_state(x.numel(), "int8", unsigned, "cpu")
    back = codecs.decode_state(codecs.encode_state(x, bufs, unsigned), unsigned).double()
    blocks, err = x.double().view(-1, codecs.BLOCK), (back - x.double()).view(-1, codecs.BLOCK)
    top = blocks.abs().amax(1, keepdim=True) * (1 + 2**-8)
    if unsigned:  # sqrt(v) within half a step of 255 codes, and never read back as 0
        # half a step of 255 codes, plus what the bf16 scale's rounding (2**-9) may clip
        root_err = (back.sqrt() - x.double().sqrt()).view(-1, codecs.BLOCK).abs()
        assert (root_err <= top.sqrt() * (1 / 510 + 2**-8)).all()
        assert (back[x > 0] > 0).all()
    else:  # half a code step over the compander's smallest slope (1/2 at |y| = 1)
        assert (err.abs() <= top / 127).all()
        small = blocks.abs() < top / 16  # near 0 the compander spends 4x finer steps
        assert (err.abs()[small] <= (top / 254).expand_as(err)[small]).all()


@pytest.mark.parametrize("master,bound", [("kahan", 2.0**-16), ("int8_error", 2.0**-15)])
def test_16_bit_masters_keep_bits_that_bf16_drops(master, bound):
    x = _wide()
    param = torch.zeros(x.numel(), dtype=torch.bfloat16)
    bufs = (param, codecs.new_correction(param, master))
    back = codecs.decode_master(codecs.encode_master(x, bufs, master, None), master)
    rel = ((back.double() - x.double()).abs() / x.double().abs()).max().item()
    plain = ((x.bfloat16().double() - x.double()).abs() / x.double().abs()).max().item()
    assert rel <= bound < plain / 16


# What the stored weight resolves near 1: 16 bits for kahan (bf16 + a bf16 remainder), half
# an ulp / 127 for int8_error; each step may round by half that, in the same direction.
RESOLUTION = {"kahan": 2.0**-16, "int8_error": 2.0**-15}


@pytest.mark.parametrize("master", ["kahan", "int8_error", "stochastic", "fp32"])
def test_small_updates_accumulate(master):
    # 400 updates of 1e-4 to a weight of 1 (bf16 spacing there: 2**-7 = 0.0078): plain
    # rounding to nearest loses every one of them; a correction keeps them to its resolution,
    # stochastic rounding in expectation (4096 weights averaged).
    param = torch.ones(4096, dtype=torch.bfloat16)
    bufs = (param, codecs.new_correction(param, master)) if master != "stochastic" else (param,)
    bufs = tuple(b for b in bufs if b is not None)
    kind = "fp32" if master == "fp32" else master
    for step in range(400):
        x = codecs.decode_master(bufs, kind) + 1e-4
        bits = codecs.random_bits(x.numel(), 0, torch.tensor(float(step)), 0)
        bufs = codecs.encode_master(x, bufs, kind, bits)
    mean = codecs.decode_master(bufs, kind).double().mean().item()
    if master == "fp32":  # a bf16 weight without a master, rounded to nearest
        assert mean == 1.0
    else:
        bound = 2e-3 if master == "stochastic" else 400 * RESOLUTION[master] / 2
        assert abs(mean - 1.04) < bound


def test_stochastic_rounding_is_unbiased_and_a_function_of_seed_and_step():
    x = torch.full((1 << 14,), 1 + 2**-9)  # a quarter of the way from 1 to the next bf16
    step = torch.tensor(7.0)
    up = codecs.encode_master(x, (x.bfloat16(),), "stochastic",
                              codecs.random_bits(x.numel(), 3, step, 0))[0].float()
    assert set(up.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs((up == 1 + 2**-7).double().mean().item() - 0.25) < 0.02
    again = codecs.random_bits(x.numel(), 3, step, 0)
    assert torch.equal(again, codecs.random_bits(x.numel(), 3, step, 0))
    for other in (codecs.random_bits(x.numel(), 4, step, 0),
                  codecs.random_bits(x.numel(), 3, step + 1, 0),
                  codecs.random_bits(x.numel(), 3, step, 1)):
        assert (other != again).double().mean() > 0.99


@pytest.mark.parametrize("moments,unsigned,beta,steps", [
    ("int8", True, 0.999, 500), ("bf16", True, 0.999, 500), ("int8", False, 0.9, 40)],
    ids=["int8-v", "bf16-v", "int8-m"])
def test_compact_moments_decay_as_adams_do(moments, unsigned, beta, steps):
    # Note [Rounding compact moments stochastically]: `steps` steps of x *= beta (no
    # gradient) against float64. Rounded to nearest, v never moves (e**0.5 = 1/0.999**500 times the float64 v)
    # and int8 m's small codes stall (its sum of |m| ends 11 % high); rounded stochastically,
    # the sum of |x| is within 1 % (measured: int8 v 0.5 % high, being unbiased in sqrt(v);
    # bf16 v 0.01 %; m 0.14 %) and the median element within 5 %.
    gen = torch.Generator().manual_seed(0)
    x0 = torch.rand(4096, generator=gen) ** 4 if unsigned else \
        torch.randn(4096, generator=gen) * torch.rand(4096, generator=gen) ** 3
    exact = x0.double().abs() * beta**steps
    for stochastic in (False, True):
        bufs = codecs.encode_state(x0, codecs.new_state(x0.numel(), moments, unsigned, "cpu"),
                                   unsigned)
        for step in range(steps):
            bits = codecs.random_bits(x0.numel(), 0, torch.tensor(float(step)), 1)
            bufs = codecs.encode_state(codecs.decode_state(bufs, unsigned) * beta, bufs,
                                       unsigned, bits if stochastic else None)
        got = codecs.decode_state(bufs, unsigned).double().abs()
        total = got.sum().item() / exact.sum().item()
        if stochastic:
            assert abs(total - 1) < 0.01
            assert abs((got / exact).median().item() - 1) < 0.05
        elif unsigned:
            assert (got / exact).median().item() == pytest.approx(beta**-steps, rel=0.01)
        else:
            assert total > 1.05


def _fixed_grad_run(cls, fmt, dtype, steps, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48).bfloat16().to(dtype)),
              torch.nn.Parameter(torch.randn(48).bfloat16().to(dtype))]
    opt = cls(params, lr=1e-3, state_format=fmt, compile=False, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            # bf16 values for both runs: the reference must see the same gradients (a .grad
            # set by hand is copied into the flat buffer at the step)
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16().to(dtype)
        opt.step()
    masters = [opt.state[p].get("master_param", p) for p in params]
    if fmt.master in ("kahan", "int8_error"):
        masters = [codecs.decode_master((p.detach().reshape(-1),
                                         opt.state[p]["master_correction"].reshape(-1)),
                                        fmt.master).view(p.shape) for p in params]
    return [m.double() for m in masters]


OPTIMIZERS = [(fo.AdamW, {}), (fo.Adam, {"weight_decay": 0.01}),
              (fo.SGD, {"momentum": 0.9}), (fo.LAMB, {})]


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_optimizers_track_a_float64_reference(cls, kw, fmt):
    # The same optimizer on float64 parameters and fp32 state is the reference: this measures
    # the storage format, the rule itself is tested against torch.optim elsewhere. int8 and
    # bf16 moments err by < 1 % of their block's largest value per step: within 5 % of how
    # far the weights moved. A corrected master may round each step by half its resolution
    # (|w| < 4 here). Stochastic rounding is a random walk of bf16 ulps (2**-6 at |w| < 4):
    # unbiased, with variance (distance moved) * ulp.
    steps = 30
    ref = _fixed_grad_run(cls, StateFormat(), torch.float64, steps, **kw)
    start = _fixed_grad_run(cls, StateFormat(), torch.float64, 0, **kw)
    got = _fixed_grad_run(cls, fmt, torch.bfloat16, steps, **kw)
    moved = max((r - r0).abs().max().item() for r, r0 in zip(ref, start))
    diff = torch.cat([(g - r).reshape(-1) for g, r in zip(got, ref)])
    if fmt.master == "stochastic":
        rms = diff.square().mean().sqrt().item()
        assert rms <= (moved * 2**-6) ** 0.5, (rms, moved)
        assert abs(diff.mean().item()) <= 4 * rms / diff.numel() ** 0.5
    else:
        rounding = steps * 4 * RESOLUTION.get(fmt.master, 0.0) / 2
        assert diff.abs().max().item() <= 0.05 * moved + rounding, (diff.abs().max(), moved)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_skipped_step_leaves_every_buffer_bit_identical(fmt):
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model.parameters(), lr=1e-2, state_format=fmt, compile=False)
    scaler = fo.LossScaler("dynamic", compile=False)
    train(model, opt, 3, scaler)
    before = snapshot(opt)
    train(model, opt, 1, scaler, bad_steps=(3,), start=3)
    assert opt.last_step_skipped() and bit_identical(before, snapshot(opt))


@pytest.mark.parametrize("fmt", FORMATS[1:3], ids=IDS[1:3])
def test_resume_from_a_weights_only_checkpoint_is_bit_exact(fmt):
    def build():
        model = make_mlp(torch.bfloat16)
        return model, fo.AdamW(model.parameters(), lr=1e-2, state_format=fmt, compile=False)
    model, opt = build()
    train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, 3, start=3)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["opt"]["state"][0]["exp_avg"].dtype == torch.int8
    assert saved["opt"]["state"][0]["exp_avg_sq_scale"].dtype == torch.bfloat16
    model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(model2, opt2, 3, start=3)
    assert bit_identical(snapshot(opt), snapshot(opt2))


def test_refusals_name_the_value_and_leave_everything_as_it_was():
    model = make_mlp(torch.float16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match="float16.*master='fp32'"):
        fo.AdamW(model.parameters(), state_format="low_memory", compile=False)
    assert all(p.grad is None and torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ConfigError, match="master_weights=False"):
        fo.AdamW(make_mlp(torch.bfloat16).parameters(), state_format="compensated",
                 master_weights=False, compile=False)
    with pytest.raises(ConfigError, match="'int4' is not one of"):
        StateFormat(moments="int4")
    with pytest.raises(ConfigError, match="preset 'tiny'"):
        fo.SGD(make_mlp().parameters(), state_format="tiny", compile=False)
    model = make_mlp(torch.bfloat16)
    low = fo.AdamW(model.parameters(), lr=1e-2, state_format="low_memory", compile=False)
    train(model, low, 2)
    full = fo.AdamW(make_mlp(torch.bfloat16).parameters(), compile=False)
    kept = snapshot(full)
    with pytest.raises(ConfigError, match="another state_format"):
        full.load_state_dict(low.state_dict())
    assert bit_identical(kept, snapshot(full))


@pytest.mark.parametrize("preset, expected", [("low_memory", 7.0625), ("compensated", 10),
                                              ("default", 16)])
def test_presets_keep_the_bytes_per_parameter_they_say(preset, expected):
    # model, gradient, the states, the masters; the optimizer's flat weights are the model's
    # memory (Note [Parameters own their storage]) and count once
    from benchmarks.optimizer_step import storage_bytes

    params = [torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16))]
    params[0].grad = torch.zeros_like(params[0])  # becomes a view of the flat gradient
    opt = fo.AdamW(params, state_format=preset, compile=False)
    kept = [t for p in params for t in (p, p.grad)] + [
        v for s in opt.held_state.values() for v in s.values()] + [
        t for b in opt.buckets for t in (b.param, b.master) if t is not None]
    measured = (storage_bytes(kept) - 4) / params[0].numel()  # less the shared step count
    assert measured == StateFormat.from_preset(preset).bytes_per_param() == expected


def _decoded_masters(opt):
    return [codecs.decode_master(s.weights(b), s.master) for b, s in
            zip(opt.buckets, opt.bucket_states)]


# low_memory's codecs through Inductor in the default tier (~25 s cold on 2 cores); the
# stochastic master's in the slow tier
@pytest.mark.parametrize("fmt", ["low_memory", pytest.param(StateFormat("stochastic", "int8"),
                                                            marks=pytest.mark.slow)])
def test_compiled_step_matches_the_eager_functions(fmt):
    # Note [Rounding that the compiler keeps]: without the integer rounding, Inductor dropped
    # the bf16 rounding inside the kernel and every correction term read as 0. Bit for bit
    # the two cannot agree on every CPU: eager torch.sqrt is not correctly rounded on every
    # build (measured on an AVX-512 machine: off by up to 0.75 ulp, where Inductor's is
    # correctly rounded), and a 1-ulp change of an update moves a code or a correction across a rounding
    # boundary now and then. So: nearly every element bit-identical, the decoded masters
    # within three steps of one int8 code of Adam's direction (lr * 2/127 each), and the
    # compiled corrections not all zero.
    runs, masters, lr = [], [], 1e-2
    for compile in (False, True):
        model = make_mlp(torch.bfloat16)
        opt = fo.AdamW(model.parameters(), lr=lr, state_format=fmt, compile=compile)
        train(model, opt, 3, fo.LossScaler("dynamic", compile=compile))
        runs.append(snapshot(opt))
        masters.append(_decoded_masters(opt))
    for eager, compiled in zip(*runs):
        assert eager.dtype == compiled.dtype
        assert (eager == compiled).double().mean() >= 0.95
    for eager, compiled in zip(*masters):
        assert (eager - compiled).abs().max() <= 3 * lr * 2 / 127
    if opt.state_format.master == "int8_error":  # opt: the compiled run's
        assert all(s.correction.count_nonzero() > s.correction.numel() // 2
                   for s in opt.bucket_states)


def _full_size(allocation: str, n: int) -> bool:
    # `empty_strided_cpu((dims), (strides), dtype)`: [blocks, 64] or n elements (the compiled
    # step's sizes are symbols: `(s48, 64)`, `(64*s48, )`), not one value per block.
    dims = [d.strip() for d in re.search(r"empty_strided_\w+\(\(([^)]*)\)", allocation)[1]
            .split(",") if d.strip()]
    return len(dims) > 1 or dims[0] == str(n) or re.search(r"\b64\*|\*64\b", dims[0])


@pytest.mark.parametrize("fmt", ["low_memory", "compensated"])
def test_the_compact_step_keeps_no_full_size_temporaries(fmt):
    # Note [A codec the CPU runs fast]: the new moments and the rounding decisions are
    # recomputed where they are used, never written to full-size buffers (fp32 ones moved more
    # bytes than the default step; bool ones were read by scalar loops, 28x the default step).
    n = 96 * 64
    params = [torch.nn.Parameter(torch.randn(n).bfloat16())]
    params[0].grad = torch.randn(n).bfloat16()
    opt = fo.AdamW(params, lr=1e-3, state_format=fmt)
    _, sources = run_and_get_code(opt.step)
    assert len(sources) == 2  # the prologue (per-step scalars) and the update
    allocations = [line for line in sources[1].splitlines() if "empty_strided_cpu((" in line]
    assert "empty_strided_cpu((" in sources[0], "the pattern no longer matches Inductor's code"
    # torch 2.11 keeps a copy of the 1-byte codes it reads before overwriting them (1 byte an
    # element); nothing wider is allowed.
    full = [line for line in allocations if _full_size(line, n)]
    assert all(line.endswith(("torch.int8)", "torch.uint8)")) for line in full), full
    assert "bool*" not in sources[1]


def test_added_param_group_gets_the_format_and_a_refusal_is_atomic():
    model = make_mlp(torch.bfloat16)
    opt = fo.AdamW(model[0].parameters(), lr=1e-2, state_format="low_memory", compile=False)
    opt.add_param_group({"params": list(model[2].parameters())})
    # held before its first step (Note [State appears when a parameter is stepped])
    assert model[2].weight not in opt.state
    assert opt.held_state[model[2].weight]["exp_avg"].dtype == torch.int8
    assert opt.held_state[model[2].weight]["master_correction"].dtype == torch.int8
    train(model, opt, 2)
    kept, groups = snapshot(opt), len(opt.param_groups)
    with pytest.raises(ConfigError, match="float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]})
    assert len(opt.param_groups) == groups and bit_identical(kept, snapshot(opt))
