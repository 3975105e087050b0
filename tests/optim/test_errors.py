"""Bad input gets an error that names the bad value and what would be valid."""

import pytest
import torch
from optim_helpers import loss_of, make_mlp

import fxamp.optim as fo
from fxamp.errors import ConfigError


def test_non_float_parameter():
    params = [torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)]
    with pytest.raises(ConfigError, match=r"AdamW: parameter 1 of param group 0 \(shape \(2,\)\) "
                                          r"has dtype torch.int64; only floating-point"):
        fo.AdamW(params, compile=False)


def test_parameters_on_two_devices():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ConfigError, match=r"more than one device: cpu \(1 tensors\), meta "
                                          r"\(1 tensors\).*one optimizer per device"):
        fo.SGD(params, compile=False)


def test_optimizer_passed_twice():
    pytest.importorskip("fxamp.backend")
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"optimizers\[0\] and optimizers\[1\] are the same "
                                          "AdamW: an optimizer passed twice"):
        fo.initialize(model, [opt, opt], compiler="aot_eager")


def test_parameter_shared_by_two_optimizers():
    pytest.importorskip("fxamp.backend")
    model = make_mlp()
    opts = [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model[0].parameters(), lr=1)]
    with pytest.raises(ConfigError, match=r"in both optimizers\[0\] and optimizers\[1\]"):
        fo.initialize(model, opts, compiler="aot_eager")


def test_model_cast_after_the_optimizer_was_built():
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), compile=False)
    model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"parameter 0 of param group 0 is now torch.bfloat16 "
                       r"\(16, 8\) on cpu, and the optimizer was built over torch.float32"):
        opt.step()


def test_closure_with_dynamic_scaling():
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), compile=False)
    with pytest.raises(ConfigError, match="closure.*cannot be used with dynamic loss scaling"):
        opt.step(fo.LossScaler(compile=False), closure=lambda: loss_of(model, 0))
    wrapped = fo.FP16_Optimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1),
                                dynamic_loss_scale=True, compile=False)
    with pytest.raises(ConfigError, match="closure.*cannot be used with dynamic loss scaling"):
        wrapped.step(lambda: 0.0)


def test_closure_without_dynamic_scaling_runs():
    model = make_mlp()
    opt = fo.SGD(model.parameters(), lr=0.1, compile=False)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        return loss

    first = opt.step(closure)  # torch.optim's positional closure
    assert opt.step(closure=closure) < first


def test_loss_id_out_of_range():
    pytest.importorskip("fxamp.backend")
    model = make_mlp()
    _, opt = fo.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), num_losses=2,
                           compiler="aot_eager")
    with pytest.raises(ConfigError, match=r"loss_id=2 is out of range: initialize\(num_losses=2"
                                          r"\) made loss ids 0..1"):
        with fo.scale_loss(loss_of(model, 0), opt, loss_id=2):
            pass


def test_fp16_optimizer_refuses_stepped_or_fxamp_optimizers():
    model = make_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_of(model, 0).backward()
    inner.step()
    with pytest.raises(ConfigError, match="wrap the SGD before its first step"):
        fo.FP16_Optimizer(inner)
    with pytest.raises(ConfigError, match="wraps a plain torch optimizer, not AdamW"):
        fo.FP16_Optimizer(fo.AdamW(make_mlp().parameters(), compile=False))


@pytest.mark.parametrize("kwargs,message", [
    (dict(betas=(0.9, 1.0)), r"AdamW: betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
    (dict(lr=-1.0), "AdamW: lr=-1.0 must be a finite number >= 0"),
    (dict(max_grad_norm=0.0), "max_grad_norm=0.0 must be a positive finite number or None"),
])
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        fo.AdamW(make_mlp().parameters(), compile=False, **kwargs)
