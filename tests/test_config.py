"""Opt-level presets, Apex's override checks (by message text), and the compile-time guards."""

import dataclasses
import re

import pytest
import torch
import torch.nn as nn

import fxamp
from fxamp import AmpConfig, ConfigError


@pytest.mark.parametrize("level,cast,keep_bn,master,scale", [
    ("O0", torch.float32, None, False, 1.0),
    ("O1", None, None, None, "dynamic"),
    ("O2", torch.float16, True, True, "dynamic"),
    ("O3", torch.float16, False, False, 1.0),
])
def test_apex_property_table(level, cast, keep_bn, master, scale):
    config = AmpConfig.from_opt_level(level, dtype="fp16")
    assert (config.cast_model_type, config.keep_batchnorm_fp32, config.master_weights,
            config.loss_scale) == (cast, keep_bn, master, scale)
    assert config.patch_torch_functions == (level == "O1")


def test_resolve_picks_device_defaults():
    cpu = AmpConfig.from_opt_level("O2").resolve("cpu")
    cuda = AmpConfig.from_opt_level("O2").resolve("cuda")
    assert (cpu.dtype, cpu.policy, cpu.cast_model_type) == (torch.bfloat16, "torch-cpu",
                                                            torch.bfloat16)
    assert (cuda.dtype, cuda.policy, cuda.cast_model_type) == (torch.float16, "torch-cuda",
                                                               torch.float16)


@pytest.mark.parametrize("kwargs,message", [
    (dict(opt_level="o1"), "opt_level 'o1' is not one of 'O0', 'O1', 'O2', 'O3' (the prefix is an upper-case letter O)"),
    (dict(opt_level="01"), "the letter O, not the number zero"),
    (dict(opt_level="O4"), "opt_level 'O4' is not one of 'O0', 'O1', 'O2', 'O3'"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "O1 inserts casts around ops rather than casting the model weights"),
    (dict(opt_level="O1", master_weights=True), "master_weights cannot be set with O1"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32 cannot be set with O1"),
    (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions=True (per-op casting) is only valid with O1, not O2"),
    (dict(opt_level="O1", dtype=torch.float64), "dtype=torch.float64 is not one of torch.float16, torch.bfloat16"),
    (dict(opt_level="O1", dtype="int8"), "dtype='int8' is not one of"),
    (dict(opt_level="O2", dtype="bf16", cast_model_type="fp16"), "cast_model_type=torch.float16 conflicts with dtype=torch.bfloat16"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32='yes' must be True, False, 'True' or 'False'"),
    (dict(opt_level="O2", loss_scale="big"), "loss_scale='big' must be a positive number"),
    (dict(opt_level="O2", loss_scale=-1), "loss_scale=-1 must be a positive finite number"),
    (dict(opt_level="O1", policy="tf"), "policy='tf' is not one of torch-cuda, torch-cpu, apex"),
    (dict(opt_level="O1", op_overrides={"aten.softmax": "fp64"}), "op_overrides['aten.softmax']='fp64' is not one of lower, fp32, promote, keep"),
    (dict(opt_level="O1", module_overrides={"head": "half"}), "module_overrides['head']='half'"),
])
def test_refused_overrides(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        AmpConfig.from_opt_level(**kwargs)


def test_apex_string_spellings_accepted():
    config = AmpConfig.from_opt_level("O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    assert config.keep_batchnorm_fp32 is False and config.loss_scale == 128.0


def test_config_is_frozen_hashable_and_keyed():
    a = AmpConfig.from_opt_level("O1", op_overrides={"aten.softmax": "fp32"})
    b = AmpConfig.from_opt_level("O1", op_overrides={"aten.softmax": "fp32"})
    c = AmpConfig.from_opt_level("O1", op_overrides={"aten.softmax": "lower"})
    assert a == b and hash(a) == hash(b) and a.cache_key() == b.cache_key()
    assert a.cache_key() != c.cache_key()
    assert len(a.cache_key()) == 16 and AmpConfig().cache_key() == AmpConfig().cache_key()
    with pytest.raises(Exception):
        a.opt_level = "O2"


def test_every_field_of_the_parts_is_a_declared_attribute_of_the_config():
    # Declared on AmpConfig (not forwarded by __getattr__), each reading its part's field.
    config = AmpConfig.from_opt_level("O2", loss_scale=128.0, num_losses=2,
                                      module_overrides={"fc": "fp32"}).resolve("cpu")
    for part in ("graph", "scaler"):
        for field in dataclasses.fields(getattr(config, part)):
            assert field.name in vars(AmpConfig), field.name
            assert getattr(config, field.name) is getattr(getattr(config, part), field.name)
    assert not hasattr(AmpConfig, "__getattr__")
    with pytest.raises(AttributeError):
        config.no_such_setting


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def _snapshot(model):
    return {k: (v.dtype, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("kwargs,message", [
    (dict(opt_level="O1", master_weights=True), "master_weights cannot be set with O1"),
    (dict(opt_level="O2", op_overrides={"aten.sofmax": "fp32"}), "op_overrides key 'aten.sofmax' is not an ATen op"),
    (dict(opt_level="0O"), "is not one of"),
])
def test_bad_input_leaves_model_unchanged(kwargs, message):
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ConfigError, match=re.escape(message)):
        fxamp.compile(model, **kwargs)
    after = _snapshot(model)
    assert all(before[k][0] == after[k][0] and torch.equal(before[k][1], after[k][1])
               for k in before)
    assert fxamp.config_of(model) is None and model._compiled_call_impl is None


def test_non_float_model_refused():
    model = nn.Module()
    model.register_buffer("table", torch.arange(8))
    model.weight = nn.Parameter(torch.ones(2, dtype=torch.int32), requires_grad=False)
    with pytest.raises(ConfigError, match="has no floating-point parameters or buffers"):
        fxamp.compile(model)


def test_not_a_module_refused():
    with pytest.raises(ConfigError, match="fxamp.compile takes an nn.Module, not function"):
        fxamp.compile(lambda x: x)


def test_compile_twice_refused():
    model = fxamp.compile(_model(), opt_level="O2")
    with pytest.raises(ConfigError, match=re.escape("already prepared by fxamp.compile (O2)")):
        fxamp.compile(model, opt_level="O1")


def test_enabled_false_returns_model_unchanged():
    model = _model()
    before = _snapshot(model)
    assert fxamp.compile(model, opt_level="O2", enabled=False) is model
    assert model._compiled_call_impl is None
    assert all(v.dtype == before[k][0] for k, v in model.state_dict().items())


def test_o2_storage_and_its_state_dict():
    model = fxamp.compile(_model(), opt_level="O2", dtype="fp16")
    assert model[0].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32  # keep_batchnorm_fp32
    assert model[1].running_mean.dtype == torch.float32
    stored = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert {k: v.dtype for k, v in model.state_dict().items()} == \
        {k: v.dtype for k, v in stored.items()}  # Note [The state dict is the live weights]
    config = fxamp.config_of(model)
    assert (config.opt_level, config.dtype, config.device_type) == ("O2", torch.float16, "cpu")


def test_o3_casts_batchnorm_and_o0_casts_to_fp32():
    o3 = fxamp.compile(_model(), opt_level="O3")
    assert o3[1].weight.dtype == torch.bfloat16 and o3[1].running_var.dtype == torch.bfloat16
    o0 = fxamp.compile(_model().half(), opt_level="O0")
    assert o0[0].weight.dtype == torch.float32


def test_module_override_keeps_storage_fp32():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    fxamp.compile(model, opt_level="O2", module_overrides={"LayerNorm": "fp32", "2": "fp32"})
    assert [m.weight.dtype for m in model] == [torch.bfloat16, torch.float32, torch.float32]
