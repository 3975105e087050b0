"""fxamp.integrations.transformers.Trainer, a real transformers Trainer on a tiny GPT-2 (CPU):
the logged grad norms are the unscaled ones (equal to an fp32 Trainer's), an injected overflow
is skipped (weights bit-identical, the lr schedule holds still), resume is exact, and the
optimizers users pass (`optimizers=(optimizer, scheduler)`, `optimizer_cls_and_kwargs=`) train
as under transformers' own fp16 Trainer."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState  # noqa: E402

import fxamp  # noqa: E402
from fxamp.errors import ConfigError  # noqa: E402
from fxamp.integrations.transformers import Trainer  # noqa: E402
from fxamp.model.prepare import config_of  # noqa: E402

import tiny_gpt2  # noqa: E402

STEPS = 5


class Rows(torch.utils.data.Dataset):
    def __init__(self, steps=STEPS):
        self.rows = [r for b in tiny_gpt2.batches(steps) for r in b]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class OverflowAt:
    """Step `overflow_at` (1-based) overflows: its loss, and so its gradients, are inf/nan."""

    overflow_at = 2

    def compute_loss(self, model, inputs, **kw):
        loss = super().compute_loss(model, inputs, **kw)
        return loss * float("inf") if self.state.global_step + 1 == self.overflow_at else loss


class Overflowing(OverflowAt, Trainer):
    pass


class ReferenceFp16(OverflowAt, transformers.Trainer):
    """transformers' own Trainer with `fp16=True`, as it runs on a GPU: on a CPU accelerate
    leaves autocast and GradScaler off ("fp16 requires a GPU"), so this turns on what its
    constructor turns on for a GPU (as tests/integrations/test_accelerate.py's reference does):
    autocast around the model and torch's GradScaler, whose skipped step transformers reads
    through `accelerator.optimizer_step_was_skipped` to hold its lr scheduler."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.native_amp, self.accelerator.scaler = True, torch.amp.GradScaler("cpu")


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
    kw = {"save_strategy": "no", "max_steps": STEPS, "max_grad_norm": 0.5, **kw}
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
        logging_steps=1, learning_rate=1e-2, lr_scheduler_type="linear", seed=0, **kw)


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


@pytest.mark.parametrize("scheduler", ["trainer's", "user's"])
def test_overflow_skipped_and_resume_exact(tmp_path, scheduler):
    def trainer(**kw):
        model = tiny_gpt2.model()
        if scheduler == "user's":  # rebuilt on restart, as a script does; then loaded
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
            kw["optimizers"] = (opt, transformers.get_linear_schedule_with_warmup(opt, 0, STEPS))
        return Overflowing(model=model, train_dataset=Rows(), opt_level="O2",
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
    assert _logged(second, "learning_rate") == lrs
    assert second.accelerator.scaler.get_scale() == first.accelerator.scaler.get_scale()
    final = first.model.state_dict()
    assert all(torch.equal(v, final[k]) for k, v in second.model.state_dict().items())


def test_other_compile_backends_and_optimizers_without_a_fused_counterpart_are_refused(
        tmp_path):
    model = tiny_gpt2.model()
    with pytest.raises(ConfigError, match="torch_compile_backend='fxamp'"):
        Trainer(model=model, args=_args(tmp_path, torch_compile_backend="inductor"))
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(ConfigError, match="RMSprop has no fused fxamp counterpart: pass "
                                          "torch.optim.Adam, AdamW or SGD"):
        Trainer(model=model, args=_args(tmp_path),
                optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    assert next(model.parameters()).dtype == torch.float32 and config_of(model) is None


def test_torch_compile_backend_fxamp_is_accepted_and_the_args_left_alone(tmp_path):
    args = _args(tmp_path, torch_compile_backend="fxamp")
    trainer = Trainer(model=tiny_gpt2.model(), args=args, opt_level="O1", compiler="aot_eager")
    assert trainer.accelerator.state.dynamo_plugin.backend.value == "NO"  # fxamp compiles
    assert (args.torch_compile, args.torch_compile_backend) == (True, "fxamp")


# ------------------------------------------------ the optimizers users pass to the Trainer
# `optimizers=(AdamW(model.parameters()), get_linear_schedule_with_warmup(...))`: the scheduler
# is built on the torch optimizer that fxamp replaces by its fused one, and drives that one
# through the shared param groups (Note [Schedulers of a replaced optimizer]). The reference is
# the same script under transformers' own fp16 Trainer (autocast + GradScaler) with an
# overflow forced at step 2: the same lr at every step (held on the skipped one), the same
# skipped steps and loss scale, weights within fp16's rounding of the reference's.
USER_STEPS = 6


class Seen(transformers.TrainerCallback):
    """After each optimizer step: the lr and Adam beta1 the trained optimizer holds (the inner
    one of the Trainer's prepared optimizer), and whether the step was skipped."""

    def __init__(self):
        self.trainer, self.lrs, self.betas, self.skipped = None, [], [], []

    def on_step_end(self, args, state, control, **kw):
        group = self.trainer.optimizer.optimizer.param_groups[0]
        self.lrs.append(group["lr"])
        self.betas.append(group["betas"][0])
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def _scheduler(kind, opt):
    if kind == "linear_warmup":
        return transformers.get_linear_schedule_with_warmup(opt, 2, USER_STEPS)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if kind == "onecycle":  # also cycles Adam's beta1 through the param groups
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=USER_STEPS)
    raise AssertionError(kind)


def _user_run(tmp_path, trainer_cls, *, kind="linear_warmup", opt_cls=torch.optim.AdamW,
              how="optimizers", **fxamp_kw):
    """The user's script: a tiny GPT-2, and the optimizer passed `how` the Trainer takes it."""
    AcceleratorState._reset_state(True)  # the reference runs fp16, fxamp's accelerate "no"
    model, seen = tiny_gpt2.model(), Seen()
    if how == "optimizers":
        opt = opt_cls(model.parameters(), lr=1e-2)
        given = dict(optimizers=(opt, _scheduler(kind, opt)))
    else:  # the Trainer builds it, and its default linear schedule on it
        given = dict(optimizer_cls_and_kwargs=(opt_cls, {"lr": 1e-2}))
    args = _args(tmp_path, fp16=True, max_steps=USER_STEPS, max_grad_norm=1.0)
    trainer = trainer_cls(model=model, args=args, train_dataset=Rows(USER_STEPS),
                          callbacks=[seen], **given, **fxamp_kw)
    seen.trainer = trainer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    AcceleratorState._reset_state(True)
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return trainer, seen, scheduler_warnings


def _compare_with_reference(run, ref, rel):
    (trainer, seen, warned), (ref_trainer, ref_seen, _) = run, ref
    assert seen.skipped == ref_seen.skipped == [i == 1 for i in range(USER_STEPS)]
    assert seen.lrs == pytest.approx(ref_seen.lrs, rel=1e-12)
    assert seen.lrs[1] == seen.lrs[0]  # held on the skipped step
    assert seen.betas == pytest.approx(ref_seen.betas, rel=1e-12)
    assert _logged(trainer, "learning_rate") == _logged(ref_trainer, "learning_rate")
    assert trainer.accelerator.scaler.get_scale() == ref_trainer.accelerator.scaler.get_scale()
    assert warned == []  # torch's "lr_scheduler.step() before optimizer.step()" among them
    init, ref_w = tiny_gpt2.model().state_dict(), ref_trainer.model.state_dict()
    got = trainer.model.state_dict()
    apart = sum(float((got[k].float() - ref_w[k]).norm()) ** 2 for k in ref_w) ** 0.5
    moved = sum(float((ref_w[k] - init[k]).norm()) ** 2 for k in ref_w) ** 0.5
    assert apart < rel * moved, apart / moved


@pytest.mark.parametrize("kind", ["linear_warmup", "lambda", "onecycle"])
def test_a_scheduler_on_a_torch_optimizer_drives_fxamps_as_transformers_fp16_does(
        tmp_path, kind):
    ref = _user_run(tmp_path / "ref", ReferenceFp16, kind=kind)
    run = _user_run(tmp_path, Overflowing, kind=kind,
                    opt_level="O1", compiler="aot_eager")
    # O1 against autocast: the same graphs' dtypes; measured 1.1 % to 3.2 % of how far
    # training moved the weights (OneCycleLR's lr of 5e-2 the most).
    _compare_with_reference(run, ref, rel=0.05)
    trainer = run[0]
    assert isinstance(trainer.optimizer.optimizer, fxamp.optim.AdamW)


@pytest.mark.parametrize("how,opt_cls", [
    ("optimizers", fxamp.optim.AdamW), ("optimizer_cls_and_kwargs", fxamp.optim.AdamW),
    ("optimizer_cls_and_kwargs", torch.optim.AdamW)],
    ids=["optimizers-fxamp", "optimizer_cls_and_kwargs-fxamp", "optimizer_cls_and_kwargs-torch"])
def test_fxamp_and_torch_optimizers_however_passed_train_at_o2(tmp_path, how, opt_cls):
    # An fxamp optimizer is built on the model before the Trainer compiles and casts it (O2:
    # fp16 weights): it is rebuilt over the cast model, its scheduler following (that failed
    # at the first step: "no longer live in the optimizer's flat buffer").
    ref = _user_run(tmp_path / "ref", ReferenceFp16, how=how)
    run = _user_run(tmp_path, Overflowing, how=how, opt_cls=opt_cls,
                    opt_level="O2", compiler="aot_eager")
    # O2 (fp16 weights, fp32 masters) against autocast: measured 1.6 % and 2.7 %.
    _compare_with_reference(run, ref, rel=0.05)
    trainer = run[0]
    assert trainer.model.lm_head.weight.dtype == torch.float16
    assert isinstance(trainer.optimizer.optimizer, fxamp.optim.AdamW)
    if how == "optimizers":
        given = trainer.lr_scheduler.optimizer  # the user's, handed over: no second copy
        assert given.handed_over and given.buckets == [] and not given.state
