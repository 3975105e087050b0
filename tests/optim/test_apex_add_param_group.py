"""Apex's L0 `test_add_param_group` (tests/L0/run_amp/test_add_param_group.py), ported: a
torch.optim.SGD with momentum goes through `initialize`, steps once, gets a second param group
(`add_param_group({"params": ..., "lr": 0.5})`, its momentum left to the optimizer's defaults),
and steps twice more through `scale_loss` (loss scale 4), once with plain backward passes and
once accumulating two backward passes per step; gradients are zeroed through the parameters
(`p.grad = None`), the modules (`model.zero_grad()`) or the optimizer, before or after the group
is added. The reference is plain torch.optim.SGD in fp32/fp16 on the same models, as in Apex.

Every value in this test is a small dyadic rational (weights, lr 0.25/0.5, momentum 0.125, x = 1),
exact in fp16, so the run is exact (measured: 0 difference at every level); the tolerance is
Apex's, torch.testing.assert_close's default for the dtype. Apex ran it at O0..O3 with
`cast_model_type=False`, models holding an fp32 and an fp16 weight.
"""

import contextlib

import pytest
import torch
from torch.nn import Parameter

import fxamp as amp
import fxamp.optim as fo

X = torch.ones(2)


class MyModel(torch.nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = Parameter(1. + unique + torch.arange(2, dtype=torch.float16))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


def _zero_grad(models, optimizer, how):
    if how == "none":
        for model in models:
            for p in model.parameters():
                p.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        optimizer.zero_grad()


def _run(opt_level, zero_before_add, accumulate, how_to_zero):
    """Apex's loop; `opt_level=None` is the reference (plain torch.optim.SGD, no amp)."""
    model0, model1 = MyModel(1), MyModel(2)
    optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
    scale_loss = lambda loss: contextlib.nullcontext(loss)  # noqa: E731
    if opt_level is not None:
        [model0, model1], optimizer = amp.initialize(
            [model0, model1], optimizer, opt_level=opt_level, verbosity=0,
            cast_model_type=False, compiler="aot_eager")
        optimizer.loss_scalers[0].set_scale(4.0)  # Apex: _amp_state.loss_scalers[0]._loss_scale
        scale_loss = lambda loss: amp.scale_loss(loss, optimizer)  # noqa: E731
    models = [model0, model1]
    _zero_grad(models, optimizer, how_to_zero)
    with scale_loss(model0(X)) as scaled:
        scaled.backward()
    optimizer.step()
    if zero_before_add:
        _zero_grad(models, optimizer, how_to_zero)
    optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
    if not zero_before_add:
        _zero_grad(models, optimizer, how_to_zero)
    for step in range(2):  # twice, so that the new params' momentum is used
        if step:
            _zero_grad(models, optimizer, how_to_zero)
        loss = model0(X) + model1(X)
        with scale_loss(loss) as scaled:
            scaled.backward(retain_graph=accumulate)
        if accumulate:
            with scale_loss(loss) as scaled:
                scaled.backward()
        optimizer.step()
    return [p.detach().clone() for model in models for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "single"])
@pytest.mark.parametrize("zero_before_add", [True, False], ids=["zero-add", "add-zero"])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_add_param_group(opt_level, zero_before_add, accumulate):
    reference = _run(None, zero_before_add, accumulate, "optimizer")
    for how_to_zero in ("none", "model", "optimizer"):
        final = _run(opt_level, zero_before_add, accumulate, how_to_zero)
        for ref, got in zip(reference, final):
            torch.testing.assert_close(ref.to(got.dtype), got, msg=lambda m: (
                f"{m}\nopt_level={opt_level}, how_to_zero={how_to_zero}, "
                f"zero_before_add={zero_before_add}, accumulate={accumulate}"))


@pytest.mark.parametrize("make,key,value", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.125, dampening=0.5), "momentum", 0.125),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.125, dampening=0.5), "dampening", 0.5),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, betas=(0.5, 0.75)), "betas", (0.5, 0.75)),
    (lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.25), "weight_decay", 0.25),
    (lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.25, decoupled_weight_decay=True),
     "weight_decay", 0.25),
])
def test_initialize_keeps_the_optimizers_defaults_for_added_groups(make, key, value):
    """What the Apex test caught: a group added with only "lr" takes the rest from the
    converted optimizer's defaults, which must be the torch optimizer's, not the fused class's
    own (SGD's momentum 0 stepped the new group without momentum, silently)."""
    model, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    _, opt = fo.initialize(model, make(model.parameters()), opt_level="O0",
                           compiler="aot_eager", verbosity=0)
    assert opt.defaults[key] == value
    opt.add_param_group({"params": head.parameters(), "lr": 0.5})
    assert opt.param_groups[1][key] == value and opt.param_groups[1]["lr"] == 0.5
