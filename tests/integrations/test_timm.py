"""fxamp's timm scaler (`fxamp.integrations.timm.NativeScaler`) in timm's own loss-scaler call,
on a real timm model, against timm's `NativeScaler` (a GradScaler) on the same seeds.

timm needs a torchvision built for the installed torch; CI installs both on the torch 2.11.0
and 2.14.1 legs (the registry's CUDA builds, run on the CPU), and the 2.13.0 leg, whose CPU
torch has no matching torchvision on the registry, skips this file.
"""

import pytest
import torch
import torch.nn.functional as F

timm = pytest.importorskip("timm")

import fxamp  # noqa: E402
from fxamp.integrations.timm import NativeScaler  # noqa: E402

STEPS, BAD_STEP = 4, 2


def _model():
    torch.manual_seed(0)
    return timm.create_model("resnet10t", pretrained=False, num_classes=4)


def _batches():
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, 4, 3, 32, 32, generator=gen)
    ys = torch.randint(0, 4, (STEPS, 4), generator=gen)
    xs[BAD_STEP, 0, 0, 0, 0] = float("inf")  # an overflow at a known step
    return list(zip(xs, ys))


def _train(model, optimizer, loss_scaler, autocast, accumulate=1):
    weights = []
    for step, (x, y) in enumerate(_batches()):
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = F.cross_entropy(model(x), y)
        loss_scaler(loss / accumulate, optimizer, clip_grad=1.0, clip_mode="norm",
                    parameters=model.parameters(), need_update=(step + 1) % accumulate == 0)
        if (step + 1) % accumulate == 0:
            optimizer.zero_grad()
        weights.append(model.fc.weight.detach().float().clone())
    return weights


@pytest.mark.parametrize("accumulate", [1, 2])
def test_timms_call_matches_timms_native_scaler(accumulate):
    from timm.utils import NativeScaler as TimmNativeScaler

    runs = {}
    for name, loss_scaler in [("timm", TimmNativeScaler(device="cpu")), ("fxamp", NativeScaler())]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        runs[name] = _train(model, opt, loss_scaler, autocast=True, accumulate=accumulate), \
            loss_scaler.state_dict()["scale"]
    (ref, ref_scale), (got, scale) = runs["timm"], runs["fxamp"]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))  # the same steps skipped, bit for bit
    assert scale == ref_scale < 2.0 ** 16                      # and the same backoffs
    if accumulate == 1:
        assert torch.equal(got[BAD_STEP], got[BAD_STEP - 1])   # the injected overflow: skipped


def test_fxamp_o2_fp16_skips_the_overflow_and_checkpoints():
    model = fxamp.compile(_model(), opt_level="O2", dtype=torch.float16, compiler="aot_eager")
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-3)
    loss_scaler = NativeScaler()
    weights = _train(model, opt, loss_scaler, autocast=False)
    assert torch.equal(weights[BAD_STEP], weights[BAD_STEP - 1])  # the skipped step
    assert not torch.equal(weights[BAD_STEP + 1], weights[BAD_STEP])
    assert all(torch.isfinite(w).all() for w in weights)
    state = loss_scaler.state_dict()
    skipped = int(loss_scaler.scaler.skipped_steps)  # the injected one, and any fp16 overflow
    assert 1 <= skipped < STEPS and state["scale"] == 2.0 ** 16 / 2 ** skipped
    resumed = NativeScaler()
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == state["scale"]
    assert NativeScaler.state_dict_key == "amp_scaler"


@pytest.mark.parametrize("ema_class", ["ModelEmaV2", "ModelEmaV3"])
def test_timms_ema_of_an_o2_model_moves(ema_class):
    # timm's EMAs lerp `ema.state_dict()` values toward `model.state_dict()` values in place:
    # an fxamp state dict is the live weights (Note [The state dict is the live weights]), so
    # the EMA copy moves; with fp32 copies in the state dict (before issue 32) it never did.
    # decay 0.5: an fp16 EMA rounds away updates below fp16's resolution (docs/backend.md).
    import timm.utils

    model = fxamp.compile(_model(), opt_level="O2", dtype=torch.float16, compiler="aot_eager")
    ema = getattr(timm.utils, ema_class)(model, decay=0.5)
    start = {k: v.clone() for k, v in ema.module.state_dict().items()}
    opt = fxamp.optim.AdamW(model.parameters(), lr=1e-2)
    loss_scaler = NativeScaler()
    for x, y in _batches()[:BAD_STEP]:
        loss_scaler(F.cross_entropy(model(x), y), opt)
        opt.zero_grad()
        ema.update(model)
    moved = [k for k, v in ema.module.state_dict().items()
             if v.is_floating_point() and not torch.equal(v, start[k])]
    assert ema.module.fc.weight.dtype == torch.float16
    assert "fc.weight" in moved and len(moved) > len(start) // 2
