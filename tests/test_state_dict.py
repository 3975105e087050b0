"""`model.state_dict()` of an fxamp model is the live weights, as in eager torch, at every level.

Note [The state dict is the live weights] (fxamp/model/cast_model.py). Until issue 32 an O2/O3
model's state dict held fp32 copies (Apex's 2019 O2 hook did the same), so whatever wrote into
its values in place, an EMA (timm's ModelEmaV2/V3 update `model.state_dict()` values), weight
averaging or a loader's `sd[k].copy_(...)`, changed a copy and never the model: an EMA of an O2
model stayed at its first weights. The first four tests failed on that code; the round trips
hold before and after.
"""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import fxamp

LEVELS = ["O0", "O1", "O2", "O3"]
STORED = {"O0": torch.float32, "O1": torch.float32, "O2": torch.bfloat16, "O3": torch.bfloat16}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _compiled(level, **kwargs):
    return fxamp.compile(_net(), opt_level=level, compiler="aot_eager", **kwargs)


def _live(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


def _train(model, opt, batches):
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_values_are_the_stored_tensors(level):
    model = _compiled(level)
    live = _live(model)
    for key, value in model.state_dict().items():
        assert value.dtype == live[key].dtype, key
        assert value.data_ptr() == live[key].data_ptr(), key  # the same storage, not a copy
    assert model[0].weight.dtype == STORED[level]
    # BatchNorm stays fp32 at O2 (keep_batchnorm_fp32), in its state dict too
    assert model.state_dict()["1.weight"].dtype == (torch.bfloat16 if level == "O3"
                                                    else torch.float32)


@pytest.mark.parametrize("level", LEVELS)
def test_in_place_writes_through_the_state_dict_reach_the_model_and_its_graph(level):
    model = _compiled(level).eval()
    x = torch.randn(4, 8)
    before = model(x)
    for value in model.state_dict().values():
        if value.is_floating_point():
            value.mul_(0.5)
    assert torch.equal(model[0].weight.float(), _compiled(level)[0].weight.float() * 0.5)
    assert not torch.equal(model(x), before)  # the compiled graph reads the written weights


@pytest.mark.parametrize("level", LEVELS)
def test_an_ema_of_the_state_dict_moves_with_the_model(level):
    # timm's ModelEmaV2 update, written out: lerp every floating state-dict value in place.
    model = _compiled(level)
    ema = copy.deepcopy(model)
    start = copy.deepcopy(ema.state_dict())
    opt = fxamp.optim.SGD(model.parameters(), lr=0.5)
    for x, y in _batches(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
                if e.is_floating_point():
                    e.lerp_(m, 0.5)
                else:
                    e.copy_(m)
    for key, value in ema.state_dict().items():
        if value.is_floating_point():
            assert not torch.equal(value, start[key]), f"{key} of the EMA never moved"
    assert ema.state_dict()["1.num_batches_tracked"] == 3


@pytest.mark.parametrize("level", LEVELS)
def test_a_loader_copying_into_the_state_dict_moves_the_master_weights(level):
    # `sd[k].copy_(v)` is a write through the parameter: the fused optimizer's next step
    # starts from it (Note [The state dict is the live weights]), not from its old master.
    model = _compiled(level)
    opt = fxamp.optim.SGD(model.parameters(), lr=0.0)
    _train(model, opt, _batches(1))
    loaded = torch.full_like(model[0].weight, 0.25)
    model.state_dict()["0.weight"].copy_(loaded)
    _train(model, opt, _batches(1))  # lr 0: the step writes the master back as it is
    assert torch.equal(model[0].weight, loaded)


def test_torch_averaged_model_ema_moves_at_o2():
    # torch's own EMA (parameters and buffers, foreach lerp) on a copy of an O2 model
    model = _compiled("O2")
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True)
    start = ema.module[0].weight.detach().clone()
    opt = fxamp.optim.SGD(model.parameters(), lr=0.5)
    for x, y in _batches(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    assert ema.module[0].weight.dtype == torch.bfloat16
    assert not torch.equal(ema.module[0].weight, start)


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("level", LEVELS)
def test_checkpoints_round_trip_exactly(level):
    # O2/O3 checkpoints hold the 16-bit weights as stored; they load bit for bit into a fresh
    # fxamp model and exactly (an upcast) into the plain eager fp32 model, as fp32 ones load
    # into an fxamp model rounded as fxamp.compile would round them.
    model = _compiled(level)
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, _batches(2))
    ckpt = _saved(model.state_dict())
    assert {k: v.dtype for k, v in ckpt.items()} == \
        {k: v.dtype for k, v in model.state_dict().items()}
    fresh = _compiled(level)
    fresh.load_state_dict(ckpt)
    eager = _net()
    eager.load_state_dict(ckpt)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
        assert eager.state_dict()[key].dtype in (torch.float32, torch.int64)
        assert torch.equal(eager.state_dict()[key], value.to(eager.state_dict()[key].dtype)), key
    back = _compiled(level)
    back.load_state_dict(eager.state_dict())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_resume_continues_bit_for_bit_at_o2():
    batches = _batches(4)
    model = _compiled("O2")
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = fxamp.LossScaler()
    def run(m, o, s, part):
        for x, y in part:
            s.scale(F.cross_entropy(m(x), y)).backward()
            o.step(s)
            o.zero_grad()
    run(model, opt, scaler, batches[:2])
    ckpt = _saved({"model": model.state_dict(), "opt": opt.state_dict(),
                   "scaler": scaler.state_dict()})
    run(model, opt, scaler, batches[2:])
    resumed = _compiled("O2")
    resumed_opt = fxamp.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_scaler = fxamp.LossScaler()
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_scaler.load_state_dict(ckpt["scaler"])
    run(resumed, resumed_opt, resumed_scaler, batches[2:])
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in model.state_dict().items())
