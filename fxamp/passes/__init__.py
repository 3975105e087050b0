"""The one pipeline that orders fxamp's graph passes: annotate -> validate -> insert casts."""

from __future__ import annotations

import dataclasses
import logging

import torch.fx as fx

from fxamp.config import AmpConfig
from fxamp.passes.annotate import FXAMP_META, OpDecision, annotate
from fxamp.passes.float8 import decide_gemms, rewrite_gemms
from fxamp.passes.hops import policy_bodies
from fxamp.passes.insert_casts import insert_casts, is_fxamp_cast
from fxamp.passes.printing import format_graph
from fxamp.passes.validate import validate

__all__ = ["run_passes", "PassStats", "FXAMP_META", "OpDecision"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PassStats:
    """What the passes did to one graph (also shown by explain())."""

    ops_annotated: int
    ops_checked: int
    casts_inserted: int
    dead_casts_removed: int
    float8_gemms: int = 0


def remove_dead_casts(gm: fx.GraphModule) -> int:
    """Drop casts fxamp inserted that nothing uses (restores that the next fp32 op skipped)."""
    removed = 0
    for node in reversed(list(gm.graph.nodes)):
        if is_fxamp_cast(node) and not node.users:
            gm.graph.erase_node(node)
            removed += 1
    return removed


class _LazyGraph:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm

    def __str__(self) -> str:
        return format_graph(self.gm)


def _float8(gm: fx.GraphModule, bodies: list[fx.GraphModule], config: AmpConfig,
            history, grad_enabled: bool) -> int:
    # GEMMs inside higher-order op bodies are recorded (explain() names them) but not
    # rewritten: a custom Function's forward runs without autograd, so its backward GEMMs
    # would never reach float8.
    if config.float8 is None:
        return 0
    for body in bodies:
        decide_gemms(body, config, rewritable=False)
    decide_gemms(gm, config)
    return rewrite_gemms(gm, config, history, grad_enabled=grad_enabled)


def run_passes(gm: fx.GraphModule, config: AmpConfig, fake_mode, *,
               float8_history=None, grad_enabled: bool = True) -> PassStats:
    """Run the fxamp passes in place on a pre-dispatch ATen graph with fake `meta['val']`.

    `float8_history`: the model's Float8History, for float8 delayed scaling.
    `grad_enabled`: the grad mode `gm` was traced in (Dynamo guards on it).
    """
    assert config.is_resolved, "run_passes needs a config resolved for a device"
    annotated = annotate(gm, config, fake_mode)  # forward bodies of higher-order ops too
    graphs = [gm, *policy_bodies(gm)]
    checked = sum(validate(g, config) for g in graphs)
    inserted = sum(insert_casts(g) for g in graphs)
    removed = sum(remove_dead_casts(g) for g in graphs)
    float8 = _float8(gm, graphs[1:], config, float8_history, grad_enabled)
    for g in graphs:
        g.graph.lint()
        g.recompile()
    stats = PassStats(annotated, checked, inserted - removed, removed, float8)
    log.debug("fxamp %s (%s): %s\n%s", config.opt_level, config.policy, stats, _LazyGraph(gm))
    return stats
