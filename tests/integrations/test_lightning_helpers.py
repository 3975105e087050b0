"""What a Lightning step calls that is not the model: a loss module (`self.criterion`), a
torchmetrics metric updated or logged from the step, a parameterless helper. fxamp's plugin
compiles the model's call and its layers; the steps run eagerly, so these run as under
Lightning's own precision (autocast's rules at O1, fp32 on the layers' fp32 outputs at O2/O3),
in their own dtype and uncompiled. Compared with Lightning's `MixedPrecision` ("16-mixed",
"bf16-mixed" on CPU) on the same user code (issue 38). Also: steps replaced on the instance
(Lightning's hook-recording partials, mocks) and a plain nn.Module, which Lightning's plugin
takes. aot_eager, CPU.
"""

import functools
import inspect
import logging
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")
torchmetrics = pytest.importorskip("torchmetrics")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import fxamp  # noqa: E402
from fxamp.integrations.lightning import Precision  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

FEATURES, CLASSES, BATCH = 8, 4, 16
LOW = {"bf16": torch.bfloat16, "16": torch.float16}


def _loader(batches, seed=0, regression=False, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * BATCH, FEATURES, generator=gen)
    if regression:
        y = (torch.randn(batches * BATCH, 1, generator=gen) + 3.0) * scale
    else:
        y = torch.randint(0, CLASSES, (batches * BATCH,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


def _trainer(plugin, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, log_every_n_steps=1,
                     num_sanity_val_steps=0, **kwargs)


def _fxamp(level, precision="bf16"):
    return Precision(level, dtype=LOW[precision], compiler="aot_eager")


def _lightning(precision):
    return MixedPrecision(f"{precision}-mixed", "cpu")


def _weights(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


class Tutorial(L.LightningModule):
    """Most Lightning tutorials: the loss as a module attribute, called from the step on what
    the layers return."""

    def __init__(self, criterion, outputs=CLASSES, fused=False):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU())
        self.head = torch.nn.Linear(32, outputs)
        self.criterion = criterion
        self.fused, self.losses = fused, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.head(self.encoder(x)), y)
        self.losses.append(loss.detach().float())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.fused:  # fp16 weights need fp32 masters
            return fxamp.optim.AdamW(self.parameters(), lr=1e-2, compile=False)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(model, plugin, loader, **kwargs):
    trainer = _trainer(plugin, **kwargs)
    trainer.fit(model, loader)
    return trainer


# ---------------------------------------------------------------- 1. a loss module
def test_a_loss_module_at_o2_fp16_is_fp32_and_skips_no_step_as_16_mixed():
    # Compiled into the step, nn.CrossEntropyLoss got fp16 inputs and gave an fp16 loss whose
    # scaled gradient (65536) overflowed: the first step always skipped, 4.9 % off in the loss.
    ref = Tutorial(torch.nn.CrossEntropyLoss())
    ref_plugin = _lightning("16")
    _fit(ref, ref_plugin, _loader(8))
    model = Tutorial(torch.nn.CrossEntropyLoss(), fused=True)
    plugin = _fxamp("O2", "16")
    _fit(model, plugin, _loader(8))
    assert int(plugin.scaler.skipped_steps) == 0 and ref_plugin.scaler.get_scale() == 2.0**16
    assert all(loss.dtype == torch.float32 for loss in model.losses)
    losses, ref_losses = torch.stack(model.losses), torch.stack(ref.losses)
    assert ((losses - ref_losses).abs() / ref_losses).max() < 1e-3
    assert (_weights(model) - _weights(ref)).abs().max() < 2e-3


def test_a_mse_loss_module_with_large_targets_logs_finite_losses_as_16_mixed():
    # Targets of a few hundred: in fp16 the squared error overflowed, the logged loss was inf
    # on 21 of 24 steps.
    data = _loader(24, regression=True, scale=100.0)
    ref = Tutorial(torch.nn.MSELoss(), outputs=1)
    _fit(ref, _lightning("16"), data)
    model = Tutorial(torch.nn.MSELoss(), outputs=1, fused=True)
    _fit(model, _fxamp("O2", "16"), data)
    losses, ref_losses = torch.stack(model.losses), torch.stack(ref.losses)
    assert torch.isfinite(ref_losses).all() and torch.isfinite(losses).all()
    assert ((losses - ref_losses).abs() / ref_losses).max() < 1e-3


def test_a_loss_module_with_a_weight_buffer_keeps_it_fp32():
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0])
    model = Tutorial(torch.nn.CrossEntropyLoss(weight=weight), fused=True)
    _fit(model, _fxamp("O2"), _loader(2))
    assert model.criterion.weight.dtype == torch.float32
    assert model.head.weight.dtype == torch.bfloat16
    assert all(torch.isfinite(loss) for loss in model.losses)


# ------------------------------------------------------------------ 2., 3. metrics
class WithMetrics(L.LightningModule):
    """lightning-hydra-template's style: metrics as attributes, updated and logged from the
    step; the predictions are recorded to check the metrics against."""

    def __init__(self, fused=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        self.mse = torchmetrics.MeanSquaredError()
        self.mae = torchmetrics.MeanAbsoluteError()
        self.train_loss = torchmetrics.MeanMetric()
        self.fused, self.preds, self.targets = fused, [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        loss = F.mse_loss(pred, y)
        self.mse(pred, y)
        self.mae(pred, y)
        self.train_loss(loss)
        self.preds.append(pred.detach().float())
        self.targets.append(y)
        self.log("train_mse", self.mse, on_step=False, on_epoch=True)
        self.log("train_mae", self.mae, on_step=False, on_epoch=True)
        self.log("train_loss_mean", self.train_loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        if self.fused:
            return fxamp.optim.AdamW(self.parameters(), lr=1e-3, compile=False)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_metric_updated_in_the_step_gets_the_models_outputs_uncast():
    # At O2 fp16 the metric's preds and targets were cast to fp16: it gave inf where its own
    # predictions give a finite mean squared error.
    model = WithMetrics(fused=True)
    trainer = _fit(model, _fxamp("O2", "16"), _loader(4, regression=True, scale=50.0))
    preds, targets = torch.cat(model.preds), torch.cat(model.targets)
    logged = trainer.callback_metrics["train_mse"].item()
    assert logged == pytest.approx(F.mse_loss(preds.double(), targets.double()).item(),
                                   rel=1e-4)
    assert logged > 1e4  # beyond what fp16 sums of its squares hold


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_metrics_logged_from_the_step_match_bf16_mixed(level):
    # MeanMetric and MeanAbsoluteError logged from the step read exactly 1.0 every epoch at
    # every level (torch.compile miscompiles them; the user never compiled them).
    data = _loader(6, regression=True)
    ref = WithMetrics()
    ref_trainer = _fit(ref, _lightning("bf16"), data, max_epochs=2)
    model = WithMetrics(fused=level == "O2")
    trainer = _fit(model, _fxamp(level), data, max_epochs=2)
    got, want = trainer.callback_metrics, ref_trainer.callback_metrics
    for name in ("train_mae", "train_loss_mean"):
        assert got[name].item() != 1.0
        assert got[name].item() == pytest.approx(want[name].item(), rel=5e-2), name
    # the epoch's MAE is the one of the predictions the step made
    preds, targets = torch.cat(model.preds[-6:]), torch.cat(model.targets[-6:])
    assert got["train_mae"].item() == pytest.approx((preds - targets).abs().mean().item(),
                                                    rel=1e-4)


# ------------------------------------------------- what a step calls that is the model's
def test_the_layers_a_step_calls_are_compiled_and_the_helpers_are_not():
    model = Tutorial(torch.nn.CrossEntropyLoss())
    _fxamp("O2").convert_module(model)
    assert "forward" in vars(model.encoder) and "forward" in vars(model.head)
    assert "forward" not in vars(model.criterion)
    before = len(fxamp.backend_of(model).compiled_graphs)
    x, y = torch.randn(BATCH, FEATURES), torch.randint(0, CLASSES, (BATCH,))
    loss = model.training_step((x, y), 0)
    assert len(fxamp.backend_of(model).compiled_graphs) > before  # encoder and head
    assert loss.dtype == torch.float32
    ref = F.cross_entropy(model.head(model.encoder(x)).float(), y)
    assert loss.item() == ref.item()


# ------------------------------------------------------------------ 4. Lightning's own tests
def _members(cls):
    return {name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_")}


def _lightning_hooks():
    # test_hooks.py's choice: LightningModule's members but log and optimizers, and of
    # nn.Module's only forward, zero_grad and train.
    hooks = _members(L.LightningModule) - {"optimizers", "log", "log_dict"}
    return sorted(hooks - (_members(torch.nn.Module) - {"forward", "zero_grad", "train"}))


class _Hooked(Tutorial):
    """tests_pytorch/models/test_hooks.py's HookedModel: every LightningModule hook, steps
    and forward included, replaced on the instance by a partial that records the call."""

    def __init__(self, called, automatic=True):
        super().__init__(torch.nn.CrossEntropyLoss())
        self.automatic_optimization = automatic

        def call(hook, fn, *args, **kwargs):
            called.append(hook)
            return fn(*args, **kwargs)

        for hook in _lightning_hooks():
            attr = getattr(self, hook)
            partial = functools.partial(call, hook, attr)
            functools.update_wrapper(partial, attr)
            setattr(self, hook, partial)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.criterion(self.head(self.encoder(x)), y))


@pytest.mark.parametrize("automatic", [True, False])
def test_trainer_model_hook_system_fit(automatic):
    # Refused before: "TestModel.training_step is replaced on the instance by a partial".
    runs = {}
    for name, plugin in (("lightning", _lightning("bf16")), ("fxamp", _fxamp("O1"))):
        called = []
        model = _Hooked(called, automatic)
        trainer = _trainer(plugin, max_steps=2, limit_val_batches=1)
        trainer.fit(model, _loader(2), _loader(1, seed=1))
        runs[name] = (called, model, trainer)
    assert runs["fxamp"][0] == runs["lightning"][0]
    assert "training_step" in runs["fxamp"][0] and "validation_step" in runs["fxamp"][0]
    torch.testing.assert_close(_weights(runs["fxamp"][1]), _weights(runs["lightning"][1]),
                               rtol=1e-3, atol=1e-3)


def test_a_mocked_step_is_taken():
    model = Tutorial(torch.nn.CrossEntropyLoss())
    with mock.patch.object(model, "training_step", wraps=model.training_step) as step:
        _fit(model, _fxamp("O1"), _loader(2))
    assert step.call_count == 2
    assert fxamp.config_of(model).opt_level == "O1"


@pytest.mark.parametrize("plugin", [lambda: _lightning("bf16"), lambda: _fxamp("O1")],
                         ids=["lightning", "fxamp"])
def test_amp_with_no_grad(plugin):
    # tests_pytorch/plugins/precision/test_amp.py with fxamp's plugin in MixedPrecision's place:
    # a plain nn.Module (refused before: "'training_step' is not a method of Linear").
    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = plugin()
    layer = amp.convert_module(layer)
    with amp.forward_context():
        with torch.no_grad():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None
        assert loss.dtype == torch.bfloat16


def test_layers_in_a_module_list_are_the_models():
    class Blocks(Tutorial):
        def __init__(self):
            super().__init__(torch.nn.CrossEntropyLoss(), fused=True)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = self.encoder(x)
            for block in self.blocks:
                h = block(h)
            return self.criterion(self.head(h), y)

    model = Blocks()
    _fit(model, _fxamp("O2"), _loader(2))
    assert all("forward" in vars(block) for block in model.blocks)
    assert all(p.dtype == torch.bfloat16 for p in model.blocks.parameters())
    before = len(fxamp.backend_of(model).compiled_graphs)
    model.blocks[0](torch.randn(3, 32))  # a new shape: the block's own graph compiles again
    assert len(fxamp.backend_of(model).compiled_graphs) > before


def test_a_step_compiled_by_the_user_still_runs_in_the_precision():
    # The user's torch.compile traces the layers with its own backend: under the plugin's
    # autocast at O1, as under Lightning's, so the same numbers as "bf16-mixed" with it.
    class Unlogged(Tutorial):  # Dynamo fails on self.log's signature check, whatever the plugin
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.criterion(self.head(self.encoder(x)), y)
            self.losses.append(loss.detach().float())
            return loss

    runs = []
    for plugin in (_lightning("bf16"), _fxamp("O1")):
        model = Unlogged(torch.nn.CrossEntropyLoss())
        model.training_step = torch.compile(model.training_step, backend="aot_eager")
        _fit(model, plugin, _loader(4))
        runs.append(model)
    torch.testing.assert_close(torch.stack(runs[1].losses), torch.stack(runs[0].losses),
                               rtol=1e-3, atol=1e-3)
    assert fxamp.config_of(runs[1]).opt_level == "O1"


def test_the_modules_call_is_one_graph_with_its_layers_inline():
    class WithForward(Tutorial):
        def forward(self, x):
            return self.head(self.encoder(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.criterion(self(x), y)

    model = WithForward(torch.nn.CrossEntropyLoss())
    _fxamp("O2").convert_module(model)
    x, y = torch.randn(BATCH, FEATURES), torch.randint(0, CLASSES, (BATCH,))
    loss = model.training_step((x, y), 0)
    graphs = fxamp.backend_of(model).compiled_graphs
    assert len(graphs) == 1 and loss.dtype == torch.float32
    # the layers' own graphs come only when a step calls them itself
    torch.testing.assert_close(model.head(model.encoder(x)), model(x))
    assert len(graphs) == 3


def test_a_copys_layers_compile_with_the_copys_backend():
    import copy
    model = Tutorial(torch.nn.CrossEntropyLoss())
    _fxamp("O2").convert_module(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.head.weight.zero_(), twin.head.bias.zero_()
    x = torch.randn(BATCH, FEATURES)
    assert twin.head(twin.encoder(x)).abs().max() == 0
    assert model.head(model.encoder(x)).abs().max() > 0
    assert len(fxamp.backend_of(twin).compiled_graphs) == 2  # its encoder and head
    assert fxamp.backend_of(twin) is not fxamp.backend_of(model)
