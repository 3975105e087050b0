"""Note [Parameters own their storage] (fxamp/optim/buffers/flat.py): after fxamp's optimizer
is built, and after it steps, every parameter owns a storage of its own, as in eager torch, so
that what reads the model (safetensors, `vector_to_parameters`, `data_ptr()`) sees the model
eager torch would; what is written into a parameter between steps is where the next step
starts. (Before, the parameters were views of one flat buffer: safetensors' `save_model`
refused them, accelerate's `save_model` wrote 1 tensor of 4.)"""

import copy

import pytest
import torch
import torch.nn.functional as F

import fxamp
import fxamp.optim as fo
from optim_helpers import make_mlp

safetensors_torch = pytest.importorskip("safetensors.torch")


def _own_storage(model):
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return len(storages) == len(list(model.parameters())) and all(
        p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


def _train(model, opt, scaler=None, steps=2):
    for i in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()
        opt.step(scaler) if scaler else opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_parameters_own_their_storage_and_savers_write_every_tensor(level, tmp_path):
    model = fxamp.compile(make_mlp(), opt_level=level, compiler="aot_eager")
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    assert _own_storage(model)
    _train(model, opt, fo.LossScaler(compile=False))
    assert _own_storage(model)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))  # refused before: "shared tensors"
    written = safetensors_torch.load_file(str(path))
    assert set(written) == set(model.state_dict()) and len(written) == 4
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())


def test_the_step_matches_torch_and_writes_into_the_parameters_it_was_given():
    # the parameters move once, into windows of the flat weights, when the optimizer is built;
    # the step writes them there, and never moves them again
    model, ref = make_mlp(), make_mlp()
    params = list(model.parameters())
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    ptrs = [p.data_ptr() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(model, opt)
    _train(ref, ref_opt)
    assert list(model.parameters()) == params
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)  # fp32 AdamW, another order


def test_writes_between_steps_are_where_the_next_step_starts():
    # load_state_dict (in place), vector_to_parameters (p.data replaced), a no_grad copy_:
    # each is taken into the optimizer's flat weights (and masters at O2) before the step
    model = fxamp.compile(make_mlp(), opt_level="O2", compiler="aot_eager")
    opt = fo.AdamW(model.parameters(), lr=0.0, weight_decay=0.0, compile=False)
    _train(model, opt, steps=1)
    target = make_mlp(seed=1).to(torch.bfloat16)
    writes = [
        lambda: model.load_state_dict(target.state_dict()),
        lambda: torch.nn.utils.vector_to_parameters(
            torch.nn.utils.parameters_to_vector(target.parameters()), model.parameters()),
        lambda: [p.copy_(t) for p, t in zip(model.parameters(), target.parameters())],
    ]
    for write in writes:
        for p in model.parameters():
            with torch.no_grad():
                p.zero_()
        _train(model, opt, steps=1)  # lr 0: the weights stay what they are
        with torch.no_grad():
            write()
        _train(model, opt, steps=1)
        for p, t in zip(model.parameters(), target.parameters()):
            assert torch.equal(p, t)
        for p in model.parameters():
            assert torch.equal(opt.state[p]["master_param"].to(torch.bfloat16), p)


def test_a_copy_of_the_model_is_not_stepped():
    # copy.deepcopy of a model whose parameters are views of one buffer copied the buffer
    # per parameter; now it is an ordinary copy, and the optimizer steps only the original
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    twin = copy.deepcopy(model)
    _train(model, opt, steps=1)
    assert not torch.equal(model[0].weight, twin[0].weight)
    assert _own_storage(twin)


def test_a_step_moves_the_parameter_the_model_computes_with():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.5, compile=False)
    before = model[0].weight.detach().clone()
    F.linear(torch.ones(1, 8), model[0].weight).sum().backward()
    opt.step()
    assert torch.equal(model[0].weight, before - 0.5)


def test_a_parameter_saved_alone_writes_its_own_bytes_and_outlives_the_optimizer(tmp_path):
    # each parameter is a window of its own into the flat weights: torch.save of one writes
    # that parameter, not the bucket; dropping the optimizer leaves the model whole
    import gc
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    _train(model, opt, steps=1)
    weight = model[0].weight
    torch.save(weight.detach(), tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    assert loaded.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    assert torch.equal(loaded, weight)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    del opt
    gc.collect()
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


def test_a_step_moves_version_counters_as_an_in_place_update_does():
    # torch.optim's update is in place: a backward through weights a step changed is refused.
    # fxamp's update writes the flat weights; the parameters' versions move all the same
    for opt_cls in (torch.optim.SGD, lambda ps, lr: fo.SGD(ps, lr=lr, compile=False)):
        model = make_mlp()
        opt = opt_cls(model.parameters(), lr=0.1)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        loss = model(torch.ones(2, 8)).sum()
        opt.step()  # the weights the forward saved change
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_parameter_without_a_gradient_keeps_its_version():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)
    model[0].weight.requires_grad_(False)
    versions = [p._version for p in model.parameters()]
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    after = [p._version for p in model.parameters()]
    assert after[0] == versions[0] and all(a > v for a, v in zip(after[1:], versions[1:]))
