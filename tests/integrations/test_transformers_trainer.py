"""fxamp.integrations.transformers.Trainer, a real transformers Trainer on a tiny GPT-2 (CPU):
the logged grad norms are the unscaled ones (equal to an fp32 Trainer's), an injected overflow
is skipped (weights bit-identical, the lr schedule holds still), resume is exact."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fxamp.errors import ConfigError  # noqa: E402
from fxamp.integrations.transformers import Trainer  # noqa: E402

import tiny_gpt2  # noqa: E402

STEPS = 5


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = [r for b in tiny_gpt2.batches(STEPS) for r in b]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Overflowing(Trainer):
    """Step `overflow_at` (1-based) overflows: its loss, and so its gradients, are inf/nan."""

    overflow_at = 2

    def compute_loss(self, model, inputs, **kw):
        loss = super().compute_loss(model, inputs, **kw)
        return loss * float("inf") if self.state.global_step + 1 == self.overflow_at else loss


class Around(transformers.TrainerCallback):
    """The weights before and after the optimizer step of step `at` (1-based)."""

    def __init__(self, at):
        self.at, self.around = at, []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.at:
            self.around.append(copy.deepcopy(model.state_dict()))

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.at:
            self.around.append(copy.deepcopy(model.state_dict()))


def _args(tmp_path, **kw):
    kw.setdefault("save_strategy", "no")
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
        max_steps=STEPS, logging_steps=1, max_grad_norm=0.5, learning_rate=1e-2,
        lr_scheduler_type="linear", seed=0, **kw)


def _logged(trainer, key):
    return [r[key] for r in trainer.state.log_history if key in r and "train_loss" not in r]


@pytest.mark.parametrize("precision, opt_level, rel", [("fp16", "O2", 2e-2),
                                                       ("bf16", "O1", 3e-2)])
def test_logged_grad_norms_are_the_fp32_runs(tmp_path, precision, opt_level, rel):
    accumulate = dict(gradient_accumulation_steps=2)  # two scaled backwards per step
    ref = transformers.Trainer(model=tiny_gpt2.model(), train_dataset=Rows(),
                               args=_args(tmp_path / "ref", **accumulate))
    ref.train()
    trainer = Trainer(model=tiny_gpt2.model(), train_dataset=Rows(), opt_level=opt_level,
                      args=_args(tmp_path, **{precision: True}, **accumulate),
                      compiler="aot_eager")
    trainer.train()
    dtype = {"O2": torch.float16, "O1": torch.float32}[opt_level]
    assert next(trainer.model.parameters()).dtype == dtype
    got, want = _logged(trainer, "grad_norm"), _logged(ref, "grad_norm")
    assert len(got) == STEPS and max(want) > 0.5  # clipping acted
    assert got == pytest.approx(want, rel=rel)
    assert _logged(trainer, "learning_rate") == _logged(ref, "learning_rate")


def test_overflow_skipped_and_resume_exact(tmp_path):
    def trainer(**kw):
        return Overflowing(model=tiny_gpt2.model(), train_dataset=Rows(), opt_level="O2",
                           compiler="aot_eager", callbacks=[Around(at=2)],
                           args=_args(tmp_path, fp16=True, save_strategy="steps",
                                      save_steps=3),
                           **kw)

    first = trainer()
    first.train()
    overflow = next(c for c in first.callback_handler.callbacks if isinstance(c, Around))
    before, after = overflow.around
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # skipped
    norms, lrs = _logged(first, "grad_norm"), _logged(first, "learning_rate")
    assert not torch.isfinite(torch.tensor(norms[1])) and all(
        torch.isfinite(torch.tensor(n)) for i, n in enumerate(norms) if i != 1)
    assert lrs[1] == lrs[2]  # the scheduler did not advance on the skipped step
    assert first.accelerator.scaler.get_scale() == 2.0**15  # backed off from 2**16
    # Resume from the checkpoint after step 3: the rest runs bit-identically.
    second = trainer()
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert _logged(second, "grad_norm")[3:] == norms[3:]  # the first 3: from the checkpoint
    assert second.accelerator.scaler.get_scale() == first.accelerator.scaler.get_scale()
    final = first.model.state_dict()
    assert all(torch.equal(v, final[k]) for k, v in second.model.state_dict().items())


def test_other_compile_backends_and_orphaned_schedulers_are_refused(tmp_path):
    model = tiny_gpt2.model()
    with pytest.raises(ConfigError, match="torch_compile_backend='fxamp'"):
        Trainer(model=model, args=_args(tmp_path, torch_compile_backend="inductor"))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="would step nothing"):
        Trainer(model=model, args=_args(tmp_path),
                optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    assert next(model.parameters()).dtype == torch.float32


def test_torch_compile_backend_fxamp_is_accepted_and_the_args_left_alone(tmp_path):
    args = _args(tmp_path, torch_compile_backend="fxamp")
    trainer = Trainer(model=tiny_gpt2.model(), args=args, opt_level="O1", compiler="aot_eager")
    assert trainer.accelerator.state.dynamo_plugin.backend.value == "NO"  # fxamp compiles
    assert (args.torch_compile, args.torch_compile_backend) == (True, "fxamp")
