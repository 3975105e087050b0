"""fxamp trains what torch.compile + torch.autocast trains, as close to fp32 (harness.py)."""

import pytest
import torch

from . import corpus, harness


@pytest.fixture(scope="module")
def baselines():
    # The fp32 reference and autocast's run depend on the pattern and dtype, not on the level.
    return {}


def _baseline(baselines, pattern, dtype):
    key = (pattern.name, dtype)
    if key not in baselines:
        torch._dynamo.reset()
        ref = harness.reference(pattern, dtype)
        baselines[key] = ref, harness.peer(pattern, dtype)
    return baselines[key]


@pytest.mark.parametrize("name,level,dtype_name,compiler", corpus.cases())
def test_conformance(baselines, name, level, dtype_name, compiler):
    pattern, dtype = corpus.BY_NAME[name], corpus.DTYPES[dtype_name]
    ref, peer = _baseline(baselines, pattern, dtype)
    torch._dynamo.reset()
    run = harness.subject(pattern, level, dtype, compiler)
    harness.compare(run, peer, ref, level, dtype)
    if pattern.check:
        pattern.check(run, ref, level)
