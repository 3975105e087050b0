"""A refusal at a compiled model's first call restores the model as it was before fxamp.compile
(Note [Un-preparing a refused model]), so the fix the error names can be retried; a failure of
the user's own code keeps the model prepared; a model cast again after fxamp.compile is named.

On main before this change, the retry was refused as "already prepared", the O2 weights stayed
bf16 after the refusal, the banned op came wrapped in BackendCompilerFailed, and model.float()
after compile gave an AssertionError from inside Dynamo.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import fxamp
from fxamp import BannedOpError, ConfigError
from fxamp.model.sharded_modules import compile_sharded_modules


class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 1e9:  # a graph break (data-dependent branch)
            h = h * 2
        return self.b(h)


class BCE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x, t):
        return F.binary_cross_entropy(torch.sigmoid(self.a(x)).squeeze(1), t)


def _state(model):
    return ([(n, p.dtype, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()],
            len(model._state_dict_hooks))


def _same(before, after):
    (params0, hooks0), (params1, hooks1) = before, after
    return hooks0 == hooks1 and all(
        n0 == n1 and d0 == d1 and ptr0 == ptr1 and torch.equal(t0, t1)
        for (n0, d0, ptr0, t0), (n1, d1, ptr1, t1) in zip(params0, params1))


def test_graph_break_under_fullgraph_restores_the_o2_weights_and_can_be_retried():
    torch.manual_seed(0)
    model, x = Breaks(), torch.randn(3, 4)
    before = _state(model)
    fxamp.compile(model, opt_level="O2", compiler="aot_eager", fullgraph=True)
    assert model.a.weight.dtype == torch.bfloat16
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)) as info:
        model(x)
    assert "fxamp restored the model" in "".join(getattr(info.value, "__notes__", []))
    assert _same(before, _state(model))
    assert fxamp.config_of(model) is None and model._compiled_call_impl is None
    assert model(x).dtype == torch.float32  # the plain model again
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")  # the retry
    assert model(x).dtype == torch.float32 and model.a.weight.dtype == torch.bfloat16


def test_banned_op_is_fxamps_own_error_and_the_retry_with_the_fix_works():
    model, x, t = BCE(), torch.randn(5, 4), torch.rand(5)
    before = _state(model)
    fxamp.compile(model, opt_level="O1", compiler="aot_eager", policy="torch-cuda", dtype="fp16")
    with pytest.raises(BannedOpError, match="binary_cross_entropy.*is banned under O1"):
        model(x, t)
    assert _same(before, _state(model)) and fxamp.config_of(model) is None
    fxamp.compile(model, opt_level="O1", compiler="aot_eager", policy="torch-cuda", dtype="fp16",
                  op_overrides={"aten.binary_cross_entropy": "fp32"})
    assert model(x, t).dtype == torch.float32


def test_a_failure_of_the_users_code_keeps_the_model_prepared():
    model = Breaks()
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")
    with pytest.raises(Exception) as info:
        model(torch.randn(3, 5))  # wrong feature size: the user's bug, not a refusal
    assert not isinstance(info.value, (ConfigError, fxamp.FxampError))
    assert fxamp.config_of(model) is not None and model.a.weight.dtype == torch.bfloat16
    assert model(torch.randn(3, 4)).dtype == torch.float32
    assert model._compiled_call_impl.first._record.originals == []  # freed after the first success


def test_model_cast_after_compile_is_named():
    model = Breaks()
    fxamp.compile(model, opt_level="O2", compiler="aot_eager")
    model(torch.randn(3, 4))
    model.float()
    with pytest.raises(ConfigError, match=r"'a.weight' \(now torch.float32, stored as "
                                          r"torch.bfloat16\) of Breaks changed dtype after "
                                          r"fxamp.compile stored it for O2 \(model.float\(\)"):
        model(torch.randn(3, 4))


def test_the_sharded_modules_forwards_go_back_on_the_undo_stack():
    # At the first call, the modules FSDP2 sharded get compiled forwards (Note [Sharded modules
    # are compiled one by one]); a refusal closes the undo stack, which puts each forward back:
    # none for a module that had none, the instance's own for one that had it.
    model, x = Breaks(), torch.randn(3, 4)
    own = model.b.forward
    model.b.forward = own
    undo = contextlib.ExitStack()
    compile_sharded_modules(model, [("a", model.a), ("b", model.b)],
                            lambda fn, path, module_type: fn, undo)
    assert "forward" in vars(model.a) and vars(model.b)["forward"] is not own
    assert torch.equal(model.a(x), F.linear(x, model.a.weight, model.a.bias))
    undo.close()
    assert "forward" not in vars(model.a) and vars(model.b)["forward"] is own
