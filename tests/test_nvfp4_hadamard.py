"""NVFP4's random Hadamard transform of the grad_weight GEMM, torchao's training recipe's
(Float8Config(recipe="nvfp4", nvfp4_rht_signs=...); Note [The Hadamard transform of NVFP4's
grad_weight GEMM] in fxamp/float8/block_gemm.py): bitwise with the standalone functions (whose
transform is tested against torchao's Hadamard matrix in tests/test_blockscaled.py), the output
and grad_input GEMMs untouched, config refusals and explain()."""

import dataclasses
import re

import pytest
import torch

import fxamp
from fxamp.errors import ConfigError
from fxamp.float8 import Float8Config
from fxamp.float8.block_gemm import block_formats
from fxamp.float8.blockscaled import blockscaled_mm
from fxamp.float8.gemm import float8_linear
from fxamp.float8.nvfp4 import NVFP4_RHT_SIGNS

BF16 = torch.bfloat16


def _linear_grads(x, w, g, signs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = float8_linear(x, w, None, "nvfp4", rht_signs=signs)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def test_only_the_grad_weight_gemm_is_rotated_bit_for_bit():
    torch.manual_seed(0)
    x, w, g = torch.randn(64, 64).to(BF16), (torch.randn(32, 64) / 8).to(BF16), \
        torch.randn(64, 32).to(BF16)
    plain = _linear_grads(x, w, g, None)
    rotated = _linear_grads(x, w, g, NVFP4_RHT_SIGNS)
    assert torch.equal(plain[0], rotated[0]) and torch.equal(plain[1], rotated[1])
    act, _ = block_formats("nvfp4")
    rot = dataclasses.replace(act, rht_signs=NVFP4_RHT_SIGNS)
    assert torch.equal(rotated[2], blockscaled_mm(x.t(), g, a_format=rot, b_format=rot).t())
    assert not torch.equal(rotated[2], plain[2])


def test_compiled_model_rotates_as_the_config_says_and_explain_names_it():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)
    f8 = Float8Config(recipe="nvfp4", nvfp4_rht_signs=NVFP4_RHT_SIGNS)
    fxamp.compile(model, opt_level="O2", float8=f8, compiler="aot_eager")
    x, g = torch.randn(32, 64).to(BF16), torch.randn(32, 64).to(BF16)
    model(x).backward(g)
    act, _ = block_formats("nvfp4")
    rot = dataclasses.replace(act, rht_signs=NVFP4_RHT_SIGNS)
    assert torch.equal(model.weight.grad,
                       blockscaled_mm(x.t(), g, a_format=rot, b_format=rot).t())
    assert "grad_weight operands Hadamard-rotated" in str(fxamp.explain(model, x))


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe="mxfp8", nvfp4_rht_signs=NVFP4_RHT_SIGNS),
     "float8 nvfp4_rht_signs applies to recipe='nvfp4', not 'mxfp8' (leave it None)"),
    (dict(recipe="nvfp4", nvfp4_rht_signs=(1, -1) * 4),
     "float8 nvfp4_rht_signs=(1, -1, 1, -1, 1, -1, 1, -1) must be 16 ints, each +1 or -1"),
    (dict(recipe="nvfp4", nvfp4_rht_signs=(2,) * 16), "must be 16 ints, each +1 or -1"),
])
def test_bad_signs_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Float8Config(**kwargs)
