"""fxamp.integrations.accelerate.Accelerator with real accelerate, a tiny GPT-2 on CPU: the
gradient norms accelerate clips and returns are the unscaled ones (equal to an fp32 run's), an
injected overflow is skipped and reported, save_state/load_state resume exactly, and the
refusals leave everything as it was; `accumulate()` with `unscale_gradients()` alone."""

import copy

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import accelerate  # noqa: E402

import fxamp  # noqa: E402
from fxamp.errors import ConfigError  # noqa: E402
from fxamp.integrations.accelerate import Accelerator  # noqa: E402

import tiny_gpt2  # noqa: E402

STEPS, OVERFLOW_AT, SAVE_AFTER = 5, 3, 2
MAX_NORM = 0.5  # below the norms this model starts with, so clipping acts


def _train(acc, model, opt, batches, *, skip_at=None, save_to=None, first=0):
    """Steps `first`.. over `batches`; returns the clipped norm and skip flag of each step."""
    out = []
    for i, x in enumerate(batches[first:], start=first):
        acc.backward(model(input_ids=x, labels=x).loss)
        if i == skip_at:
            tiny_gpt2.poison_grad(model)
        norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        if skip_at is None or i != skip_at or isinstance(acc, Accelerator):
            opt.step()  # the fp32 reference leaves the poisoned step out by hand
        out.append((float(norm), acc.optimizer_step_was_skipped))
        opt.zero_grad()
        if save_to is not None and i == SAVE_AFTER:
            acc.save_state(save_to)
    return out


def _fp32_run(batches):
    acc = accelerate.Accelerator(cpu=True)
    model = tiny_gpt2.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    return _train(acc, model, opt, batches, skip_at=OVERFLOW_AT), model


def _moved_apart(model, ref_model):
    return _moved_apart_from(model, ref_model, tiny_gpt2.model())


def _moved_apart_from(model, ref_model, init_model):
    """How far apart two trained models are, over how far the reference moved."""
    init = init_model.state_dict()
    got, ref = model.state_dict(), ref_model.state_dict()
    apart = sum(float((got[k].float() - ref[k]).norm()) ** 2 for k in ref) ** 0.5
    moved = sum(float((ref[k] - init[k]).norm()) ** 2 for k in ref) ** 0.5
    return apart / moved


def test_fp16_o2_norms_skip_and_resume(tmp_path):
    batches = tiny_gpt2.batches(STEPS)
    ref, ref_model = _fp32_run(batches)
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O2", compiler="aot_eager")
    model = tiny_gpt2.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    assert acc.mixed_precision == "no" and acc.scaler is opt.optimizer.loss_scalers[0]
    assert next(model.parameters()).dtype == torch.float16
    got = _train(acc, model, opt, batches[:OVERFLOW_AT], save_to=tmp_path)
    scale = acc.scaler.get_scale()
    before = copy.deepcopy(model.state_dict())
    got += _train(acc, model, opt, batches[:OVERFLOW_AT + 1], skip_at=OVERFLOW_AT,
                  first=OVERFLOW_AT)
    # The overflow: reported, skipped (every weight bit-identical), the scale backed off.
    assert got[OVERFLOW_AT][1] is True and not torch.isfinite(torch.tensor(got[OVERFLOW_AT][0]))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert acc.scaler.get_scale() == scale / 2 and int(acc.scaler.skipped_steps) == 1
    got += _train(acc, model, opt, batches, first=OVERFLOW_AT + 1)
    # Every other step: not skipped, and the norm accelerate returns is the unscaled one,
    # within fp16's rounding of weights and activations of the fp32 run's.
    for i, ((norm, skipped), (ref_norm, _)) in enumerate(zip(got, ref)):
        if i != OVERFLOW_AT:
            assert not skipped and norm == pytest.approx(ref_norm, rel=2e-2), i
    # The weights (SGD: its steps are proportional to the gradients, so fp16 rounding stays
    # small): within 1 % of the distance the fp32 run moved them.
    assert _moved_apart(model, ref_model) < 0.01
    # Resume: load_state from after step SAVE_AFTER and run the rest again: bit-identical,
    # the skip at OVERFLOW_AT included.
    final = copy.deepcopy(model.state_dict())
    acc.load_state(tmp_path)
    assert acc.scaler.get_scale() == scale
    again = _train(acc, model, opt, batches, skip_at=OVERFLOW_AT, first=SAVE_AFTER + 1)
    assert again == got[SAVE_AFTER + 1:]
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k


@pytest.mark.parametrize("kwargs, match", [
    (dict(mixed_precision="fp8"), "amp_options={'float8'"),
    (dict(dynamo_backend="inductor"), "dynamo_backend='fxamp'"),
    (dict(opt_level="o2"), "letter O"),
])
def test_refusals_before_accelerate_starts(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Accelerator(cpu=True, **kwargs)


def test_dynamo_backend_fxamp_is_accepted():
    acc = Accelerator(cpu=True, dynamo_backend="fxamp", compiler="aot_eager")
    assert acc.state.dynamo_plugin.backend.value == "NO"  # fxamp compiles, accelerate does not


def test_an_optimizer_without_a_fused_counterpart_is_refused_untouched():
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O2", compiler="aot_eager")
    model = tiny_gpt2.model()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    state, groups = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with pytest.raises(ConfigError, match="RMSprop has no fused fxamp counterpart"):
        acc.prepare(model, opt)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert opt.state_dict() == groups and acc.scaler is None


def _accumulated(acc, model, opt, batches):
    """accelerate's `accumulate()` over pairs of micro-batches, `unscale_gradients()` alone
    (no clipping) before each real step; returns the gradient norm read at each real step."""
    norms = []
    for x in batches:
        with acc.accumulate(model):
            acc.backward(model(input_ids=x, labels=x).loss)
            if acc.sync_gradients:
                acc.unscale_gradients()
                norms.append(sum(float(p.grad.float().norm()) ** 2
                                 for p in model.parameters()) ** 0.5)
            opt.step()
            opt.zero_grad()
    return norms


def test_accumulate_and_unscale_gradients_alone():
    batches = tiny_gpt2.batches(4)
    ref_acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    ref_model = tiny_gpt2.model()
    ref_model, ref_opt = ref_acc.prepare(ref_model,
                                         torch.optim.SGD(ref_model.parameters(), lr=0.5))
    ref = _accumulated(ref_acc, ref_model, ref_opt, batches)
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O2", compiler="aot_eager",
                      gradient_accumulation_steps=2)
    model = tiny_gpt2.model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    got = _accumulated(acc, model, opt, batches)
    # Two real steps, each over two micro-batches; `.grad` after unscale_gradients() holds the
    # unscaled accumulated gradients (fp16: within its rounding of the fp32 run's norms).
    assert len(got) == len(ref) == 2 and int(acc.scaler.skipped_steps) == 0
    assert got == pytest.approx(ref, rel=2e-2)
    assert _moved_apart(model, ref_model) < 0.01


# ------------------------------------------------------------------------ lr schedulers
# The same script under accelerate's own fp16 (autocast and torch's GradScaler) and under
# fxamp's Accelerator: schedulers built on the torch optimizer before `prepare`, passed to it
# in every way accelerate allows, must drive the optimizer that trains (fxamp's fused one), and
# hold on a step skipped for overflow exactly as accelerate's AcceleratedScheduler does with
# GradScaler (it asks the prepared optimizer's `step_was_skipped`).
SCHED_STEPS, SCHED_OVERFLOW = 6, 2


def _reference_accelerator():
    """accelerate with mixed_precision="fp16" on a CPU: accelerate leaves autocast and
    GradScaler off there ("fp16 requires a GPU"), so the test turns on what its constructor
    turns on for a GPU: `native_amp` (autocast around the model) and torch's GradScaler."""
    acc = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    return acc


def _schedule(kind, opt):
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if kind == "onecycle":  # also cycles Adam's beta1 through the param groups
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=SCHED_STEPS)
    if kind == "linear_warmup":
        return transformers.get_linear_schedule_with_warmup(opt, 2, SCHED_STEPS)
    raise AssertionError(kind)


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _scheduled_script(acc, kind, how, opt_cls=torch.optim.AdamW):
    """A user's loop: scheduler built on the optimizer, then prepared as `how` says."""
    model = _tiny()
    opt = opt_cls(model.parameters(), lr=1e-2)
    sched = _schedule(kind, opt)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(SCHED_STEPS * 4, 8, generator=gen),
                                          torch.randint(0, 4, (SCHED_STEPS * 4,), generator=gen))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    if how == "same_call":
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    elif how == "reversed_order":
        sched, loader, opt, model = acc.prepare(sched, loader, opt, model)
    elif how == "later_call":
        model, opt, loader = acc.prepare(model, opt, loader)
        sched = acc.prepare(sched)
    elif how == "prepare_scheduler":
        model, opt, loader = acc.prepare(model, opt, loader)
        sched = acc.prepare_scheduler(sched)
    elif how == "not_prepared":  # stepped by hand: advances on every step, skipped or not
        model, opt, loader = acc.prepare(model, opt, loader)
    trained = opt.optimizer  # the optimizer whose step updates the weights
    lrs, betas, skipped = [], [], []
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == SCHED_OVERFLOW:
            loss = loss * float("inf")  # an fp16 overflow, forced
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        lrs.append(trained.param_groups[0]["lr"])
        betas.append(trained.param_groups[0]["betas"][0])
    return lrs, betas, skipped, model


CASES = [("lambda", "same_call"), ("lambda", "reversed_order"), ("lambda", "later_call"),
         ("lambda", "prepare_scheduler"), ("lambda", "not_prepared"), ("onecycle", "same_call"),
         ("linear_warmup", "same_call")]


@pytest.mark.parametrize("kind,how", CASES)
def test_schedulers_drive_the_fused_optimizer_and_hold_on_overflow(kind, how, fresh_state):
    ref_lrs, ref_betas, ref_skipped, ref_model = _scheduled_script(_reference_accelerator(),
                                                                   kind, how)
    fresh_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O1", compiler="aot_eager")
    lrs, betas, skipped, model = _scheduled_script(acc, kind, how)
    assert ref_skipped == skipped == [i == SCHED_OVERFLOW for i in range(SCHED_STEPS)]
    assert lrs == pytest.approx(ref_lrs, rel=1e-12) and betas == pytest.approx(ref_betas)
    # A prepared scheduler held its lr over the skipped step (every schedule here moves at
    # every step); one stepped by hand did not.
    held = how != "not_prepared"
    assert (lrs[SCHED_OVERFLOW] == lrs[SCHED_OVERFLOW - 1]) == held
    # The weights: fp16 autocast + torch AdamW against fxamp's O1 graphs + fused AdamW, the
    # same lr at every step: within 1 % of how far training moved them.
    assert _moved_apart_from(model, ref_model, _tiny()) < 0.01


def test_an_fxamp_optimizer_built_before_prepare_is_rebuilt_over_the_cast_model(fresh_state):
    # O2 casts the model to fp16 in `prepare`, after the user built fxamp's AdamW (and its
    # scheduler) on the fp32 weights: it is rebuilt over the cast weights (as initialize
    # does), its scheduler following; that failed at the first step ("no longer live in the
    # optimizer's flat buffer").
    ref_lrs, _, ref_skipped, ref_model = _scheduled_script(_reference_accelerator(), "lambda",
                                                           "same_call")
    fresh_state(True)
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O2", compiler="aot_eager")
    lrs, _, skipped, model = _scheduled_script(acc, "lambda", "same_call", fxamp.optim.AdamW)
    assert model[0].weight.dtype == torch.float16
    assert skipped == ref_skipped and lrs == pytest.approx(ref_lrs, rel=1e-12)
    # fp16 weights with fp32 masters against autocast: measured 0.4 % of how far training
    # moved them.
    assert _moved_apart_from(model, ref_model, _tiny()) < 0.01


def test_a_prepared_scheduler_follows_its_own_optimizer():
    # Two optimizers, two schedulers, one prepare call: accelerate pairs each scheduler with
    # the optimizer it was built on (its AcceleratedScheduler asks only that one whether the
    # step was skipped).
    acc = Accelerator(cpu=True, mixed_precision="fp16", opt_level="O1", compiler="aot_eager")
    model = _tiny()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.AdamW(model[2].parameters(), lr=1e-2)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in opts]
    model, opt0, opt1, sched0, sched1 = acc.prepare(model, *opts, *scheds)
    assert sched0.optimizers == [opt0] and sched1.optimizers == [opt1]
    x = torch.randn(4, 8)
    acc.backward(model(x).float().square().mean())
    opt0.step(), opt1.step(), sched0.step(), sched1.step()
    assert opt0.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt1.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_save_state_writes_every_weight(tmp_path, level):
    # Note [Parameters own their storage] (fxamp/optim/buffers/flat.py): when the parameters
    # were views of fxamp's flat buffer, accelerate's safetensors writer kept one name per
    # storage and dropped the rest silently. Every weight is written (tied lm_head once, as in
    # eager torch), and load_state puts them all back, with no hook of fxamp's on the way.
    acc = Accelerator(cpu=True, mixed_precision="bf16", opt_level=level, compiler="aot_eager")
    model = tiny_gpt2.model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(acc, model, opt, tiny_gpt2.batches(2))
    saved = copy.deepcopy(model.state_dict())
    acc.save_state(tmp_path)
    from safetensors.torch import load_file

    written = load_file(tmp_path / "model.safetensors")
    assert set(written) == set(saved) - {"lm_head.weight"}
    assert all(torch.equal(written[k], saved[k]) for k in written)
    for value in model.state_dict().values():
        if value.is_floating_point():
            value.zero_()
    acc.load_state(tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def _mlp_run(acc, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        acc.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()
    acc.save_model(model, tmp_path)
    from safetensors.torch import load_file

    return load_file(tmp_path / "model.safetensors"), acc.unwrap_model(model).state_dict()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_save_model_writes_what_accelerates_own_bf16_writes(tmp_path, fresh_state, level):
    # accelerate's documented final save. With the parameters views of fxamp's flat buffer it
    # wrote 1 tensor of 4 (safetensors logged "Removed shared tensor"); now the same names as
    # under accelerate's own mixed_precision="bf16", each the model's own weights.
    theirs, _ = _mlp_run(accelerate.Accelerator(cpu=True, mixed_precision="bf16"),
                         tmp_path / "theirs")
    fresh_state(True)
    ours, state = _mlp_run(Accelerator(cpu=True, mixed_precision="bf16", opt_level=level,
                                       compiler="aot_eager"), tmp_path / "ours")
    assert set(ours) == set(theirs) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(torch.equal(ours[k], state[k]) for k in ours)
