"""The guard of Note [16-bit weights need fp32 masters] in a plain loop: an O2/O3 model whose
weights fxamp stores in 16 bits, stepped by an optimizer that keeps no fp32 masters, warns once
per optimizer, naming the fix; fxamp's optimizers, initialize's conversions, FP16_Optimizer, O1
and fp32 weights do not (Note [Where fxamp sees an optimizer step])."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxamp
import fxamp.optim as fo
from fxamp.errors import MasterWeightsWarning


def _model(level, dtype=torch.bfloat16, prepare=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if prepare:
        fxamp.compile(model, opt_level=level, dtype=dtype, compiler="aot_eager")
    return model


def _warnings_of_steps(model, opt, steps=3, scaler=None):
    """MasterWeightsWarnings raised while `opt` trains `model` for a few steps."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            x, y = torch.randn(4, 8), torch.randn(4, 4)
            loss = F.mse_loss(model(x).float(), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    return [w for w in caught if issubclass(w.category, MasterWeightsWarning)]


@pytest.mark.parametrize("level,dtype", [("O2", torch.bfloat16), ("O3", torch.bfloat16),
                                         ("O2", torch.float16)])
def test_a_torch_optimizer_stepping_16_bit_weights_warns_once(level, dtype):
    model = _model(level, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hits = _warnings_of_steps(model, opt)
    assert len(hits) == 1
    text = str(hits[0].message)
    assert f"fxamp {level}: torch.optim AdamW steps 4 {str(dtype)[6:]} parameters" in text
    assert "fxamp.optim.AdamW" in text and "fxamp.initialize(model, optimizer" in text
    assert hits[0].filename == __file__  # points at the user's opt.step()
    # a second optimizer over the same weights is warned about too, once
    assert len(_warnings_of_steps(model, torch.optim.SGD(model.parameters(), lr=1e-3))) == 1


def test_a_copy_of_the_model_is_guarded_too():
    twin = copy.deepcopy(_model("O2"))
    assert len(_warnings_of_steps(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3))) == 1


def _fused(model):
    return fo.AdamW(model.parameters(), lr=1e-3, compile=False)


def _converted(model):
    return fo.initialize([], torch.optim.AdamW(model.parameters(), lr=1e-3),
                         compiler="aot_eager", opt_level="O2")[1]


@pytest.mark.parametrize("level,make_opt", [
    ("O2", _fused),                                                   # fxamp's optimizer
    ("O1", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),     # fp32 weights at O1
    ("O0", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),     # fp32 weights
], ids=["fxamp-AdamW", "O1", "O0"])
def test_no_warning_where_the_weights_have_masters_or_are_fp32(level, make_opt):
    model = _model(level)
    assert _warnings_of_steps(model, make_opt(model)) == []


def test_no_warning_for_initialize_conversions_and_fp16_optimizer():
    torch.manual_seed(0)
    model = _model("O2", prepare=False)
    torch_opts = [torch.optim.AdamW(model[0].parameters(), lr=1e-3),
                  torch.optim.RMSprop(model[2].parameters(), lr=1e-3)]  # no fused counterpart
    model, (fused, wrapped) = fo.initialize(model, torch_opts, opt_level="O2",
                                            compiler="aot_eager")
    assert isinstance(wrapped, fo.FP16_Optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with fo.scale_loss(F.mse_loss(model(torch.randn(4, 8)).float(),
                                          torch.randn(4, 4)), [fused, wrapped]) as scaled:
                scaled.backward()
            fused.step(), wrapped.step()
            fused.zero_grad(), wrapped.zero_grad()
    assert not [w for w in caught if issubclass(w.category, MasterWeightsWarning)]


def test_a_model_fxamp_did_not_prepare_is_not_its_business():
    model = _model("O2", prepare=False).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    assert not [w for w in caught if issubclass(w.category, MasterWeightsWarning)]


def test_the_scaler_protocol_and_the_guard_warn_once_between_them():
    model = _model("O2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert len(_warnings_of_steps(model, opt, scaler=fxamp.LossScaler(semantics="torch"))) == 1
