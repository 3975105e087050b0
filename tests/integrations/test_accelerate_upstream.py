"""accelerate's own checkpointing tests (tests/test_state_checkpointing.py of accelerate 1.x,
`CheckpointTest`: the CPU-runnable cases), run twice: with accelerate's own bf16 mixed precision
(the reference, which must pass) and with fxamp's Accelerator in its place (which must pass the
same). Written here in fxamp's words; the scenarios and their assertions are accelerate's:
a y = a*x + b model trained with torch's Adam, `save_state` / `load_state` with automatic
checkpoint naming, a relative project directory, a save limit, a scheduler, the RNG states
(the training loop draws from `random` each epoch and must draw the same after a resume), in
safetensors and in torch's pickle format. Deviations: the loaders run in the main process
(accelerate's use num_workers=4, which only costs process starts here), and fxamp compiles
with aot_eager (the suite tests checkpoints, not Inductor's code). `test_map_location` needs
an accelerator and is left out, as accelerate's CPU runs leave it out.
"""

import contextlib
import os
import random
import shutil
import uuid

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

import accelerate  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fxamp.integrations.accelerate  # noqa: E402

PRECISIONS = ["accelerate", "fxamp"]
pytestmark = pytest.mark.usefixtures("fresh_state")  # accelerate's AccelerateTestCase resets


def _accelerator(precision, **kwargs):
    if precision == "accelerate":
        return accelerate.Accelerator(cpu=True, mixed_precision="bf16", **kwargs)
    return fxamp.integrations.accelerate.Accelerator(cpu=True, mixed_precision="bf16",
                                                     compiler="aot_eager", **kwargs)


class Line(torch.nn.Module):
    """y = a*x + b, one parameter each."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(1))
        self.b = torch.nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def _loaders(batch=16, train_batches=10, valid_batches=2):
    def data(n):
        x = torch.randn(batch * n, 1)
        return TensorDataset(x, 2 * x + 3 + 0.1 * torch.randn(batch * n, 1))

    return (DataLoader(data(train_batches), shuffle=True, batch_size=batch),
            DataLoader(data(valid_batches), shuffle=False, batch_size=batch))


def _fit(epochs, model, loader, opt, acc, scheduler=None):
    """Epochs of training; returns one draw of `random` per epoch (the RNG a resume restores)."""
    draws = []
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        draws.append(random.random())
        if scheduler is not None:
            scheduler.step()
    return draws


def _built(precision, with_scheduler=False, **kwargs):
    set_seed(42)
    model = Line()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    objects = [model, opt, *_loaders()]
    if with_scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99))
    acc = _accelerator(precision, **kwargs)
    return (acc, *acc.prepare(*objects))


def _weights(model):
    return model.a.item(), model.b.item()


def _same_state(one, other):
    """Two optimizer state dicts equal, tensors compared by value."""
    assert one["param_groups"] == other["param_groups"]
    assert one["state"].keys() == other["state"].keys()
    for key, state in one["state"].items():
        assert state.keys() == other["state"][key].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(
                other["state"][key][name])), (key, name)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_with_save_limit(tmp_path, precision, safe):
    config = ProjectConfiguration(total_limit=1, project_dir=str(tmp_path),
                                  automatic_checkpoint_naming=True)
    acc, *_ = _built(precision, project_config=config)
    acc.save_state(safe_serialization=safe)
    acc.save_state(safe_serialization=safe)
    assert len(os.listdir(acc.project_dir)) == 1


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_can_resume_training_with_folder(tmp_path, precision, safe):
    acc, model, opt, loader, _ = _built(precision)
    initial = str(tmp_path / "initial")
    acc.save_state(initial, safe_serialization=safe)
    start, start_state = _weights(model), opt.state_dict()
    whole = _fit(3, model, loader, opt, acc)
    end, end_state = _weights(model), opt.state_dict()

    AcceleratorState._reset_state(True)
    acc, model, opt, loader, _ = _built(precision)
    acc.load_state(initial)
    assert _weights(model) == start
    _same_state(start_state, opt.state_dict())
    resumed = _fit(2, model, loader, opt, acc)
    checkpoint = str(tmp_path / "checkpoint")
    acc.save_state(checkpoint, safe_serialization=safe)
    acc.load_state(checkpoint)
    resumed += _fit(1, model, loader, opt, acc)
    assert _weights(model) == end
    _same_state(end_state, opt.state_dict())
    assert resumed == whole


def _resume_with_automatic_names(project_dir, precision, safe, load_first):
    config = ProjectConfiguration(automatic_checkpoint_naming=True)
    acc, model, opt, loader, _ = _built(precision, project_dir=project_dir,
                                        project_config=config)
    acc.save_state(safe_serialization=safe)
    start, start_state = _weights(model), opt.state_dict()
    whole = _fit(3, model, loader, opt, acc)
    end, end_state = _weights(model), opt.state_dict()

    AcceleratorState._reset_state(True)
    config = ProjectConfiguration(iteration=1, automatic_checkpoint_naming=True)
    acc, model, opt, loader, _ = _built(precision, project_dir=project_dir,
                                        project_config=config)
    load_first(acc)
    assert _weights(model) == start
    _same_state(start_state, opt.state_dict())
    resumed = _fit(2, model, loader, opt, acc)
    acc.save_state(safe_serialization=safe)
    acc.load_state(os.path.join(project_dir, "checkpoints", "checkpoint_1"))
    resumed += _fit(1, model, loader, opt, acc)
    assert _weights(model) == end
    _same_state(end_state, opt.state_dict())
    assert resumed == whole


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_can_resume_training(tmp_path, precision, safe):
    first = str(tmp_path / "checkpoints" / "checkpoint_0")
    _resume_with_automatic_names(str(tmp_path), precision, safe,
                                 lambda acc: acc.load_state(first))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_can_resume_training_checkpoints_relative_path(tmp_path, monkeypatch, precision, safe):
    # accelerate's issue 1983: a relative project directory, the checkpoint found by load_state()
    monkeypatch.chdir(tmp_path)
    relative = f"test_path_{uuid.uuid4()}"
    os.mkdir(relative)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, relative)
        _resume_with_automatic_names(relative, precision, safe, lambda acc: acc.load_state())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_invalid_registration(precision):
    net = Line()
    opt = torch.optim.Adam(net.parameters())
    acc = _accelerator(precision)
    with pytest.raises(ValueError) as refused:
        acc.register_for_checkpointing(torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), net,
                                       opt)
    message = str(refused.value)
    assert "Item at index 0" in message and "Item at index 1" in message
    assert "Item at index 2" not in message and "Item at index 3" not in message


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_with_scheduler(tmp_path, precision, safe):
    config = ProjectConfiguration(automatic_checkpoint_naming=True)
    acc, model, opt, loader, _, scheduler = _built(precision, True, project_dir=str(tmp_path),
                                                   project_config=config)
    acc.save_state(safe_serialization=safe)
    saved = scheduler.state_dict()
    _fit(3, model, loader, opt, acc, scheduler)
    assert saved != scheduler.state_dict()
    acc.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))
    assert saved == scheduler.state_dict()


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_automatic_loading(tmp_path, precision, safe):
    config = ProjectConfiguration(automatic_checkpoint_naming=True)
    acc, model, opt, loader, _, scheduler = _built(precision, True, project_dir=str(tmp_path),
                                                   project_config=config)
    acc.save_state(safe_serialization=safe)
    _fit(2, model, loader, opt, acc, scheduler)
    saved = _weights(model)
    acc.save_state(safe_serialization=safe)
    _fit(1, model, loader, opt, acc, scheduler)
    later = _weights(model)
    acc.load_state()  # the last checkpoint
    now = _weights(model)
    assert now == saved and now[0] != later[0] and now[1] != later[1]


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_deletion(tmp_path, precision, safe):
    set_seed(42)
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    acc = _accelerator(precision, project_dir=str(tmp_path), project_config=config)
    acc.prepare(Line())
    for _ in range(11):
        acc.save_state(safe_serialization=safe)
    checkpoints = tmp_path / "checkpoints"
    assert not (checkpoints / "checkpoint_0").exists()
    assert (checkpoints / "checkpoint_9").exists() and (checkpoints / "checkpoint_10").exists()
