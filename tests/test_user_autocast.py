"""The user's own torch.autocast regions inside forward keep their meaning under fxamp.

Note [The user's autocast wins] (fxamp/passes/annotate.py): ops inside the region are left as
traced and AOTAutograd applies the region's autocast; their values are propagated under the
region's state, so explain() shows what they really compute in and what follows the region
sees those dtypes. Before: a float16 region inside O1-bf16 was refused (validate saw the bf16
activation and the fp32 weight autocast was about to cast), and at O2 the fp32 region's output
meeting the bf16 model was refused. Tolerances: tests/parity.py.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
import parity


class Regions(nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)

    def forward(self, x):
        h = self.a(x)
        if self.region == "fp16":
            with torch.autocast("cpu", dtype=torch.float16):
                h = torch.mm(h, self.w * 0.5).float()  # back to fp32, as eager needs
        else:
            with torch.autocast("cpu", enabled=False):
                h = F.linear(h.float(), self.w.float())
        return self.b(torch.relu(h))


def _make(region):
    def make():
        torch.manual_seed(0)
        return Regions(region)

    return make


def _x():
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(0))


def _region_row(region, opt_level):
    rows = fxamp.explain(_make(region)(), _x(), opt_level=opt_level).rows
    op = "mm.default" if region == "fp16" else "linear.default"
    return next(r for r in rows if "torch.autocast" in r.reason and r.op == op)


def test_fp16_region_inside_o1_bf16_runs_in_fp16():
    row = _region_row("fp16", "O1")
    assert (row.inputs, row.output) == ("bf16,f32", "f16")
    assert row.reason == "inside the user's torch.autocast(dtype=f16) region"


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp32_region_reads_as_fp32(level):
    row = _region_row("fp32", level)
    assert (row.inputs, row.output) == ("f32,f32", "f32")
    assert row.reason == "inside the user's torch.autocast(enabled=False) region"


@pytest.mark.parametrize("region,level", [("fp16", "O1"), ("fp32", "O1"), ("fp32", "O2")])
def test_region_gradients(region, level):
    parity.check(_make(region), [_x()], level)


def test_after_an_fp32_region_o2_computes_in_the_model_dtype():
    rows = fxamp.explain(_make("fp32")(), _x(), opt_level="O2").rows
    after = [r for r in rows if r.module == "b"]
    assert [(r.inputs, r.output) for r in after] == [("f32,bf16,bf16", "bf16")]
    assert after[0].reason == "O2 fp32 input of a one-dtype op cast to the model dtype"
