"""fxamp's Lightning plugin on LightningModules written the way Lightning users write them:
submodules built in `__init__`, steps that call them directly (`self.encoder(x)`, then
`self.head(z)`), `self.log`, validation, test and predict loops, `configure_optimizers` returning
an optimizer and an lr scheduler dict. Compared with the same module trained under Lightning's
own `MixedPrecision` plugin ("bf16-mixed"; "16-mixed" with its GradScaler), whose numbers
decide, and with Lightning's tests of that plugin ported to fxamp's (tests_pytorch/models/
test_amp.py, plugins/test_amp_plugins.py, plugins/precision/test_amp*.py, utilities/
test_compile.py in Lightning-AI/pytorch-lightning).

Compiled with aot_eager (Inductor's input graphs, without its code generation), bf16 on CPU
unless a test says otherwise.
"""

import copy
import logging
import os
import types
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import fxamp  # noqa: E402
from fxamp.errors import ConfigError  # noqa: E402
from fxamp.model.prepare import config_of  # noqa: E402
from fxamp.integrations.lightning import Precision  # noqa: E402
from fxamp.optim.scaling.scaler_protocol import OptState  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

FEATURES, CLASSES, BATCH, BATCHES = 8, 4, 16, 6
LOW = {"bf16": torch.bfloat16, "16": torch.float16}


def _loader(batches=BATCHES, seed=0, overflow_at=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * BATCH, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (batches * BATCH,), generator=gen)
    if overflow_at is not None:
        x[overflow_at * BATCH, 0] = float("inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class Classifier(L.LightningModule):
    """Lightning's usual style: submodules in __init__, steps that call them directly."""

    def __init__(self, expect=None, lr=1e-2, make_opt=None):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, CLASSES)
        self.expect = expect  # the dtype what the head returns must have in every step, if set
        self.lr, self.make_opt = lr, make_opt
        self.train_losses, self.predictions = [], []

    def _logits(self, x):
        logits = self.head(self.encoder(x))
        if self.expect is not None:
            assert logits.dtype == self.expect, logits.dtype
        return logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self._logits(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.train_losses.append(outputs["loss"].detach().float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self._logits(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self._logits(x), y))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self._logits(x).softmax(-1)

    def configure_optimizers(self):
        make = self.make_opt or (lambda ps: torch.optim.AdamW(ps, lr=self.lr))
        opt = make(self.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fused(ps):
    return fxamp.optim.AdamW(ps, lr=1e-2, compile=False)


def _trainer(plugin=None, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, log_every_n_steps=1, **kwargs)


def _fxamp(level, precision="bf16", **kwargs):
    return Precision(level, dtype=LOW[precision], compiler="aot_eager", **kwargs)


def _run_all(model, plugin, overflow_at=None):
    """fit (with validation), validate, test and predict, as a user's script does."""
    trainer = _trainer(plugin)
    trainer.fit(model, _loader(overflow_at=overflow_at), _loader(2, seed=1))
    val = trainer.validate(model, _loader(2, seed=1))[0]
    test = trainer.test(model, _loader(2, seed=2))[0]
    preds = torch.cat(trainer.predict(model, _loader(2, seed=2)))
    return trainer, val, test, preds


def _weights(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------- coverage
@pytest.fixture(scope="module")
def fxamp_runs():
    """One `_run_all` per opt level, shared by the tests below (bf16; fxamp's AdamW at O2)."""
    runs = {}

    def run(level):
        if level not in runs:
            # What a module called from a step returns: 16-bit at O1 (fxamp's op table, as
            # autocast), fp32 at O2/O3 (Apex's model outputs; the modules compute in bf16).
            expect = torch.bfloat16 if level == "O1" else torch.float32
            model = Classifier(expect=expect, make_opt=_fused if level == "O2" else None)
            runs[level] = (model, *_run_all(model, _fxamp(level)))
        return runs[level]

    return run


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_every_step_runs_in_the_precision_whatever_module_it_calls(level, fxamp_runs):
    # Lightning's AMPTestModel (tests_pytorch/models/test_amp.py), written in the usual style:
    # each step asserts the dtype of what its submodules return. Today O1 runs the steps in
    # fp32 while trainer.precision says bf16-mixed, and O2/O3 raise a dtype mismatch.
    model, trainer, val, test, preds = fxamp_runs(level)
    if level != "O1":
        assert model.head.weight.dtype == torch.bfloat16
    assert trainer.precision == ("bf16-true" if level == "O3" else "bf16-mixed")
    assert trainer.global_step == BATCHES and len(model.train_losses) == BATCHES
    assert all(torch.isfinite(loss) for loss in model.train_losses)
    assert {"val_loss", "val_acc"} <= val.keys() and "test_loss" in test
    assert preds.shape == (2 * BATCH, CLASSES)
    assert preds.dtype == (torch.bfloat16 if level == "O1" else torch.float32)
    assert fxamp.config_of(model).opt_level == level


def test_the_steps_run_fxamps_layers_and_are_still_lightning_steps():
    # The steps run eagerly (as under Lightning's autocast); the layers they call are
    # compiled (Note [A step calls the model's layers]).
    model = Classifier()
    plugin = _fxamp("O1")
    plugin.convert_module(model)
    from lightning.pytorch.utilities.model_helpers import is_overridden
    for name in ("training_step", "validation_step", "test_step", "predict_step"):
        assert is_overridden(name, model), name
    before = len(fxamp.backend_of(model).compiled_graphs)
    model.predict_step((torch.randn(BATCH, FEATURES), torch.zeros(BATCH, dtype=torch.long)), 0)
    assert len(fxamp.backend_of(model).compiled_graphs) > before


# ---------------------------------------------------- the same module under Lightning's plugin
@pytest.fixture(scope="module")
def lightning_bf16_mixed():
    model = Classifier()
    return (model, *_run_all(model, MixedPrecision("bf16-mixed", "cpu")))


@pytest.fixture(scope="module")
def fp32_run():
    model = Classifier()
    return (model, *_run_all(model, None))


def test_o1_matches_lightning_bf16_mixed(fxamp_runs, lightning_bf16_mixed, fp32_run):
    ref, _, ref_val, ref_test, ref_preds = lightning_bf16_mixed
    model, _, val, test, preds = fxamp_runs("O1")
    # fxamp's O1 table on CPU is autocast's: the same ops in bf16, the same casts, so the
    # same numbers up to the order Inductor's input graph runs them in.
    torch.testing.assert_close(torch.stack(model.train_losses),
                               torch.stack(ref.train_losses), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(_weights(model), _weights(ref), rtol=1e-3, atol=1e-3)
    assert val["val_loss"] == pytest.approx(ref_val["val_loss"], abs=1e-2)
    assert test["test_loss"] == pytest.approx(ref_test["test_loss"], abs=1e-2)
    assert preds.dtype == ref_preds.dtype
    torch.testing.assert_close(preds.float(), ref_preds.float(), rtol=0, atol=1e-2)
    # and not the fp32 run's numbers (the precision did apply)
    assert not torch.equal(_weights(model), _weights(fp32_run[0]))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_o2_o3_stay_as_close_to_fp32_as_lightning_bf16_mixed(level, fxamp_runs,
                                                              lightning_bf16_mixed, fp32_run):
    ref, fp32 = lightning_bf16_mixed[0], fp32_run[0]
    model, _, val, _, _ = fxamp_runs(level)
    # Apex's O2/O3 keep the modules' whole computation in bf16 where autocast keeps some ops
    # in fp32: within 4x autocast's distance from fp32, in the weights and in the losses.
    ref_apart = (_weights(ref) - _weights(fp32)).norm()
    assert (_weights(model) - _weights(fp32)).norm() < 4 * ref_apart
    loss_apart = (torch.stack(ref.train_losses) - torch.stack(fp32.train_losses)).abs().max()
    got_apart = (torch.stack(model.train_losses) - torch.stack(fp32.train_losses)).abs().max()
    assert got_apart < 4 * loss_apart + 1e-2
    assert val["val_loss"] == pytest.approx(fp32_run[2]["val_loss"], abs=5e-2)


def test_o1_fp16_with_overflow_matches_lightning_16_mixed():
    # Lightning's "16-mixed" on CPU: autocast fp16 and torch's GradScaler. fxamp's O1 fp16: its
    # graphs and its LossScaler (Apex's rule; the same start, 2**16, and halving). Batch 2
    # overflows in both: skipped, the scale halved, weights otherwise within autocast's fp16.
    ref = Classifier()
    ref_plugin = MixedPrecision("16-mixed", "cpu")
    _trainer(ref_plugin).fit(ref, _loader(overflow_at=2))
    model = Classifier()
    plugin = _fxamp("O1", "16")
    trainer = _trainer(plugin)
    trainer.fit(model, _loader(overflow_at=2))
    assert trainer.precision == "16-mixed"
    assert plugin.scaler.get_scale() == ref_plugin.scaler.get_scale() == 2.0**15
    assert int(plugin.scaler.skipped_steps) == 1
    torch.testing.assert_close(_weights(model), _weights(ref), rtol=1e-3, atol=1e-3)
    finite = [i for i in range(BATCHES) if i != 2]
    torch.testing.assert_close(torch.stack(model.train_losses)[finite],
                               torch.stack(ref.train_losses)[finite], rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------ Lightning's own tests, ported
# Each runs twice: with Lightning's own MixedPrecision (the reference: it must pass) and with
# fxamp's plugin in its place (which must pass the same).
TOOLS = ["lightning", "fxamp"]


def _plugin(tool, precision="bf16"):
    if tool == "lightning":
        return MixedPrecision(f"{precision}-mixed", "cpu")
    return _fxamp("O1", precision)


def _stage(scaler, optimizer):
    """Where the scaler is with `optimizer`: torch's GradScaler keeps it privately."""
    if hasattr(scaler, "optimizer_state"):
        return scaler.optimizer_state(optimizer)
    return scaler._per_optimizer_states[id(optimizer)]["stage"]


class _BoringStyle(Classifier):
    """tests_pytorch/plugins/test_amp_plugins.py's TestPrecisionModel: the gradients are scaled
    in on_after_backward, unscaled (the optimizer UNSCALED) in on_before_optimizer_step, and
    Lightning's value clipping acts on the unscaled ones; the optimizer's own step keywords
    reach it."""

    def on_after_backward(self):
        scale = self.trainer.precision_plugin.scaler.get_scale()
        assert scale != 1.0
        self.original_grads = [p.grad / scale for p in self.parameters()]

    def on_before_optimizer_step(self, optimizer, *_):
        scaler = self.trainer.precision_plugin.scaler
        assert _stage(scaler, optimizer) is OptState.UNSCALED
        for actual, expected in zip((p.grad for p in self.parameters()), self.original_grads):
            torch.testing.assert_close(actual, expected, equal_nan=True)
        self.clipped = []
        for p in self.parameters():
            twin = p.detach().clone()
            twin.grad = p.grad.clone()
            self.clipped.append(twin)
        torch.nn.utils.clip_grad_value_(self.clipped, self.trainer.gradient_clip_val)

    def configure_gradient_clipping(self, *args, **kwargs):
        super().configure_gradient_clipping(*args, **kwargs)
        for p, expected in zip(self.parameters(), self.clipped):
            torch.testing.assert_close(p.grad, expected.grad, equal_nan=True)

    def optimizer_step(self, epoch, batch_idx, optimizer, closure, **_):
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self):
        class ClippingSGD(torch.optim.SGD):
            def step(self, *args, pl_module=None):
                assert pl_module is not None
                return super().step(*args)

        return ClippingSGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_amp_gradient_unscale(accumulate, tool):
    model = _BoringStyle()
    trainer = _trainer(_plugin(tool, "16"), max_epochs=2, limit_train_batches=4,
                       gradient_clip_val=1e-3, gradient_clip_algorithm="value",
                       accumulate_grad_batches=accumulate)
    trainer.fit(model, _loader())
    assert trainer.global_step == 2 * 4 // accumulate


@pytest.mark.parametrize("tool", TOOLS)
def test_skip_training_step_with_grad_scaler(tool):
    # tests_pytorch/plugins/precision/test_amp_integration.py: a training_step that returns
    # None skips its backward, and the scaler too.
    class SkipOdd(Classifier):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, *args):
            pass

    plugin = _plugin(tool, "16")
    trainer = _trainer(plugin, max_steps=5, gradient_clip_val=0.5)
    model = SkipOdd()
    plugin.convert_module(model)  # makes the scaler, which the mock then wraps
    plugin.scaler = mock.Mock(wraps=plugin.scaler)
    trainer.fit(model, _loader(10))
    assert plugin.scaler.unscale_.call_count == 3
    assert plugin.scaler.step.call_count == 3
    assert plugin.scaler.update.call_count == 3


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("clip_val", [0, 10])
def test_precision_16_clip_gradients(clip_val, tool):
    # tests_pytorch/models/test_amp.py: clipping only when gradient_clip_val > 0.
    with mock.patch("torch.nn.utils.clip_grad_norm_") as clip:
        _trainer(_plugin(tool, "16"), limit_train_batches=4,
                 gradient_clip_val=clip_val).fit(Classifier(), _loader())
    assert clip.called == (clip_val > 0)


@pytest.mark.parametrize("tool", TOOLS)
def test_amp_skip_optimizer(tool):
    # tests_pytorch/plugins/test_amp_plugins.py: manual optimization with two optimizers, only
    # the second of which steps; the step still runs in the precision.
    class TwoOptimizers(Classifier):
        def __init__(self):
            super().__init__(expect=torch.float16)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            _, opt2 = self.optimizers()
            x, y = batch
            loss = F.cross_entropy(self._logits(x), y)
            opt2.zero_grad()
            self.manual_backward(loss)
            opt2.step()

        def on_train_batch_end(self, *args):
            pass

        def configure_optimizers(self):
            return [torch.optim.SGD(self.encoder.parameters(), lr=0.1),
                    torch.optim.SGD(self.head.parameters(), lr=0.1)]

    model = TwoOptimizers()
    encoder = copy.deepcopy(model.encoder.state_dict())
    head = model.head.weight.detach().clone()
    _trainer(_plugin(tool, "16"), max_steps=3).fit(model, _loader())
    assert all(torch.equal(v, encoder[k]) for k, v in model.encoder.state_dict().items())
    assert not torch.equal(model.head.weight, head)


@pytest.mark.parametrize("tool", TOOLS)
def test_no_grad_inside_a_step_keeps_the_loss_differentiable(tool):
    # tests_pytorch/plugins/precision/test_amp.py (test_amp_with_no_grad): a no_grad forward of
    # the same layer before the loss does not cut the loss's graph.
    class Teacher(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            with torch.no_grad():
                target = self.head(self.encoder(x)).softmax(-1)
            logits = self._logits(x)
            assert logits.requires_grad
            return F.cross_entropy(logits, target.float()) + F.cross_entropy(logits, y)

    model = Teacher(expect=torch.bfloat16)
    before = _weights(model)
    _trainer(_plugin(tool), max_steps=2).fit(model, _loader())
    assert not torch.equal(_weights(model), before)


# ----------------------------------------------------------------------------- refusals
def test_a_torch_compiled_lightning_module_is_refused_untouched():
    # tests_pytorch/utilities/test_compile.py: Lightning trains `torch.compile(model)` by
    # compiling its steps with that compile's backend; fxamp's plugin would then not run them.
    model = Classifier()
    compiled = torch.compile(model, backend="eager")
    state = copy.deepcopy(model.state_dict())
    plugin = _fxamp("O1")
    with pytest.raises(ConfigError, match="to_uncompiled"):
        _trainer(plugin).fit(compiled, _loader())
    assert fxamp.config_of(model) is None and plugin.scaler is None
    assert all(torch.equal(v, state[k]) and v.dtype == state[k].dtype
               for k, v in model.state_dict().items())
    from lightning.pytorch.utilities.compile import to_uncompiled
    model = to_uncompiled(model)
    _trainer(_fxamp("O1"), max_steps=1).fit(model, _loader())
    assert fxamp.config_of(model) is not None


def test_a_module_compiled_by_fxamp_without_its_layers_is_refused():
    model = fxamp.compile(Classifier(), opt_level="O1", compiler="aot_eager")
    with pytest.raises(ConfigError, match="compiles its call but not its layers"):
        _trainer(_fxamp("O1"), max_steps=1).fit(model, _loader())


def test_fp16_refusal_puts_the_layers_back():
    model = Classifier()  # a torch AdamW over the O2 fp16 weights: refused at fit
    plugin = _fxamp("O2", "16")
    with pytest.raises(ConfigError, match="fxamp.optim.AdamW"):
        _trainer(plugin).fit(model, _loader())
    assert "training_step" not in vars(model) and fxamp.config_of(model) is None
    assert "forward" not in vars(model.head) and "forward" not in vars(model.encoder)
    assert next(model.parameters()).dtype == torch.float32


def test_a_copy_runs_its_own_steps(fxamp_runs):
    model = fxamp_runs("O2")[0]
    twin = copy.deepcopy(model)
    assert fxamp.config_of(twin).opt_level == "O2"
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    batch = next(iter(_loader()))
    # the copy's step computes with the copy's (zeroed) weights, not the original's
    assert twin.predict_step(batch, 0).std() == 0
    assert model.predict_step(batch, 0).std() > 0


def test_torch_save_of_a_trained_module_round_trips(fxamp_runs, tmp_path):
    # torch.save(model) pickles the module (LightningModule.__getstate__ keeps what
    # nn.Module's drops: the compiled call, which failed to pickle); the loaded one is compiled
    # by fxamp as the original was and predicts the same
    model = fxamp_runs("O2")[0]
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert fxamp.config_of(loaded).opt_level == "O2"
    batch = next(iter(_loader()))
    assert torch.equal(loaded.predict_step(batch, 0), model.predict_step(batch, 0))


def test_a_float_target_is_not_cast():
    # At O2 the modules a step calls compute in 16 bits; the step's own code around them, the
    # loss against the batch's fp32 targets, runs in fp32, as around Apex's model. A target
    # fp16 cannot hold (1 + 2**-14) shows it: with a zero output, the loss is mean(y**2).
    class Regressor(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.encoder(x)), y)

    model = Regressor()
    _fxamp("O2", "16").convert_module(model)
    with torch.no_grad():
        model.head.weight.zero_(), model.head.bias.zero_()
    y = torch.full((4, CLASSES), 1 + 2**-14)
    loss = model.training_step((torch.randn(4, FEATURES), y), 0)
    assert loss.dtype == torch.float32 and loss.item() == (y.double() ** 2).mean().float().item()


def test_ddp_runs_the_steps_as_a_single_device_does():
    # Lightning's DDP calls each step through the wrapper's forward (its forward redirection):
    # the same casts as on one device (a regression target is not cast to 16 bits), so one
    # process under DDP trains bit for bit as without it (the same data order).
    class Regressor(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(self.encoder(x)), y)

    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, FEATURES, generator=gen),
                                          torch.randn(32, CLASSES, generator=gen) * 1.001)
    weights = []
    for strategy in ("auto", "ddp"):
        model = Regressor(make_opt=_fused)
        # Lightning's DDP sets the process group and its environment variables (RANK,
        # WORLD_SIZE, ...): both are taken back, or later tests would start distributed.
        try:
            with mock.patch.dict(os.environ):
                _trainer(_fxamp("O2"), strategy=strategy, use_distributed_sampler=False).fit(
                    model, torch.utils.data.DataLoader(data, batch_size=8))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        weights.append(_weights(model))
    assert torch.equal(weights[0], weights[1])


def test_a_step_that_appends_to_a_list_keeps_its_precision_past_the_recompile_limit():
    # Lightning's documented pattern (validation_step_outputs.append(...)): Dynamo recompiles
    # the step at every call (the list's length is guarded) until torch's limit, then runs it
    # eagerly, where the modules still cast at the model boundary (O2: 16-bit inside).
    class Collects(Classifier):
        def __init__(self):
            super().__init__(make_opt=_fused)
            self.outputs = []

        def validation_step(self, batch, batch_idx):
            x, y = batch
            assert self.head.weight.dtype == torch.bfloat16
            self.outputs.append(F.cross_entropy(self._logits(x), y))

        def on_validation_epoch_end(self):
            self.log("val_loss", torch.stack(self.outputs).mean())
            self.outputs.clear()

    model = Collects()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "hit config.recompile_limit" for the step
        result = _trainer(_fxamp("O2"), limit_train_batches=1, num_sanity_val_steps=0).validate(
            model, _loader(12, seed=1))[0]
    assert torch.isfinite(torch.tensor(result["val_loss"]))


@pytest.mark.parametrize("accelerator", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs a CUDA device"))])
def test_the_config_is_resolved_for_the_strategys_device(accelerator):
    # Lightning converts the module while it is still on the CPU; the precision is the one of
    # the device it trains on (fp16 and CUDA's op table on a GPU, not the CPU's bf16).
    model = Classifier(make_opt=_fused)
    trainer = L.Trainer(accelerator=accelerator, devices=1, plugins=[Precision("O2",
                        compiler="aot_eager")], max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, _loader())
    config = fxamp.config_of(model)
    assert config.device_type == accelerator and model.head.weight.device.type == accelerator
    assert config.dtype == (torch.float16 if accelerator == "cuda" else torch.bfloat16)
    assert trainer.precision == ("16-mixed" if accelerator == "cuda" else "bf16-mixed")


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed", "model_parallel", "xla"])
def test_a_strategy_the_plugin_is_not_tested_under_is_refused_before_anything_changes(strategy):
    # FSDP, DeepSpeed and ModelParallel need a GPU in Lightning (their Trainer refuses a CPU
    # before the plugin is reached; DeepSpeed also its package), so the plugin is asked as the
    # strategy's setup asks it, with Lightning's own strategy classes (not constructed).
    from lightning.pytorch import strategies
    made = {"fsdp": strategies.FSDPStrategy, "model_parallel": strategies.ModelParallelStrategy,
            "deepspeed": strategies.DeepSpeedStrategy, "xla": strategies.XLAStrategy}[strategy]
    model = Classifier()
    model._trainer = types.SimpleNamespace(strategy=object.__new__(made))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"does not support strategy {made.__name__}: it "
                                          "trains under one device and DDP"):
        _fxamp("O2").convert_module(model)
    assert config_of(model) is None
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
               for k in before)
