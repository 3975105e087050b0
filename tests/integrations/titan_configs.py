"""torchtitan 0.3 config_registry functions for tests/integrations/test_torchtitan.py, written as
docs/integrations.md writes them (`--module titan_configs --config NAME`), with the debugging
compiler, and an `@override` the tests activate with `--override.imports
titan_configs.sdpa_on_cpu`."""

from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from fxamp.integrations.torchtitan import FxampConverter


@override(target=FlexAttention.Config, description="SDPA: flex attention has no CPU backward")
def sdpa_on_cpu(config: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    # The tests' one change to torchtitan's model: its language models use flex attention,
    # which has no backward on a CPU; with per-row positions 0..L-1 (one document a row) its
    # block-causal mask is SDPA's causal one.
    return ScaledDotProductAttention.Config()


def _fxamp(**options):
    config = llama3_debugmodel()
    config.model_spec = model_registry(
        "debugmodel", converters=[FxampConverter.Config(compiler="aot_eager", **options)])
    return config


def llama3_debugmodel_fxamp():
    return _fxamp()


def llama3_debugmodel_fxamp_float8():
    return _fxamp(float8="tensorwise")


def llama3_debugmodel_fxamp_o2():
    return _fxamp(opt_level="O2")
