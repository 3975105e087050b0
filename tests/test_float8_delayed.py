"""Float8 delayed scaling (Note [Delayed scaling lives in the model]): amax histories are
buffers of the model, updated by the compiled graph without a host sync, in the state_dict,
and a run resumed from a checkpoint continues bit for bit."""

import copy

import pytest
import torch

import fxamp
from fxamp._compat import aot_autograd, make_boxed_func
from fxamp.float8 import Float8Config

DELAYED = Float8Config(scaling="delayed", history_len=4)
E4M3 = torch.float8_e4m3fn


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))


def _histories(model):
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("fxamp_float8_")}


def _train(model, opt, batches):
    for x in batches:
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=g) * (i + 1) for i in range(n)]


def test_histories_are_buffers_updated_in_the_graph():
    forward_graphs = []

    def record(gm, inputs):
        forward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    model = _model()
    fxamp.compile(model, opt_level="O1", float8=DELAYED,
                  compiler=aot_autograd(fw_compiler=record,
                                              bw_compiler=lambda gm, _: make_boxed_func(gm.forward)))
    batches = _batches(3, seed=1)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), batches)
    hist = _histories(model)
    assert sorted(hist) == ["fxamp_float8_g0_0_linear0_input", "fxamp_float8_g0_0_linear0_weight",
                            "fxamp_float8_g0_2_linear1_input", "fxamp_float8_g0_2_linear1_weight"]
    # newest first: the amax of each step's bf16 input (O1 casts it), the oldest slot unseen
    expected = [x.to(torch.bfloat16).abs().max().float() for x in reversed(batches)] + [0.0]
    assert torch.equal(hist["fxamp_float8_g0_0_linear0_input"], torch.tensor(expected))
    assert all(h.dtype == torch.float32 for h in hist.values())
    # one graph, no host sync inside it: no .item() / scalar read-back node
    assert len(forward_graphs) == 1
    targets = {str(n.target) for n in forward_graphs[0].graph.nodes}
    assert not any("_local_scalar_dense" in t or "item" in t for t in targets), targets


def test_delayed_scale_comes_from_the_history():
    model = _model()[:1]
    fxamp.compile(model, opt_level="O1", float8=DELAYED, compiler="aot_eager")
    x1, x2 = torch.randn(32, 64), torch.randn(32, 64) * 3
    with torch.no_grad():
        model(x1)
        y2 = model(x2)
    # step 2 scales x2 by finfo.max / amax(x1): the history holds only x1's amax then
    w, b = model[0].weight.to(torch.bfloat16), model[0].bias.to(torch.bfloat16)
    xb1, xb2 = x1.to(torch.bfloat16), x2.to(torch.bfloat16)
    def dequant(t, amax):
        scale = (torch.finfo(E4M3).max / amax.double()).float()
        return (t.float() * scale).clamp(-448, 448).to(E4M3).double() / scale.double()
    w_amax = w.abs().max()  # the weight's history: its own amax (unchanged, no step taken)
    ref = dequant(xb2, xb1.abs().max()) @ dequant(w.t(), w_amax)
    out = (ref.to(torch.bfloat16) + b).float()
    err = (y2.double() - out.double()).abs().max().item()
    assert err <= 2 ** -7 * out.abs().max().item(), err
    # values above the delayed amax saturate: the dynamic scale would not have clipped them
    dynamic = dequant(xb2, xb2.abs().max()) @ dequant(w.t(), w_amax)
    assert (ref - dynamic).abs().max() > 0.05


def test_resume_from_a_checkpoint_is_bit_exact():
    batches = _batches(5, seed=2)
    model = _model()
    fxamp.compile(model, opt_level="O1", float8=DELAYED)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _train(model, opt, batches[:3])
    ckpt = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, batches[3:])

    def resumed(keep_histories):
        fresh = _model()
        fxamp.compile(fresh, opt_level="O1", float8=DELAYED)
        state = {k: v for k, v in ckpt[0].items()
                 if keep_histories or not k.startswith("fxamp_float8_")}
        fresh.load_state_dict(state, strict=keep_histories)  # before the first call
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.01, momentum=0.9)
        fresh_opt.load_state_dict(ckpt[1])
        _train(fresh, fresh_opt, batches[3:])
        return fresh

    fresh = resumed(keep_histories=True)
    for (k, v), (k2, v2) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    # without its histories the run does not continue the same way
    forgetful = resumed(keep_histories=False)
    assert not torch.equal(model[0].weight, forgetful[0].weight)


def test_delayed_scaling_needs_the_model():
    with pytest.raises(fxamp.ConfigError, match="use fxamp.compile"):
        fxamp.backend("O1", float8=DELAYED)
