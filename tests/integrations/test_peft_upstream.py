"""peft's own autocast tests of its LoRA layers (tests/test_autocast_torchcompatibility_lora.py,
`TestAutoCast`: an embedding, a LayerNorm and a Linear or a Conv2d, each plain and with the
Linear, the Embedding or the Conv2d replaced by peft's LoRA layer, here through peft's
`inject_adapter_in_model`), run twice: under
torch.autocast, as peft runs them (the reference: the output comes out in the autocast dtype,
bf16 and fp16, and in fp32 under an fp32 autocast), and with fxamp's O1 in its place. Written
here in fxamp's words. Deviations: on the CPU (peft's run on CUDA), in eval mode (LoRA's dropout
would draw differently), and by design fxamp's output is fp32 (Note [O1's outputs are fp32]):
what is checked of fxamp is that every op ran in autocast's dtype, so that the output holds
autocast's values bit for bit (bf16 and fp16), and that an fp32 level (O0) gives fp32's.
5 + 10 cases."""

import copy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("peft")

from peft import LoraConfig, inject_adapter_in_model  # noqa: E402

import fxamp  # noqa: E402

LORA = dict(r=8, lora_alpha=16, lora_dropout=0.05)


class Net(nn.Module):
    """Embedding -> LayerNorm -> Linear or Conv2d; `lora` wraps one of them in peft's layer."""

    def __init__(self, conv=False, lora=None):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(1000, 96)
        self.norm = nn.LayerNorm(96)
        self.conv = conv
        self.out = nn.Conv2d(1, 32, 3, padding=1) if conv else nn.Linear(96, 32)
        if lora is not None:  # peft's LoRA layer in place of the module (its public API)
            inject_adapter_in_model(LoraConfig(target_modules=[lora], **LORA), self)
        for name, p in self.named_parameters():  # LoRA's B starts at zero: make it count
            if "lora_B" in name or "lora_embedding_B" in name:
                nn.init.normal_(p, std=0.1)

    def forward(self, ids):
        h = self.norm(self.embedding(ids))
        if self.conv:
            return self.out(h.unsqueeze(1)).squeeze(1)
        return self.out(h)


MODELS = {"simple": dict(), "simple_conv2d": dict(conv=True),
          "lora_linear": dict(lora="out"), "lora_embedding": dict(lora="embedding"),
          "lora_conv2d": dict(conv=True, lora="out")}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ids():
    return torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", MODELS)
def test_autocast_gives_its_dtype(name):
    # peft's assertions, under torch.autocast on the CPU
    model = Net(**MODELS[name]).eval()
    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert bool(lora) == ("lora" in name)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert model(_ids()).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_fxamp_computes_what_autocast_computes(name, dtype):
    base = Net(**MODELS[name]).eval()
    low = DTYPES[dtype]
    with torch.autocast("cpu", dtype=low):
        want = base(_ids())
    model = fxamp.compile(copy.deepcopy(base), opt_level="O1", dtype=low, compiler="aot_eager")
    got = model(_ids())
    assert want.dtype == low and got.dtype == torch.float32
    assert torch.equal(got, want.float())
    fp32 = fxamp.compile(copy.deepcopy(base), opt_level="O0", compiler="aot_eager")
    assert torch.equal(fp32(_ids()), base(_ids()))
