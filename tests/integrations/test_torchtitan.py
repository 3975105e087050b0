"""fxamp in torchtitan 0.3 (a model-config converter), on torchtitan's llama3 debug model on a
CPU, over a one-rank gloo process group.

What runs is what torchtitan 0.3's `Trainer.__init__` does before its loop: the job config
from a config_registry function through torchtitan's `ConfigManager` (`--module` / `--config`
and command-line flags; tests/integrations/titan_configs.py and docs/integrations.md's own
function), the model config checked against the job (`update_from_config`), the job's
`@override`s applied, the model built on the meta device, `parallelize_fn` (selective
activation checkpointing, FSDP with torchtitan's MixedPrecisionPolicy), materialised and
initialised, torchtitan's optimizers and its chunked loss (which calls the model's lm_head
itself); then the loop's forward / backward / step as `Trainer._forward_backward_body` runs
it. The Trainer itself does not start without a GPU (it sets a CUDA device), and two of
torchtitan's choices are made for a CPU here: its device for meshes, which falls back to
"cuda" when no accelerator is present, and the attention, flex (no backward on a CPU)
swapped for SDPA by an `@override` (the same causal mask for one document a row).
"""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan.trainer")
from torchtitan.protocols import model as _titan_model  # noqa: E402

if not hasattr(_titan_model, "ModelConfigConverter"):
    pytest.skip("torchtitan 0.3 (tests/integrations/test_torchtitan_02.py tests 0.2)",
                allow_module_level=True)

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper  # noqa: E402
from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager, apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.tools import utils as titan_utils  # noqa: E402

import fxamp  # noqa: E402
from fxamp.errors import ConfigError  # noqa: E402
from fxamp.integrations.torchtitan import FxampConverter  # noqa: E402
from fxamp.model.prepare import backend_of  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # titan_configs, as --module finds it
CPU = ["--override.imports", "titan_configs.sdpa_on_cpu"]
TITAN = ["--module", "llama3", "--config", "llama3_debugmodel"]
FXAMP = ["--module", "titan_configs", "--config", "llama3_debugmodel_fxamp"]
FP32 = ["--training.mixed_precision_param", "float32"]  # FSDP keeps fp32 parameters


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(titan_parallel_dims, "device_type", "cpu")
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        yield tmp_path_factory.mktemp("dump")
        if started:
            dist.destroy_process_group()


def _config(argv):
    """The job config as torchtitan's Trainer gets it, its model cut to one layer for time."""
    config = ConfigManager().parse_args(argv)
    config.model_spec.model.layers = config.model_spec.model.layers[:1]
    return config


def _build(argv, dump):
    """What Trainer.__init__ does to get a model, its optimizers and its loss (trainer.py)."""
    config = _config(argv)
    spec = config.model_spec
    spec.model.update_from_config(config=config)
    if config.override.imports:
        apply_overrides(config.override, config)
    with torch.device("meta"), titan_utils.set_default_dtype(
            TORCH_DTYPE_MAP[config.training.dtype]):
        model = spec.model.build()
    model.verify_module_protocol()
    dims = ParallelDims.from_config(config.parallelism, 1)
    model = spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder=str(dump))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the Trainer sets it up
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    return model, config.optimizer.build(model_parts=[model]), loss_fn


def _losses(argv, dump, steps=3):
    model, optimizers, loss_fn = _build(CPU + argv, dump)  # a subcommand comes last
    g, out = torch.Generator().manual_seed(1), []
    positions = torch.arange(32).expand(2, 32)
    for _ in range(steps):
        x, y = (torch.randint(0, 2048, (2, 32), generator=g) for _ in range(2))
        pred = model(x, positions=positions)
        loss, _ = loss_fn(pred, y, torch.tensor(float(y.numel())), positions=positions)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        out.append(loss.item())
    return model, out


@pytest.fixture(scope="module")
def references(one_rank):
    """Losses of torchtitan's own runs: fp32, and its mixed precision (FSDP's bf16 params)."""
    return _losses(TITAN + FP32, one_rank)[1], _losses(TITAN, one_rank)[1]


def _graphs_by_module(model):
    return {next(iter(n.meta["nn_module_stack"].values()))[0]: g.stats
            for g in backend_of(model).compiled_graphs
            for n in g.graph_module.graph.nodes if n.meta.get("nn_module_stack")}


def _casts_into_gemms(model, module):
    """Whether a cast feeds a GEMM of `module`'s graphs (its output's cast to fp32, Note [O1's
    outputs are fp32], feeds none)."""
    casts = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype}
    gemms = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
             torch.ops.aten.addmm.default}
    for g in backend_of(model).compiled_graphs:
        nodes = [n for n in g.graph_module.graph.nodes if n.target in gemms and next(
            iter(n.meta.get("nn_module_stack", {"": ("",)}).values()))[0] == module]
        if any(a.target in casts for n in nodes for a in n.all_input_nodes):
            return True
    return False


@pytest.mark.parametrize("argv", [FP32, []], ids=["fsdp-fp32-params", "fsdp-bf16-params"])
def test_fxamp_trains_like_torchtitans_own_mixed_precision(argv, references, one_rank):
    fp32, titan = references
    model, got = _losses(FXAMP + argv, one_rank)
    config = fxamp.config_of(model)
    assert (config.opt_level, config.dtype, config.device_type) == ("O1", torch.bfloat16, "cpu")
    assert type(model).__name__ == "FSDPLlama3Model"  # the model's own class, sharded
    # every part ran fxamp's graphs, the lm_head the chunked loss calls included (with fp32
    # parameters fxamp casts its GEMM to bf16; FSDP's bf16 parameters need no cast)
    stats = _graphs_by_module(model)
    assert {"tok_embeddings", "layers.0", "norm", "lm_head"} <= set(stats)
    assert _casts_into_gemms(model, "lm_head") == (argv == FP32)
    assert titan != fp32 and got != fp32  # bf16 ran in both
    assert got == pytest.approx(fp32, rel=2e-3) and titan == pytest.approx(fp32, rel=2e-3)
    assert got == pytest.approx(titan, rel=2e-3)


def test_fxamp_float8_trains_close_to_fp32(references, one_rank):
    fp32, _ = references
    argv = ["--module", "titan_configs", "--config", "llama3_debugmodel_fxamp_float8"]
    model, got = _losses(argv + FP32 + ["activation-checkpoint:none"], one_rank)
    assert fxamp.config_of(model).float8.recipe == "tensorwise"
    assert _graphs_by_module(model)["layers.0"].float8_gemms > 0
    assert got != fp32 and got == pytest.approx(fp32, rel=3e-2)


@pytest.mark.parametrize("argv, message", [
    (["--compile.enable"], "compile.enable with 'model' in compile.components: fxamp compiles "
                           "the model itself"),
    (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree=2: "
                                                    "fxamp is tested in torchtitan with data "
                                                    "parallelism (FSDP, HSDP) only"),
    (["--parallelism.context_parallel_degree", "2"], "parallelism.context_parallel_degree=2"),
    (["--config", "llama3_debugmodel_fxamp_float8"], "FxampConverter.Config.float8='tensorwise' "
                                                     "with activation checkpointing (SelectiveAC"
                                                     ".Config): fxamp's float8 pass does not "
                                                     "rewrite the GEMMs inside checkpointed "
                                                     "bodies"),
])
def test_jobs_fxamp_cannot_run_are_refused_before_the_model_is_built(argv, message):
    config = _config(FXAMP + argv)
    before = copy.deepcopy(config.model_spec.model.to_dict())
    with pytest.raises(ConfigError) as info:
        config.model_spec.model.update_from_config(config=config)
    assert message in str(info.value)
    assert config.model_spec.model.to_dict()["fxamp"] == before["fxamp"]


@pytest.mark.parametrize("options, message", [
    (dict(opt_level="O2"), "FxampConverter.Config.opt_level='O2': torchtitan steps the model "
                           "with torch.optim optimizers, which keep no fp32 master weights"),
    (dict(dtype="float16"), "FxampConverter.Config.dtype='float16': torchtitan scales no loss"),
    (dict(compiler="tvm"), "compiler='tvm'"),
])
def test_bad_options_are_refused_when_the_converter_is_built(options, message):
    with pytest.raises(ConfigError) as info:
        FxampConverter.Config(**options).build()
    assert message in str(info.value)


def test_a_config_function_with_a_bad_option_fails_to_load():
    with pytest.raises(ConfigError, match="opt_level='O2'"):
        ConfigManager().parse_args(["--module", "titan_configs", "--config",
                                    "llama3_debugmodel_fxamp_o2"])


def test_converting_twice_is_refused():
    converter = FxampConverter.Config().build()
    once = converter.convert(_config(TITAN).model_spec.model)
    assert type(once).__qualname__ == "FxampLlama3Model.Config"
    with pytest.raises(ConfigError, match="already converted by FxampConverter: list it once"):
        converter.convert(once)


def test_the_docs_config_function_loads_with_fxamp(tmp_path, monkeypatch):
    import doc_snippets

    text = open(f"{doc_snippets.ROOT}/docs/integrations.md").read()
    (code,) = [b.body for b in doc_snippets.blocks(text)
               if b.lang == "py" and "FxampConverter" in b.body]
    (tmp_path / "my_configs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ConfigManager().parse_args(["--module", "my_configs", "--config",
                                         "llama3_8b_fxamp"])
    model_config = config.model_spec.model
    options = model_config.fxamp
    assert (options.opt_level, options.dtype, options.float8) == ("O1", "bfloat16", "rowwise")
    assert model_config.to_dict()["fxamp"]["float8"] == "rowwise"  # torchtitan's logged config
    model_config.update_from_config(config=config)  # the job passes fxamp's checks
