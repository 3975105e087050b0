"""O1 with a 16-bit input into a layer whose weights are fp32 (issue 12 item 5).

Apex and torch.autocast accept `conv(x.half())` with fp32 weights at O1 and return a 16-bit
output; fxamp's re-trace used to fail on it ("Input type (c10::Half) and bias type (float)
should be the same"), because Dynamo traced it under the level's autocast and the re-trace did
not (Note [Mixed operands trace under autocast] in fxamp/passes/capture.py). The reference is
torch.autocast on the same module and input: same kernels on the same cast operands, so the
outputs and gradients are equal."""

import pytest
import torch
from expecttest import assert_expected_inline

import fxamp

LAYERS = {
    "conv1d": (lambda: torch.nn.Conv1d(3, 4, 3), (2, 3, 8)),
    "conv2d": (lambda: torch.nn.Conv2d(3, 4, 3), (2, 3, 8, 8)),
    "conv3d": (lambda: torch.nn.Conv3d(3, 4, 3), (2, 3, 5, 5, 5)),
    "conv_transpose2d": (lambda: torch.nn.ConvTranspose2d(3, 4, 3), (2, 3, 6, 6)),
    "linear": (lambda: torch.nn.Linear(8, 4), (2, 8)),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _pair(name: str):
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(build(), torch.nn.ReLU())
    reference = torch.nn.Sequential(build(), torch.nn.ReLU())
    reference.load_state_dict(model.state_dict())
    return model, reference, torch.randn(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", LAYERS)
def test_16bit_input_into_fp32_layer_matches_autocast(name, dtype):
    model, reference, x = _pair(name)
    x = x.to(DTYPES[dtype])
    compiled = fxamp.compile(model, opt_level="O1", dtype=DTYPES[dtype], compiler="aot_eager")
    out = compiled(x)
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        expected = reference(x)
    # autocast's 16-bit values; fxamp's output cast to fp32 (Note [O1's outputs are fp32])
    assert out.dtype == torch.float32 and expected.dtype == DTYPES[dtype]
    assert torch.equal(out, expected.float())
    out.float().sum().backward()
    expected.float().sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)


def test_explain_shows_the_policy_casting_the_weights():
    model, _, x = _pair("conv2d")
    report = fxamp.explain(model, x.half(), opt_level="O1", dtype=torch.float16)
    rows = [line for line in str(report).splitlines() if line.startswith(("conv2d", "relu"))]
    assert_expected_inline("\n".join(rows), """\
conv2d: f16[2,4,6,6] = conv2d(args_0, _0_weight_f16, _0_bias_f16)
relu: f16[2,4,6,6] = relu(conv2d)
conv2d.default  0       lower   f16,f32,f32 -> f16  torch-cpu table
relu.default    1       keep    f16 -> f16          not in the table: runs in its inputs' dtype""")


def test_an_fp32_override_casts_the_input_up():
    model, reference, x = _pair("conv2d")
    compiled = fxamp.compile(model, opt_level="O1", op_overrides={"aten.conv2d": "fp32"},
                             compiler="aot_eager")
    out = compiled(x.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x.bfloat16().float()), rtol=0, atol=0)
