"""Apex's optimizer keywords and `cast_model_type=False`, written from Apex's behaviour.

FusedAdam, FusedLAMB and FusedSGD took keywords torch.optim does not (amsgrad=False,
adam_w_mode, set_grad_none, ...): code moving to fxamp's optimizers passes them, so each is
accepted with the values fxamp computes exactly, and any other value is refused before anything
is flattened, naming the value and the fix. `amp.initialize(..., cast_model_type=False)` leaves
the model's dtypes alone at every opt level (Apex's `if properties.cast_model_type:`).
"""

import pytest
import torch
from optim_helpers import loss_of, make_mlp

import fxamp
import fxamp.optim as fo
from fxamp import ConfigError


def _untouched(model, ptrs):
    return [p.data_ptr() for p in model.parameters()] == ptrs


@pytest.mark.parametrize("cls,kwargs", [
    (fo.Adam, dict(amsgrad=False, bias_correction=True, adam_w_mode=False, set_grad_none=True,
                   capturable=False)),
    (fo.AdamW, dict(amsgrad=False, bias_correction=True, adam_w_mode=True, set_grad_none=False,
                    capturable=False)),
    (fo.LAMB, dict(amsgrad=False, adam_w_mode=True, set_grad_none=True)),
    (fo.SGD, dict(wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False)),
])
def test_apex_fused_optimizer_keywords_are_accepted(cls, kwargs):
    model = make_mlp()
    opt = cls(model.parameters(), lr=1e-2, compile=False, **kwargs)
    loss_of(model, 0).backward()
    opt.step()  # steps like the optimizer built without them
    ref_model = make_mlp()
    ref = cls(ref_model.parameters(), lr=1e-2, compile=False)
    loss_of(ref_model, 0).backward()
    ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls,kwargs,words", [
    (fo.Adam, dict(amsgrad=True), ["amsgrad=True", "did not support it either",
                                   "torch.optim.Adam(amsgrad=True)"]),
    (fo.AdamW, dict(amsgrad=True), ["amsgrad=True"]),
    (fo.LAMB, dict(amsgrad=True), ["amsgrad=True"]),
    (fo.Adam, dict(adam_w_mode=True), ["adam_w_mode=True", "fxamp.optim.AdamW"]),
    (fo.AdamW, dict(adam_w_mode=False), ["adam_w_mode=False", "fxamp.optim.Adam"]),
    (fo.LAMB, dict(adam_w_mode=False), ["adam_w_mode=False", "L2"]),
    (fo.Adam, dict(bias_correction=False), ["bias_correction=False"]),
    (fo.Adam, dict(capturable=True), ["capturable=True", "host"]),
    (fo.SGD, dict(wd_after_momentum=True), ["wd_after_momentum=True"]),
    (fo.Adam, dict(amsgrad="no"), ["amsgrad='no'", "True or False"]),
])
def test_unsupported_apex_values_are_refused_before_flattening(cls, kwargs, words):
    model = make_mlp()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ConfigError) as e:
        cls(model.parameters(), lr=1e-2, compile=False, **kwargs)
    for word in words:
        assert word in str(e.value)
    assert _untouched(model, ptrs) and all(p.grad is None for p in model.parameters())


def test_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="unexpected keyword argument 'amsgard'"):
        fo.Adam(make_mlp().parameters(), amsgard=False)


# ------------------------------------------------------------------ cast_model_type=False
def _init(model, opt, **kw):
    return fo.initialize(model, opt, compiler="aot_eager", **kw)


@pytest.mark.parametrize("opt_level,dtype", [
    ("O0", torch.bfloat16), ("O1", torch.float32), ("O2", torch.float32), ("O2", torch.float16),
    ("O3", torch.bfloat16)])
def test_cast_model_type_false_leaves_the_model_dtypes_alone(opt_level, dtype):
    model = make_mlp(dtype)
    _, opt = _init(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level,
                   cast_model_type=False)
    assert all(p.dtype == dtype for p in model.parameters())
    x = torch.randn(4, 8, dtype=dtype)
    out = model(x)  # no cast on the way in, none on the way out (Apex patched no forward)
    if opt_level != "O1":  # O1 casts per op, as its patched functions did: a 16-bit output
        assert out.dtype == dtype
    with fo.scale_loss(out.float().square().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(p.dtype == dtype for p in model.parameters())


def test_cast_model_type_false_at_o2_keeps_masters_and_the_dynamic_scale():
    model = make_mlp(torch.bfloat16)
    _, opt = _init(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                   cast_model_type=False)
    assert all(b.master is not None for b in opt.buckets)  # O2's master_weights=True
    assert opt.loss_scalers[0].dynamic


def test_cast_model_type_false_config():
    for level in ("O0", "O1", "O2", "O3"):
        config = fxamp.AmpConfig.from_opt_level(level, cast_model_type=False).resolve("cpu")
        assert config.cast_model_type is False and config.output_dtype is None
    config = fxamp.AmpConfig.from_opt_level("O2", cast_model_type=False,
                                            cast_model_outputs=torch.float32).resolve("cpu")
    assert config.output_dtype == torch.float32


@pytest.mark.parametrize("value,words", [
    (True, ["cast_model_type=True", "a dtype", "False"]),
    ("False", ["cast_model_type='False'", "False"]),
])
def test_cast_model_type_true_is_refused(value, words):
    model = make_mlp()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ConfigError) as e:
        _init(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
              cast_model_type=value)
    for word in words:
        assert word in str(e.value)
    assert _untouched(model, ptrs)
