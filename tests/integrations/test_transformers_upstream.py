"""transformers' own resume tests of the Trainer (tests/trainer/test_trainer_checkpointing.py of
transformers 5.x, `TrainerResumeTrainingTest`: the CPU-runnable cases), run twice: with
transformers' Trainer at `bf16=True` (its own mixed precision, the reference: must pass) and
with fxamp's Trainer in its place (must pass the same). Written here in fxamp's words; the
scenarios and assertions are transformers': the regression model y = a*x + b (as a
PreTrainedModel and as a plain nn.Module) trained with the default AdamW and a shuffled loader,
then resumed from checkpoint-5 and from checkpoint-15 (past an epoch): the weights equal,
bit for bit, and the TrainerState the same but for timings; resuming with gradient
accumulation and with a frozen parameter; the errors for a bogus checkpoint path and for
`resume_from_checkpoint=True` without one; `resume_from_checkpoint=False`. Deviation: fxamp
compiles with aot_eager (the suite tests checkpoints, not Inductor's code). Left out: the
sharded-checkpoint variants (they convert with a helper of transformers' test suite), the LM
resume (@slow, a Hub model) and the multi-adapter PEFT resume (a Hub model).
"""

import dataclasses
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


import fxamp  # noqa: E402
from fxamp.integrations.transformers import Trainer as FxampTrainer  # noqa: E402

PRECISIONS = ["transformers", "fxamp"]
pytestmark = pytest.mark.usefixtures("fresh_state")  # accelerate's process-wide state


class Points(torch.utils.data.Dataset):
    """y = 2x + 3 plus noise, from a fixed numpy seed (transformers' RegressionDataset)."""

    def __init__(self, length=64, seed=42):
        rng = np.random.RandomState(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (2 * self.x + 3 + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class LineConfig(transformers.PretrainedConfig):
    model_type = "fxamp-line"

    def __init__(self, a=0.0, b=0.0, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b, self.hidden_size = a, b, 1


def _line(module, a, b):
    module.a = torch.nn.Parameter(torch.tensor(float(a)))
    module.b = torch.nn.Parameter(torch.tensor(float(b)))


def _forward(module, input_x, labels=None, **_):
    y = input_x * module.a + module.b
    return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


class PretrainedLine(transformers.PreTrainedModel):
    config_class = LineConfig
    base_model_prefix = "line"

    def __init__(self, config):
        super().__init__(config)
        _line(self, config.a, config.b)
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        return _forward(self, input_x, labels)


class PlainLine(torch.nn.Module):
    def __init__(self, a=0.0, b=0.0):
        super().__init__()
        _line(self, a, b)
        self.config = None

    def forward(self, input_x, labels=None, **kwargs):
        return _forward(self, input_x, labels)


def _trainer(precision, output_dir, *, pretrained=True, train_len=64, freeze_a=False, **args):
    model = PretrainedLine(LineConfig()) if pretrained else PlainLine()
    if freeze_a:
        model.a.requires_grad_(False)
    arguments = transformers.TrainingArguments(
        output_dir=str(output_dir), bf16=True, use_cpu=True, report_to=[], disable_tqdm=True,
        **args)
    data = dict(train_dataset=Points(train_len), eval_dataset=Points())
    if precision == "transformers":
        return transformers.Trainer(model, arguments, **data)
    return FxampTrainer(model, arguments, compiler="aot_eager", **data)


def _weights(trainer):
    return trainer.model.a.item(), trainer.model.b.item()


def _same_state(one, other):
    """transformers' check_trainer_state_are_the_same: equal but for the timings."""
    one, other = dataclasses.asdict(one), dataclasses.asdict(other)
    for state in (one, other):
        for log in state["log_history"]:
            for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second",
                        "train_loss"):
                log.pop(key, None)
    assert one == other


def _whole_then_resumed(precision, tmp_path, checkpoints, **kwargs):
    trainer = _trainer(precision, tmp_path, **kwargs)
    trainer.train()
    whole, state = _weights(trainer), trainer.state
    assert (fxamp.config_of(trainer.model) is not None) == (precision == "fxamp")
    for name in checkpoints:
        resumed = _trainer(precision, tmp_path, **kwargs)
        resumed.train(resume_from_checkpoint=str(tmp_path / name))
        assert _weights(resumed) == whole, name
        _same_state(state, resumed.state)
        if kwargs.get("freeze_a"):
            assert not resumed.model.a.requires_grad


RESUME = dict(train_len=128, save_steps=5, learning_rate=0.1)


@pytest.mark.parametrize("pretrained", [True, False], ids=["PreTrainedModel", "nn.Module"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_can_resume_training(tmp_path, precision, pretrained):
    _whole_then_resumed(precision, tmp_path, ["checkpoint-5", "checkpoint-15"],
                        pretrained=pretrained, logging_steps=5, **RESUME)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_refuses_missing_checkpoints(tmp_path, precision):
    trainer = _trainer(precision, tmp_path / "a")
    with pytest.raises(Exception, match="Can't find a valid checkpoint at"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-15-bogus"))
    trainer = _trainer(precision, tmp_path / "b")
    with pytest.raises(Exception, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_training_with_gradient_accumulation(tmp_path, precision):
    _whole_then_resumed(precision, tmp_path, ["checkpoint-5"], gradient_accumulation_steps=2,
                        per_device_train_batch_size=4, **RESUME)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_training_with_frozen_params(tmp_path, precision):
    _whole_then_resumed(precision, tmp_path, ["checkpoint-5"], freeze_a=True,
                        per_device_train_batch_size=4, **RESUME)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_with_resume_from_checkpoint_false(tmp_path, precision):
    trainer = _trainer(precision, tmp_path, train_len=128, save_steps=5, learning_rate=0.1)
    trainer.train(resume_from_checkpoint=False)
