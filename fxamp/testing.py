"""Helpers for tests of the passes and for users checking graphs: fxamp's passes on a traced
function without Dynamo or a compiler, and the readable graph format.

This module imports the package and is imported by tests only; fxamp itself never imports it.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxamp._compat import FakeTensorMode, make_fx
from fxamp.passes import run_passes
from fxamp.passes.capture import MixedOperandsMode
from fxamp.passes.printing import format_graph, node_dtypes

__all__ = ["format_graph", "node_dtypes", "transform"]


def transform(fn, *example_inputs, config) -> fx.GraphModule:
    """Trace `fn` to the pre-dispatch ATen graph on fake tensors and run fxamp's passes on it.

    The same capture and pipeline the backend uses, without Dynamo or a compiler: for tests
    of the passes on tiny graphs (milliseconds) and for checking single ops. `config` must be
    resolved (`AmpConfig.from_opt_level(...).resolve("cpu")`).
    """
    @functools.wraps(fn)  # make_fx names the placeholders after fn's parameters
    def traced(*args):
        with MixedOperandsMode():  # per call, as the backend's capture (capture.py)
            return fn(*args)

    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        gm = make_fx(traced, pre_dispatch=True)(*fakes)
    run_passes(gm, config, fake_mode)
    return gm
