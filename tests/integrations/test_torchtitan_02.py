"""fxamp as a torchtitan 0.2 model converter, on torchtitan's llama3 debug model (CPU); 0.3 is
tests/integrations/test_torchtitan.py.

torchtitan 0.2 imports triton, torchdata, datasets and tensorboard at import time; where any
is missing the module is skipped. What runs here is what torchtitan's Trainer does before its
training loop (job config parsed by torchtitan's ConfigManager, the model built on the meta
device, converted, parallelised, materialised, initialised; torchtitan's optimizers and loss),
then the loop's forward / backward / step by hand: the Trainer itself needs a tokenizer and a
dataset from torchtitan's repository, and a CUDA device for its memory monitor.
"""

import copy

import pytest
import torch

pytest.importorskip("torchtitan.train")
pytest.importorskip("torchtitan.protocols.model_converter", reason="torchtitan 0.2")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.protocols import train_spec as train_spec_module  # noqa: E402
from torchtitan.protocols.model_converter import build_model_converters  # noqa: E402

import fxamp  # noqa: E402
import fxamp.integrations.torchtitan  # noqa: E402,F401  (registers the converter "fxamp")
from fxamp.errors import ConfigError  # noqa: E402
from fxamp.model.prepare import backend_of  # noqa: E402

FXAMP = ["--job.custom_config_module", "fxamp.integrations.torchtitan",
         "--model.converters", "fxamp", "--fxamp.compiler", "aot_eager"]
BASE = ["--model.flavor", "debugmodel", "--optimizer.lr", "1e-3"]
DIMS = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)


def _build(argv):
    """What torchtitan's Trainer.__init__ does to get a model and its optimizers (train.py),
    the debug model cut to 2 layers for time."""
    job = ConfigManager().parse_args(BASE + argv)
    spec = train_spec_module.get_train_spec(job.model.name)
    args = copy.deepcopy(spec.model_args[job.model.flavor])
    args.update_from_config(job)
    args.n_layers = 2
    dims = ParallelDims(**DIMS)
    with torch.device("meta"):
        model = spec.model_cls(args)
    build_model_converters(job, dims).convert(model)
    model = spec.parallelize_fn(model, dims, job)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, spec.build_optimizers_fn([model], job.optimizer, dims), spec.build_loss_fn(job)


def _losses(argv, steps=3):
    model, opts, loss_fn = _build(argv)
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x, y = (torch.randint(0, 2048, (2, 32), generator=g) for _ in range(2))
        loss = loss_fn(model(x), y)
        loss.backward()
        opts.step()
        opts.zero_grad()
        out.append(float(loss))
    return model, out


NO_CHECKPOINTING = ["--activation_checkpoint.mode", "none"]
FLOAT8 = ["--fxamp.float8", "tensorwise"] + NO_CHECKPOINTING


@pytest.mark.parametrize("extra, rel", [([], 2e-3), (FLOAT8, 3e-2)])
def test_converter_trains_the_debug_model_like_fp32(extra, rel):
    _, ref = _losses([])
    model, got = _losses(FXAMP + ["--fxamp.opt_level", "O1"] + extra)
    config = fxamp.config_of(model)
    assert (config.opt_level, config.dtype, config.device_type) == ("O1", torch.bfloat16, "cpu")
    assert (config.float8 is not None) == bool(extra)
    float8_gemms = sum(g.stats.float8_gemms for g in backend_of(model).compiled_graphs)
    assert (float8_gemms > 0) == bool(extra)  # float8 ran where it was asked for
    assert got != ref and got == pytest.approx(ref, rel=rel)  # bf16 ran, close to fp32


@pytest.mark.parametrize("argv, match", [
    (["--fxamp.opt_level", "O2"], "keep no fp32 master"),
    (["--fxamp.dtype", "float16"], "use bfloat16"),
    (["--compile.enable"], "fxamp compiles the model itself"),
    (["--fxamp.float8", "tensorwise"], r"fxamp.float8=.tensorwise. with activation "
                                       r"checkpointing \(selective\): fxamp.s float8 pass does "
                                       "not rewrite the GEMMs inside checkpointed bodies"),
])
def test_refusals_before_the_model_is_touched(argv, match):
    job = ConfigManager().parse_args(BASE + FXAMP + argv)
    with pytest.raises(ConfigError, match=match):
        build_model_converters(job, ParallelDims(**DIMS))


def test_without_the_config_module_the_section_is_missing():
    job = ConfigManager().parse_args(BASE + ["--model.converters", "fxamp"])
    with pytest.raises(ConfigError, match="custom_config_module fxamp.integrations.torchtitan"):
        build_model_converters(job, ParallelDims(**DIMS))


def _doc_blocks(lang):
    import doc_snippets

    text = open(f"{doc_snippets.ROOT}/docs/integrations.md").read()
    return [b.body for b in doc_snippets.blocks(text) if b.lang == lang and "fxamp" in b.body]


def test_the_docs_command_line_and_toml_enable_fxamp(tmp_path):
    (command,) = _doc_blocks("bash")
    flags = command.replace("\\\n", " ").split("-m torchtitan.train", 1)[1].split()
    flags = flags[flags.index("--job.config_file") + 2:]  # the TOML is checked below
    (toml,) = _doc_blocks("toml")
    (tmp_path / "job.toml").write_text(toml)
    for argv in (flags, ["--job.config_file", str(tmp_path / "job.toml")]):
        job = ConfigManager().parse_args(argv)
        (converter,) = build_model_converters(job, ParallelDims(**DIMS)).converters
        assert (converter.config.opt_level, converter.config.dtype) == ("O1", torch.bfloat16)
        assert converter.config.float8.recipe == "tensorwise"
