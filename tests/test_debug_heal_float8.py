"""fxamp.Healer on float8 models, every recipe (issue 39): a float8 GEMM whose fp16 output
overflows makes every step skip; the healer names that GEMM, moves its module to fp32 and out of
float8 (the other GEMMs stay in the recipe), and training goes on with finite losses and no
skipped step."""

import dataclasses
import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxamp
from fxamp.debug.heal import Promotion
from fxamp.float8.config import recipe_refusal
from fxamp.optim import AdamW

LOGGER = "fxamp.debug.heal"
STEPS, EVERY = 4, 2  # the healer reads (and heals) at step 2; steps 3 and 4 must not skip


class Hot(nn.Linear):
    """A projection whose weights have grown large, as a diverging run leaves them."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)  # planted: the fp16 output overflows


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hot, self.norm, self.out = Hot(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)
        with torch.no_grad():
            self.hot.weight[:4].mul_(1e4)  # |output| ~ 1e5 > 65504; fine in fp32

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hot(x))))


def _loss(output, target):
    return F.mse_loss(output.float(), target)


def _model(float8):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Net()
    return fxamp.compile(model, compiler="aot_eager", opt_level="O1", dtype=torch.float16,
                         float8=float8)


def _data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 64, generator=g) * 100, torch.randn(64, 64, generator=g))
            for _ in range(steps)]


def _train(model, data, scaler, healer=None):
    """fxamp's AdamW stepping through the scaler; returns the losses (nan where skipped)."""
    opt, losses = AdamW(model.parameters(), lr=1e-3), []
    for batch in data:
        x, y = batch
        opt.zero_grad()
        loss = _loss(model(x), y)
        scaler.scale(loss).backward()
        opt.step(scaler)
        losses.append(loss.item())
        if healer is not None:
            healer.observe(batch)
    return losses


_ROWWISE = pytest.mark.skipif(recipe_refusal("rowwise", "cpu", torch.float16) is not None,
                              reason="this torch's torch._scaled_mm has no row-scaled float8 "
                                     "GEMM on CPU (2.13+ has)")


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=_ROWWISE),
                                    pytest.param("rowwise_with_gw_hp", marks=_ROWWISE),
                                    "mxfp8", "nvfp4"])
def test_the_healer_takes_the_overflowing_float8_gemm_out_of_float8(recipe, caplog):
    model, data, scaler = _model(recipe), _data(), fxamp.LossScaler(compile=False)
    healer = fxamp.Healer(model, scaler, _loss, every=EVERY, skips=EVERY)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        losses = _train(model, data, scaler, healer)
    # the float8 GEMM is found by name, in its module, on the planted line
    (p,) = healer.promotions
    assert (p.kind, p.key, p.module, p.module_type) == ("module_overrides", "hot", "hot", "Hot")
    assert (p.phase, p.op, p.step, p.loss_scale) == ("forward", "float8_linear", EVERY, 1.0)
    assert "planted" in p.source_line
    # the fix: module 'hot' in fp32 and out of float8; the other GEMM still in the recipe
    config = fxamp.config_of(model)
    assert config.module_overrides == (("hot", "fp32"),)
    assert config.float8.recipe == recipe and "hot" in config.float8.skip_modules
    gemms = {g.module: g for g in fxamp.explain(model, data[0][0]).gemms}
    assert set(gemms) == {"hot", "out"}
    assert not gemms["hot"].float8 and "skip_modules 'hot'; stays f32" in gemms["hot"].reason
    assert gemms["out"].float8 and gemms["out"].reason.startswith(f"{recipe}:")
    assert "f16 out" in gemms["out"].reason  # unchanged: the recipe's GEMM, in fp16
    # training stops skipping: the skips before the read, none after, finite losses
    assert int(scaler.skipped_steps) == EVERY
    assert all(math.isnan(x) for x in losses[:EVERY])
    assert all(math.isfinite(x) for x in losses[EVERY:])
    # the log names the GEMM's module and the source line
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    text = record.getMessage()
    assert "promoted module 'hot' to fp32 at step 2" in text
    assert "forward float8_linear in module 'hot' (Hot)" in text
    assert "test_debug_heal_float8.py:" in text and "planted" in text


PROMOTION = Promotion(2, "module_overrides", "hot", "float8_linear", "hot", "Hot", "forward",
                      "", 1.0)


def test_a_promotion_joins_the_users_skip_modules_and_keeps_the_rest_of_float8():
    user = fxamp.Float8Config(recipe="tensorwise", skip_modules=("out",), min_dim=32)
    healer = fxamp.Healer(_model(user), fxamp.LossScaler(compile=False), _loss)
    top = dataclasses.replace(PROMOTION, kind="op_overrides", key="aten.exp", module="")
    config = healer.config([PROMOTION, top])
    assert config.float8 == dataclasses.replace(user, skip_modules=("hot", "hot.*", "out"))
    assert config.module_overrides == (("hot", "fp32"),)
    assert config.op_overrides == (("aten.exp", "fp32"),)
    assert healer.config([top]).float8 == user  # an op promotion names no module to skip
    plain = fxamp.Healer(_model(None), fxamp.LossScaler(compile=False), _loss)
    assert plain.config([PROMOTION]).float8 is None


def test_a_resumed_float8_run_keeps_the_gemm_out_of_float8():
    model, scaler = _model("tensorwise"), fxamp.LossScaler(compile=False)
    state = {"promotions": [dataclasses.asdict(PROMOTION)], "steps": 4, "skipped_at_read": 2}
    fxamp.Healer(model, scaler, _loss).load_state_dict(state)
    assert fxamp.config_of(model).float8.skip_modules == ("hot", "hot.*")
    losses = _train(model, _data(2), scaler)
    assert int(scaler.skipped_steps) == 0 and all(math.isfinite(x) for x in losses)
