"""An Apex amp training loop migrated to fxamp, checked against Apex's rules and fp32.

    python -m examples.apex_migration                  # O2 in bf16 on the CPU, 40 steps
    python -m examples.apex_migration --dtype fp16 --steps 60

The loop has the shape of Apex's ImageNet example (`examples/imagenet/main_amp.py`): SGD with
momentum over several param groups (a slower feature extractor, no weight decay on biases), a
warm-up then step lr schedule, gradient clipping through `amp.master_params`, and a checkpoint
and resume in the middle of the run. The Apex version is `BEFORE` below; `train` is the same
loop after `from apex import amp` became `import fxamp as amp`, nothing else changed but the
resume, which here happens in the same process as the run it resumes: while the old run's
optimizer is alive, `amp.load_state_dict(sd, optimizer)` says which `initialize` call loads.

Two batches are corrupt (their images are inf), as a bad record in a real dataset would be:
their loss and gradients are not finite, so Apex's dynamic scaler skips those steps and halves
the scale. The script runs three things on the same data and initial weights and compares them:
the fxamp loop run straight through, the fxamp loop stopped at `resume_at` and resumed from its
checkpoint in fresh objects, and an fp32 torch loop with Apex's scaler rule written out by hand
(`apex_dynamic_scale`). It prints the loss scale each step used, the skipped steps, and how far
the final weights are from fp32's (tests/test_apex_migration.py holds them to tolerances).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import fxamp as amp

BEFORE = """\
from apex import amp
model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
for step, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm)
    optimizer.step()
    scheduler.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "amp": amp.state_dict(), "scheduler": scheduler.state_dict()}, path)
"""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int = 40
    batch_size: int = 64
    corrupt: tuple[int, ...] = (7, 23)   # steps whose batch is all inf
    resume_at: int = 20
    lr: float = 0.2
    max_norm: float = 1.0
    opt_level: str = "O2"
    dtype: Optional[str] = None           # None: bf16, fxamp's default on the CPU
    compiler: str = "inductor"


@dataclasses.dataclass
class Run:
    scales: list[float]       # the loss scale each step's loss was multiplied by
    skipped: list[int]        # the steps whose update was skipped
    losses: list[float]
    weights: dict[str, torch.Tensor]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.hidden = torch.nn.Linear(8 * 4 * 4, 32)
        self.classifier = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.features(x)), 2).flatten(1)
        return self.classifier(torch.relu(self.hidden(x)))


def param_groups(model: Net, lr: float) -> list[dict]:
    """ImageNet-style groups: the feature extractor at a tenth of the lr, no decay on biases."""
    weights = [model.hidden.weight, model.classifier.weight]
    biases = [model.features.bias, model.hidden.bias, model.classifier.bias]
    return [{"params": [model.features.weight], "lr": lr / 10, "weight_decay": 1e-4},
            {"params": weights, "weight_decay": 1e-4},
            {"params": biases, "weight_decay": 0.0}]


def lr_at(step: int) -> float:
    """Linear warm-up over 5 steps, then halved every 10."""
    return (step + 1) / 5 if step < 5 else 0.5 ** ((step - 5) // 10)


def load(settings: Settings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The run's batches of scikit-learn's digits, the corrupt ones filled with inf."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(settings.steps):
        idx = torch.randint(0, len(y), (settings.batch_size,), generator=gen)
        xb = torch.full_like(x[idx], float("inf")) if step in settings.corrupt else x[idx]
        batches.append((xb, y[idx]))
    return batches


def apex_dynamic_scale(overflows: Sequence[bool], init_scale: float = 2.0 ** 16,
                       scale_window: int = 2000, max_scale: float = 2.0 ** 24) -> list[float]:
    """Apex amp's LossScaler.update_scale, by hand: the scale each step's loss is made with.

    On overflow the step is skipped and the scale halves (Apex's min_loss_scale is None by
    default, so no floor); after `scale_window` clean steps in a row it doubles, capped.
    """
    scale, unskipped, used = min(init_scale, max_scale), 0, []
    for overflow in overflows:
        used.append(scale)
        if overflow:
            scale, unskipped = scale / 2, 0
        else:
            unskipped += 1
            if unskipped == scale_window:
                scale, unskipped = min(scale * 2, max_scale), 0
    return used


def _build(settings: Settings):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(param_groups(model, settings.lr), lr=settings.lr, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=settings.opt_level,
                                      dtype=DTYPES.get(settings.dtype),
                                      compiler=settings.compiler, verbosity=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    return model, optimizer, scheduler


def _checkpoint(model, optimizer, scheduler) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    return buffer.getvalue()


def _resume(settings: Settings, saved: bytes):
    model, optimizer, scheduler = _build(settings)
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"], optimizer)  # the checkpointed run is alive here too
    scheduler.load_state_dict(ckpt["scheduler"])
    return model, optimizer, scheduler


def train(settings: Settings, batches, *, resume_at: Optional[int] = None) -> Run:
    """The migrated loop; with `resume_at`, checkpoint there and go on in fresh objects."""
    model, optimizer, scheduler = _build(settings)
    run = Run([], [], [], {})
    for step, (x, y) in enumerate(batches):
        if step == resume_at:
            model, optimizer, scheduler = _resume(settings, _checkpoint(model, optimizer,
                                                                        scheduler))
        run.scales.append(amp.state_dict(optimizer)["loss_scaler0"]["loss_scale"])
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), settings.max_norm)
        optimizer.step()
        scheduler.step()
        run.losses.append(loss.item())
        if optimizer.last_step_skipped():
            run.skipped.append(step)
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    run.weights = {n: t.detach().float().clone()   # master_params: the groups' order
                   for n, t in zip(ordered, amp.master_params(optimizer))}
    return run


def train_torch(settings: Settings, batches, autocast: Optional[torch.dtype] = None) -> Run:
    """The same loop in torch (fp32, or with `torch.autocast` of the given dtype around the
    forward), skipping as Apex's scaler would: when a gradient is not finite. The scales are
    Apex's rule applied to those overflows."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(param_groups(model, settings.lr), lr=settings.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    run, overflows = Run([], [], [], {}), []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        overflows.append(not all(p.grad.isfinite().all() for p in model.parameters()))
        if overflows[-1]:
            run.skipped.append(step)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_norm)
            optimizer.step()
        scheduler.step()
        run.losses.append(loss.item())
    run.scales = apex_dynamic_scale(overflows)
    run.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def weight_error(run: Run, reference: Run) -> float:
    """max |w - w_ref| / max |w_ref| over every parameter tensor."""
    return max(((run.weights[n] - w).abs().max() / w.abs().max()).item()
               for n, w in reference.weights.items())


def _parse(argv: Optional[Sequence[str]]) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--opt-level", default=Settings.opt_level, choices=["O1", "O2"])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    parser.add_argument("--compiler", default=Settings.compiler, choices=["inductor", "aot_eager"])
    args = parser.parse_args(argv)
    return Settings(steps=args.steps, opt_level=args.opt_level, dtype=args.dtype,
                    compiler=args.compiler, resume_at=args.steps // 2)


def main(argv: Optional[Sequence[str]] = None) -> None:
    settings = _parse(argv)
    batches = load(settings)
    straight, reference = train(settings, batches), train_torch(settings, batches)
    resumed = train(settings, batches, resume_at=settings.resume_at)
    print(f"Apex's loop (before):\n{BEFORE}")
    print(f"fxamp {settings.opt_level}, {settings.steps} steps, corrupt batches at "
          f"{list(settings.corrupt)}, resumed at step {settings.resume_at}")
    for step in range(settings.steps):
        if step in settings.corrupt or step % 10 == 0 or step == settings.steps - 1:
            mark = "  skipped" if step in straight.skipped else ""
            print(f"  step {step:3d}  scale {straight.scales[step]:8.0f}  loss "
                  f"{straight.losses[step]:8.4f}  (fp32 {reference.losses[step]:8.4f}){mark}")
    print(f"loss scales as Apex's rule gives them: {straight.scales == reference.scales}")
    print(f"skipped steps {straight.skipped}, Apex's rule on fp32: {reference.skipped}")
    same = all(torch.equal(resumed.weights[n], w) for n, w in straight.weights.items())
    print(f"resumed run bit-identical to the straight run: {same}")
    autocast = train_torch(settings, batches, autocast=DTYPES[settings.dtype or "bf16"])
    print(f"final weights vs fp32: max relative error {weight_error(straight, reference):.2e} "
          f"(torch.autocast's: {weight_error(autocast, reference):.2e})")


if __name__ == "__main__":
    main()
