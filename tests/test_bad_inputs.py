"""A catalogue of bad inputs: each is refused with fxamp's own error, whose message names the bad
value and the valid choices or the fix, and leaves the model, the optimizer and the scaler
bit-identical (same bytes, same storage, same dtypes, same compiled call and marker).

Each case is (world, action, fragments): a fresh world (a model with a buffer, a fused AdamW
that has stepped, a LossScaler), the bad call made in it, and text that the message must hold.
Issue 10's items 7-10 all appear here; most failed on main before the safety change (they were
accepted, or raised an AttributeError / IndexError / TypeError / AssertionError of torch's).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fxamp
import fxamp.optim as fo
from fxamp import AmpConfig
from fxamp.debug import locate_overflow

NAN, INF = float("nan"), float("inf")


class World:
    def __init__(self, kind):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                         torch.nn.ReLU(), torch.nn.Linear(8, 2))
        self.x = torch.randn(6, 4)
        self.extra = torch.nn.Linear(2, 2)  # a second model for initialize([...])
        if kind in ("prepared", "recast"):
            fxamp.compile(self.model, opt_level="O2", compiler="aot_eager")
        self.opt = fo.AdamW(self.model.parameters(), lr=1e-2, compile=False)
        self.scaler = fo.LossScaler(compile=False)
        self.backward()
        self.opt.step(self.scaler)
        if kind == "scaled":
            self.backward()  # scaled gradients waiting for their step
        if kind == "recast":
            self.model.float()
        if kind == "moved":
            self.model.to(torch.bfloat16)
        if kind == "adagrad":  # a torch optimizer initialize would wrap, already stepped
            self.adagrad = torch.optim.Adagrad(self.extra.parameters())
            self.extra(torch.randn(3, 2)).sum().backward()
            self.adagrad.step()

    def backward(self):
        self.scaler.scale(self.model(self.x).float().square().mean()).backward()


def _bytes(t):
    return (t.dtype, tuple(t.shape), t.detach().cpu().contiguous().reshape(-1)
            .view(torch.uint8).numpy().tobytes())


def _model_state(model):
    tensors = [(n, t.data_ptr(), _bytes(t)) for n, t in
               [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    grads = [(n, None if p.grad is None else _bytes(p.grad)) for n, p in model.named_parameters()]
    return tensors, grads, model._compiled_call_impl, fxamp.config_of(model), \
        len(model._state_dict_hooks)


def _opt_state(opt):
    flat = [opt.step_counts, opt.found_inf, opt._device_state.hyper,
            *(t for h in opt.bucket_states for s in h.states for t in s)]
    for b in opt.buckets:
        flat += [*b.params, b.grad] + [t for t in (b.param, b.master) if t is not None]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return [_bytes(t) for t in flat], repr(groups), opt.folding.raw_scaler, opt.folding.folded_scalers


def _scaler_state(scaler):
    tensors = [] if scaler._state is None else [_bytes(t) for t in scaler._state]
    return tensors, scaler._init, scaler.rule, scaler.scaled_graphs.roots[:]


def snapshot(w):
    return (_model_state(w.model), _model_state(w.extra), _opt_state(w.opt),
            _scaler_state(w.scaler))


def _other_model_state():
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = fo.AdamW(other.parameters(), compile=False)
    other(torch.randn(4, 3)).sum().backward()
    opt.step()  # a state for each parameter (none before: as torch.optim's)
    return opt.state_dict()


O2 = AmpConfig.from_opt_level("O2")
compile_ = lambda **kw: (lambda w: fxamp.compile(w.model, **{"compiler": "aot_eager", **kw}))
scaler_ = lambda **kw: (lambda w: fo.LossScaler(compile=False, **kw))
adamw = lambda **kw: (lambda w: fo.AdamW(w.model.parameters(), compile=False, **kw))
load_scaler = lambda sd: (lambda w: w.scaler.load_state_dict(sd))


def _group_dict(w, **changes):
    sd = w.opt.state_dict()
    sd["param_groups"][0].update(changes)
    return sd


CASES = [
    # --- opt levels and Apex overrides (through fxamp.compile: the model must not change)
    ("opt_level_lower_o", compile_(opt_level="o1"), ["'o1'", "'O0', 'O1', 'O2', 'O3'"]),
    ("opt_level_zero", compile_(opt_level="01"), ["'01'", "letter O, not the number zero"]),
    ("opt_level_O4", compile_(opt_level="O4"), ["'O4'", "'O0', 'O1', 'O2', 'O3'"]),
    ("dtype_int8", compile_(dtype="int8"), ["dtype='int8'", "torch.float16, torch.bfloat16"]),
    ("o1_cast_model_type", compile_(opt_level="O1", cast_model_type="fp16"),
     ["cast_model_type=torch.float16", "use O2 or O3"]),
    ("o1_keep_batchnorm", compile_(opt_level="O1", keep_batchnorm_fp32=True),
     ["keep_batchnorm_fp32", "cannot be set with O1"]),
    ("o1_master_weights", compile_(opt_level="O1", master_weights=True),
     ["master_weights", "cannot be set with O1"]),
    ("o2_patch_functions", compile_(opt_level="O2", patch_torch_functions=True),
     ["patch_torch_functions=True", "only valid with O1"]),
    ("keep_batchnorm_yes", compile_(opt_level="O2", keep_batchnorm_fp32="yes"),
     ["keep_batchnorm_fp32='yes'", "True, False, 'True' or 'False'"]),
    ("dtype_conflict", compile_(opt_level="O2", dtype="fp16", cast_model_type="bf16"),
     ["cast_model_type=torch.bfloat16", "conflicts with dtype=torch.float16"]),
    ("outputs_int8", compile_(opt_level="O2", cast_model_outputs="int8"),
     ["cast_model_outputs='int8'", "torch.float32"]),
    ("outputs_true", compile_(opt_level="O1", cast_model_outputs=True),
     ["cast_model_outputs=True", "or False (the bool: leave the outputs as computed)"]),
    ("policy_typo", compile_(policy="apx"), ["policy='apx'", "torch-cuda, torch-cpu, apex"]),
    ("op_override_choice", compile_(op_overrides={"aten.softmax": "fp16"}),
     ["'fp16'", "lower, fp32, promote, keep"]),
    ("op_override_key", compile_(op_overrides={"aten.nosuchop": "fp32"}),
     ["'aten.nosuchop'", "'aten.softmax.int'"]),
    ("module_override_no_module", compile_(opt_level="O2", module_overrides={"nosuch": "fp32"}),
     ["'nosuch'", "names no module", "BatchNorm1d", "named_modules() paths"]),
    ("module_override_choice", compile_(module_overrides={"0": "half"}),
     ["'half'", "lower, fp32, promote, keep"]),
    # --- loss-scale settings in the config
    ("loss_scale_auto", compile_(loss_scale="auto"), ["loss_scale='auto'", "'dynamic'"]),
    ("loss_scale_negative", compile_(loss_scale=-1), ["loss_scale=-1", "positive finite"]),
    ("loss_scale_true", compile_(loss_scale=True), ["loss_scale=True", "positive finite"]),
    ("loss_scale_inf", compile_(loss_scale=INF), ["loss_scale=inf", "positive finite"]),
    ("min_loss_scale_negative", compile_(min_loss_scale=-1),
     ["min_loss_scale=-1", "positive finite", "default floor"]),
    ("max_loss_scale_zero", compile_(max_loss_scale=0), ["max_loss_scale=0", "positive finite"]),
    ("min_above_max", compile_(min_loss_scale=8.0, max_loss_scale=4.0),
     ["min_loss_scale=8.0", "max_loss_scale=4.0", "floor must be <= the cap"]),
    ("num_losses_zero", compile_(num_losses=0), ["num_losses=0", "positive int"]),
    # --- compile's own arguments (validated before the weights are cast)
    ("compiler_tvm", compile_(opt_level="O2", compiler="tvm"),
     ["compiler='tvm'", "'inductor', 'aot_eager', 'eager'"]),
    ("mode_unknown", lambda w: fxamp.compile(w.model, opt_level="O2", mode="fastest"),
     ["mode='fastest'", "max-autotune"]),
    ("options_unknown", lambda w: fxamp.compile(w.model, opt_level="O2",
                                                options={"max_autotun": True}),
     ["'max_autotun'", "did you mean", "max_autotune"]),
    ("options_not_dict", lambda w: fxamp.compile(w.model, options="max_autotune"),
     ["options='max_autotune'", "dict"]),
    ("mode_with_aot_eager", compile_(opt_level="O2", mode="max-autotune"),
     ["mode='max-autotune'", "compiler='aot_eager'", "use compiler='inductor'"]),
    ("dynamic_yes", compile_(opt_level="O2", dynamic="yes"),
     ["dynamic='yes'", "None, True, False"]),
    ("fullgraph_string", compile_(opt_level="O2", fullgraph="no"),
     ["fullgraph='no'", "True or False"]),
    ("config_string", compile_(config="O2"), ["config='O2'", "opt_level='O2'"]),
    ("config_and_opt_level", compile_(config=O2, opt_level="O3"),
     ["opt_level='O3'", "either config= or opt_level="]),
    ("config_and_override", compile_(config=O2, keep_batchnorm_fp32=False),
     ["keep_batchnorm_fp32=", "either config= or opt_level="]),
    ("not_a_module", lambda w: fxamp.compile(lambda x: x), ["function", "nn.Module"]),
    ("backend_outputs", lambda w: fxamp.backend(cast_model_outputs="fp32"),
     ["cast_model_outputs", "fxamp.compile(model, cast_model_outputs=...)"]),
    ("backend_compiler", lambda w: fxamp.backend(compiler="tvm"), ["'tvm'", "'aot_eager'"]),
    ("already_prepared", lambda w: fxamp.compile(w.model, opt_level="O1"),
     ["already prepared", "compile it once"], "prepared"),
    ("recast_after_compile", lambda w: w.model(w.x),
     ["'0.weight' (now torch.float32, stored as torch.bfloat16)", "model.float()",
      "cast the model before fxamp.compile"], "recast"),
    # --- explain, initialize, the debug tools
    ("explain_config_and_level", lambda w: fxamp.explain(w.model, w.x, config=O2, opt_level="O3"),
     ["opt_level='O3'", "either config= or opt_level="]),
    ("explain_module_override", lambda w: fxamp.explain(w.model, w.x,
                                                        module_overrides={"Lineer": "fp32"}),
     ["'Lineer'", "names no module", "Linear"]),
    ("initialize_prepared_second", lambda w: fo.initialize(
        [w.extra, w.model], opt_level="O2", compiler="aot_eager"),
     ["models[1]", "already prepared"], "prepared"),
    ("initialize_model_twice", lambda w: fo.initialize([w.model, w.model], compiler="aot_eager"),
     ["models[0] and models[1] are the same Sequential", "pass each model once"]),
    ("initialize_compiler", lambda w: fo.initialize(w.model, compiler="tvm"),
     ["compiler='tvm'", "'inductor', 'aot_eager'"]),
    ("initialize_module_override", lambda w: fo.initialize(
        w.model, opt_level="O2", module_overrides={"nosuch": "fp32"}, compiler="aot_eager"),
     ["models[0]", "'nosuch'", "names no module"]),
    ("initialize_empty_optimizer", lambda w: fo.initialize(
        w.model, torch.optim.AdamW([{"params": []}]), opt_level="O2", compiler="aot_eager"),
     ["optimizers[0] (AdamW) has no parameters"]),
    ("initialize_stepped_wrapped_optimizer", lambda w: fo.initialize(
        [w.model, w.extra], w.adagrad, opt_level="O2", compiler="aot_eager"),
     ["optimizers[0]: wrap the Adagrad before its first step"], "adagrad"),
    ("locate_overflow_tensor_batch", lambda w: locate_overflow(
        w.model, w.x, lambda out, y: F.mse_loss(out, y)),
     ["Tensor of shape (6, 4)", "pass (x, y)"]),
    ("locate_overflow_prepared_config", lambda w: locate_overflow(w.model, w.x, opt_level="O1"),
     ["prepared by fxamp.compile with O2", "pass no config, opt_level or overrides"],
     "prepared"),
    # --- LossScaler arguments, state and calls
    ("scaler_init_zero", scaler_(init_scale=0), ["init_scale=0", "positive finite"]),
    ("scaler_init_nan", scaler_(init_scale=NAN), ["init_scale=nan", "positive finite"]),
    ("scaler_init_negative", scaler_(init_scale=-8), ["init_scale=-8", "positive finite"]),
    ("scaler_init_below_floor", scaler_(init_scale=0.5),
     ["init_scale=0.5", "below min_loss_scale=1.0", "lower min_loss_scale"]),
    ("scaler_max_negative", scaler_(max_loss_scale=-1), ["max_loss_scale=-1", "or None (no cap)"]),
    ("scaler_min_zero", scaler_(min_loss_scale=0), ["min_loss_scale=0", "2**-24"]),
    ("scaler_loss_scale_true", scaler_(loss_scale=True), ["loss_scale=True", "'dynamic'"]),
    ("scaler_growth_interval_zero", scaler_(growth_interval=0),
     ["growth_interval=0", "positive int"]),
    ("scaler_growth_interval_float", scaler_(growth_interval=1.5),
     ["growth_interval=1.5", "positive int"]),
    ("scaler_growth_factor_below_one", scaler_(growth_factor=0.9), ["growth_factor=0.9", ">= 1"]),
    ("scaler_backoff_above_one", scaler_(backoff_factor=1.5),
     ["backoff_factor=1.5", "(0, 1)"]),
    ("scaler_hysteresis_zero", scaler_(hysteresis=0), ["hysteresis=0", "positive int"]),
    ("scaler_semantics", scaler_(semantics="gradscaler"),
     ["semantics='gradscaler'", "apex, torch, deepspeed"]),
    ("scaler_load_negative", load_scaler({"scale": -5.0}),
     ["state_dict['scale']=-5.0", "positive finite", "load a checkpoint saved before it"]),
    ("scaler_load_nan", load_scaler({"scale": NAN}), ["state_dict['scale']=nan", "positive"]),
    ("scaler_load_zero", load_scaler({"scale": 0.0}), ["state_dict['scale']=0.0", "positive"]),
    ("scaler_load_bad_interval", load_scaler({"scale": 8.0, "growth_interval": 0}),
     ["state_dict['growth_interval']=0", "positive int"]),
    ("scaler_load_bad_tracker", load_scaler({"scale": 8.0, "_growth_tracker": -1}),
     ["_growth_tracker=-1", "int >= 0"]),
    ("scaler_load_not_a_scaler", load_scaler({"lr": 1.0}),
     ["keys ['lr']", "'scale' (fxamp, GradScaler) or 'loss_scale'"]),
    ("scaler_load_two_apex", load_scaler({f"loss_scaler{i}": {"loss_scale": 1.0, "unskipped": 0}
                                          for i in range(2)}),
     ["holds 2 loss scalers", "load_amp_state_dict"]),
    ("scaler_set_zero", lambda w: w.scaler.set_scale(0), ["set_scale(value)=0", "positive"]),
    ("scaler_set_inf", lambda w: w.scaler.set_scale(INF), ["set_scale(value)=inf", "positive"]),
    ("scaler_scale_int", lambda w: w.scaler.scale(torch.tensor(3)),
     ["torch.int64", "floating-point tensor"]),
    ("scaler_scale_float", lambda w: w.scaler.scale(3.0), ["not float", "loss tensor"]),
    # --- optimizers: construction
    ("adamw_weight_decay", adamw(weight_decay=-1), ["weight_decay=-1", ">= 0"]),
    ("adamw_lr", adamw(lr=-1.0), ["lr=-1.0", ">= 0"]),
    ("adamw_eps", adamw(eps=-1e-8), ["eps=-1e-08", ">= 0"]),
    ("adamw_betas", adamw(betas=(0.9, 1.0)), ["betas=(0.9, 1.0)", "two numbers in [0, 1)"]),
    ("adamw_one_beta", adamw(betas=(0.9,)), ["betas=(0.9,)", "two numbers in [0, 1)"]),
    ("adamw_max_grad_norm_str", adamw(max_grad_norm="1.0"),
     ["max_grad_norm='1.0' (str)", "positive finite number or None"]),
    ("adamw_max_grad_norm_nan", adamw(max_grad_norm=NAN), ["max_grad_norm=nan", "positive"]),
    ("adamw_empty_group", lambda w: fo.AdamW([{"params": []}], compile=False),
     ["no parameters", "pass the model's parameters"]),
    ("adamw_empty_list", lambda w: fo.AdamW([], compile=False),
     ["empty parameter list", "model.parameters()"]),
    ("adamw_duplicate", lambda w: fo.AdamW([*w.model.parameters(), w.model[0].weight],
                                           compile=False),
     ["position 6 (shape (8, 4)) is also at param group 0, position 0", "list each parameter once"]),
    ("adamw_duplicate_groups", lambda w: fo.AdamW(
        [{"params": w.model[0].parameters()}, {"params": w.model.parameters()}], compile=False),
     ["param group 1, position 0", "also at param group 0, position 0"]),
    ("adamw_group_weight_decay", lambda w: fo.AdamW(
        [{"params": w.model[0].parameters(), "weight_decay": -0.1}], compile=False),
     ["weight_decay=-0.1", ">= 0"]),
    ("sgd_momentum", lambda w: fo.SGD(w.model.parameters(), momentum=-0.9, compile=False),
     ["momentum=-0.9", ">= 0"]),
    ("sgd_nesterov", lambda w: fo.SGD(w.model.parameters(), nesterov=True, compile=False),
     ["nesterov=True needs momentum > 0", "momentum=0.0"]),
    ("fp16_optimizer_of_fxamp", lambda w: fo.FP16_Optimizer(w.opt),
     ["not AdamW", "already keep masters"]),
    # --- optimizers: steps and state
    ("step_grad_scaler", lambda w: w.opt.step(torch.amp.GradScaler("cpu")),
     ["not GradScaler", "LossScaler(semantics='torch')"]),
    ("step_forgotten_scaler", lambda w: w.opt.step(),
     ["AdamW.step() was called without a scaler", "Call step(scaler)"], "scaled"),
    ("unscale_forgotten_scaler", lambda w: w.opt.unscale_(),
     ["unscale_() was called without a scaler", "unscale_(scaler)"], "scaled"),
    ("closure_dynamic", lambda w: w.opt.step(w.scaler, closure=lambda: 0.0),
     ["closure", "run the backward yourself and call step(scaler)"]),
    ("add_param_group_bad_lr", lambda w: w.opt.add_param_group({"params": [torch.nn.Parameter(
        torch.ones(2))], "lr": -1.0}), ["param group 1: lr=-1.0", ">= 0"]),
    ("load_other_model", lambda w: w.opt.load_state_dict(_other_model_state()),
     ["shape (3, 3)", "parameter has shape (8, 4)", "from another model"]),
    ("load_not_optimizer", lambda w: w.opt.load_state_dict({"state": {}}),
     ["not an optimizer state dict", "'param_groups'"]),
    ("load_bad_lr", lambda w: w.opt.load_state_dict(_group_dict(w, lr=-1.0)),
     ["lr=-1.0", ">= 0"]),
    ("load_bad_index", lambda w: w.opt.load_state_dict(
        {**w.opt.state_dict(), "state": {99: {"step": 1.0}}}),
     ["state entry 99 names no parameter", "indices 0...5"]),
    ("step_after_model_to", lambda w: w.opt.step(w.scaler),
     ["and the optimizer was built over", "move and cast the model first"], "moved"),
]


def _case_params():
    params = []
    for case in CASES:
        name, action, fragments, *kind = case
        params.append(pytest.param(action, fragments, kind[0] if kind else "trained", id=name))
    return params


def test_the_catalogue_is_large():
    assert len(CASES) >= 60


@pytest.mark.parametrize("action,fragments,kind", _case_params())
def test_bad_input_is_refused_and_changes_nothing(action, fragments, kind):
    w = World(kind)
    before = snapshot(w)
    with pytest.raises(Exception) as info:
        action(w)
    error = info.value
    assert type(error).__module__ == "fxamp.errors", f"{type(error).__name__}: {error}"
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in: {error}"
    assert snapshot(w) == before


def test_cli_module_override_naming_no_module(capsys):
    from fxamp.cli import main

    with pytest.raises(SystemExit) as info:
        main(["explain", "examples.models:mlp", "--opt-level", "O2",
              "--module-override", "nosuchmodule=fp32"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "module_overrides key 'nosuchmodule' names no module of MLP" in err
    assert "named_modules() paths" in err and "fc1" in err


def _meta_model():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_meta_device_model_needs_its_compute_device(level):
    """A model built on the meta device (materialised later with to_empty) says nothing of the
    device it will compute on: refused untouched unless the config names it; with it, the
    model is cast, materialised, initialised and runs like the eager fp32 model."""
    model = _meta_model()
    with pytest.raises(fxamp.ConfigError, match=r"meta device.*from_opt_level\('" + level
                       + r"'\).resolve\('cuda'\)"):
        fxamp.compile(model, opt_level=level, compiler="aot_eager")
    assert fxamp.config_of(model) is None
    assert all(p.device.type == "meta" and p.dtype == torch.float32 for p in model.parameters())
    config = AmpConfig.from_opt_level(level).resolve("cpu")
    fxamp.compile(model, config=config, compiler="aot_eager")
    model.to_empty(device="cpu")
    for module in model:
        module.reset_parameters()
    want = {"O1": torch.float32, "O2": torch.bfloat16}[level]
    assert {p.dtype for p in model.parameters()} == {want}
    # the eager fp32 model with the same (materialised, initialised) weights
    ref = _meta_model().to_empty(device="cpu")
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    x = torch.randn(8, 4)
    # bf16 rounding of a 4-wide Linear and LayerNorm
    torch.testing.assert_close(model(x).float(), ref(x), rtol=0, atol=0.05)
