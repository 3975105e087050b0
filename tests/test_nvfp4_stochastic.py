"""NVFP4's stochastic rounding of the output gradient, torchao's and TransformerEngine's
training recipes' (Float8Config(recipe="nvfp4", nvfp4_stochastic_rounding=True); Note [The seed
of NVFP4's stochastic rounding] in docs/design.md): the noise is the standalone functions' with
the seeds the model's counter gives, bit for bit; the counter is a buffer in the state_dict, so
a resumed run is bit-exact and copies keep their own; eval forwards leave it; refusals."""

import copy
import dataclasses
import re

import pytest
import torch

import fxamp
from fxamp.errors import ConfigError
from fxamp.float8 import Float8Config
from fxamp.float8.block_gemm import block_formats
from fxamp.float8.blockscaled import blockscaled_mm
from fxamp.float8.nvfp4 import NVFP4_RHT_SIGNS

BF16 = torch.bfloat16
SEED = "fxamp_float8_nvfp4_seed"
SR = Float8Config(recipe="nvfp4", nvfp4_stochastic_rounding=True)


def _sr(fmt):
    return dataclasses.replace(fmt, stochastic=True)


def _model(f8=SR, compiler="aot_eager"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64, bias=False))
    return fxamp.compile(model, opt_level="O2", float8=f8, compiler=compiler)


def _batch(i=0):
    torch.manual_seed(100 + i)
    return torch.randn(32, 64).to(BF16), torch.randn(32, 64).to(BF16)


@pytest.mark.parametrize("signs", [None, NVFP4_RHT_SIGNS])
def test_gradients_are_the_standalone_gemms_with_the_counters_seeds(signs):
    torch.manual_seed(0)
    model = fxamp.compile(torch.nn.Linear(64, 64, bias=False), opt_level="O2",
                          float8=dataclasses.replace(SR, nvfp4_rht_signs=signs),
                          compiler="aot_eager")
    x, g = torch.randn(32, 64).to(BF16), torch.randn(32, 64).to(BF16)
    for step in range(2):
        model.weight.grad = None
        xr = x.clone().requires_grad_()
        model(xr).backward(g)
        # the GEMM drew key `step` (one GEMM a forward) and advanced the counter
        assert model.get_buffer(SEED).item() == step + 1
        act, w_fmt = block_formats("nvfp4")
        rot = act if signs is None else dataclasses.replace(act, rht_signs=signs)
        key = torch.tensor(step)
        w = model.weight.detach()
        grad_w = blockscaled_mm(x.t(), g, a_format=rot, b_format=_sr(rot), b_noise=key * 2 + 1)
        grad_x = blockscaled_mm(g, w, a_format=_sr(act), b_format=w_fmt, a_noise=key * 2)
        assert torch.equal(model.weight.grad, grad_w.t().to(BF16))
        assert torch.equal(xr.grad, grad_x.to(BF16))
    rounded = blockscaled_mm(x.t(), g, a_format=rot, b_format=rot).t().to(BF16)
    assert not torch.equal(model.weight.grad, rounded)


def _train(model, steps, start=0):
    opt = fxamp.optim.SGD(model.parameters(), lr=0.1)
    for i in range(start, steps):
        x, t = _batch(i)
        torch.nn.functional.mse_loss(model(x).float(), t.float()).backward()
        opt.step()
        opt.zero_grad()
    return opt


# Inductor's variant (40 s here) in the slow tier, with the block-scaled recipes' other
# Inductor matrices
@pytest.mark.parametrize("compiler", ["aot_eager",
                                      pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_resumed_run_is_bit_exact_and_copies_keep_their_own_counter(compiler, tmp_path):
    whole = _model(compiler=compiler)
    _train(whole, 4)
    assert whole.get_buffer(SEED).item() == 8  # two GEMMs a forward, four forwards

    half = _model(compiler=compiler)
    opt = _train(half, 2)
    assert SEED in half.state_dict()
    torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.pt")
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    resumed = _model(compiler=compiler)
    resumed.load_state_dict(state["model"])
    assert resumed.get_buffer(SEED).item() == 4
    opt = fxamp.optim.SGD(resumed.parameters(), lr=0.1)
    opt.load_state_dict(state["opt"])
    for i in range(2, 4):
        x, t = _batch(i)
        torch.nn.functional.mse_loss(resumed(x).float(), t.float()).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)

    twin = copy.deepcopy(resumed)
    twin(_batch()[0])
    assert twin.get_buffer(SEED).item() == 10 and resumed.get_buffer(SEED).item() == 8


def test_eval_forwards_leave_the_counter_and_explain_names_the_rounding():
    model = _model()
    x, _ = _batch()
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    assert model.get_buffer(SEED).item() == 0  # the grad mode decides, as for amax histories
    model(x).float().sum().backward()
    assert model.get_buffer(SEED).item() == 2
    assert "gradients rounded stochastically" in str(fxamp.explain(model, x))


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe="mxfp8", nvfp4_stochastic_rounding=True),
     "float8 nvfp4_stochastic_rounding applies to recipe='nvfp4', not 'mxfp8' (leave it "
     "False)"),
    (dict(recipe="nvfp4", nvfp4_stochastic_rounding=1),
     "float8 nvfp4_stochastic_rounding=1 must be True or False"),
])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Float8Config(**kwargs)


def test_the_backend_alone_refuses_it_for_want_of_a_state_dict():
    with pytest.raises(ConfigError, match="keeps the counter its noise is drawn from in the "
                                          "model's state_dict"):
        fxamp.backend(opt_level="O2", float8=SR)
