"""How one node's policy is chosen: overrides, a user's NodePolicy, the preset table, and
per-op rules.

`choose_policy` answers "which CastPolicy applies to this node, and why" from data only (the
config and the node's own metadata); `castable_args` answers "which of its tensor arguments may
a cast touch" for the few ops where the answer is not "all of them" (a table cannot say that
batch_norm's running statistics are mutated in place and must never be replaced by a copy).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Optional

import torch

from fxamp._compat import OpOverload
from fxamp.config import AmpConfig
from fxamp.errors import ConfigError, FxampError
from fxamp.policy.names import names_of
from fxamp.policy.tables import ONE_DTYPE_OPS, preset_table
from fxamp.policy.vocabulary import OVERRIDE_CHOICES, CastPolicy, NodePolicy
from fxamp.provenance import module_chain, module_of

__all__ = ["choose_policy", "match_module_override", "register_rule", "castable_args",
           "is_compute_op", "check_module_overrides", "USER_CAST_OPS", "ONE_DTYPE_OPS",
           "BATCH_NORM_OPS"]

aten = torch.ops.aten

# Casts the user wrote; a policy never second-guesses them.
USER_CAST_OPS = frozenset(op for op in (
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default,
    aten.type_as.default,
) if isinstance(op, OpOverload))

BATCH_NORM_OPS = frozenset((aten.batch_norm.default, aten.instance_norm.default))

_RULES: dict[OpOverload, Callable[[CastPolicy, int], tuple[int, ...]]] = {}


def register_rule(*ops: OpOverload):
    """Register `fn(policy, n_args) -> positions of args a cast may touch` for `ops`."""

    def wrap(fn):
        for op in ops:
            _RULES[op] = fn
        return fn

    return wrap


@register_rule(*BATCH_NORM_OPS)
def _batch_norm_args(policy: CastPolicy, n_args: int) -> tuple[int, ...]:
    # Note [batch_norm keeps its statistics]: running_mean/var (args 3, 4) are updated in place
    # inside the op, so they can never be swapped for a cast copy. ATen's mixed-type batch norm
    # takes a low-precision input with fp32 weight/bias/stats, so lowering casts the input only;
    # running in fp32 casts input, weight and bias, and validate() checks the stats are fp32.
    return (0,) if policy is CastPolicy.LOWER else (0, 1, 2)


def castable_args(op: object, policy: CastPolicy, n_args: int) -> Optional[tuple[int, ...]]:
    """Positions of top-level args a cast may touch, or None for all of them."""
    rule = _RULES.get(op)  # type: ignore[arg-type]
    return rule(policy, n_args) if rule else None


def is_compute_op(op: object) -> bool:
    """Ops a module-wide override applies to: not views, not in-place, not the user's casts."""
    if not isinstance(op, OpOverload) or op in USER_CAST_OPS:
        return False
    return not op.is_view and not op._schema.is_mutable


def match_module_override(path: str, type_name: str,
                          config: AmpConfig) -> Optional[tuple[str, str]]:
    """The first (pattern, choice) of `config.module_overrides` naming this module's class or
    matching its path (an fnmatch glob such as "blocks.*.ln_1"), or None."""
    for pattern, choice in config.module_overrides:
        if pattern == type_name or fnmatch.fnmatchcase(path, pattern):
            return pattern, choice
    return None


def _module_override(node: torch.fx.Node, config: AmpConfig) -> Optional[tuple[str, str]]:
    for path, type_name in module_chain(node.meta.get("nn_module_stack")):  # innermost first
        found = match_module_override(path, type_name, config)
        if found:
            return f"module override {found[0]!r} on {path or '<root>'}", found[1]
    return None


def _op_override(op: OpOverload, config: AmpConfig) -> Optional[tuple[str, str]]:
    names = names_of(op)
    for key, choice in config.op_overrides:
        if key in names:
            return f"op override {key!r}", choice
    return None


def check_module_overrides(model: torch.nn.Module, config: AmpConfig) -> None:
    """Every module_overrides key must name a class or match a path of `model`'s modules (a
    typo would otherwise leave the module it meant in the low dtype, silently)."""
    modules = list(model.named_modules())
    for pattern, _ in config.module_overrides:
        if any(pattern == type(m).__name__ or fnmatch.fnmatchcase(path, pattern)
               for path, m in modules):
            continue
        classes = sorted({type(m).__name__ for _, m in modules})
        paths = [path for path, _ in modules if path]
        raise ConfigError(
            f"module_overrides key {pattern!r} names no module of {type(model).__name__}: keys "
            f"are module class names ({_some(classes)}) or named_modules() paths, globs allowed "
            f"({_some(paths)}, 'blocks.*.ln_1')")


def _some(names: list[str], n: int = 6) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def choose_policy(node: torch.fx.Node, config: AmpConfig) -> tuple[CastPolicy, str]:
    """The policy for one call_function node and the reason, by the documented precedence
    (with the PrecisionPlan's reason for the node's module, when a plan made the config)."""
    policy, reason = _choose_policy(node, config)
    if config.plan_reasons and is_compute_op(node.target):
        planned = config.graph.plan_reason(module_of(node.meta.get("nn_module_stack"))[0])
        reason = reason if planned is None else f"{reason}; plan: {planned}"
    return policy, reason


def _choose_policy(node: torch.fx.Node, config: AmpConfig) -> tuple[CastPolicy, str]:
    op = node.target
    if not isinstance(op, OpOverload) or op in USER_CAST_OPS:
        return CastPolicy.KEEP, "not a castable op"
    found = _module_override(node, config) if is_compute_op(op) else None
    found = found or _op_override(op, config)
    if found:
        return CastPolicy(found[1]), found[0]
    if op in BATCH_NORM_OPS and config.opt_level in ("O2", "O3"):
        if config.keep_batchnorm_fp32:
            return CastPolicy.FP32, "keep_batchnorm_fp32"
        return CastPolicy.LOWER, f"{config.opt_level} batch_norm in the model dtype"
    if not config.patch_torch_functions:
        return CastPolicy.KEEP, f"{config.opt_level} casts no ops: runs in its inputs' dtype"
    if config.custom_policy is not None:
        found = _node_policy(node, config.custom_policy)
        if found:
            return found
    policy = preset_table(config.policy).get(op)
    if policy is not None:
        return policy, f"{config.policy} table"
    return CastPolicy.KEEP, "not in the table: runs in its inputs' dtype"


def _node_policy(node: torch.fx.Node, rules: NodePolicy) -> Optional[tuple[CastPolicy, str]]:
    answer = rules.policy_for(node)
    if answer is None:
        return None
    if answer not in OVERRIDE_CHOICES:  # CastPolicy is a str enum: "fp32" matches FP32 too
        choices = ", ".join(repr(c.value) for c in OVERRIDE_CHOICES)
        raise FxampError(f"{type(rules).__name__}.policy_for({node.format_node()}) returned "
                         f"{answer!r}; it must return one of {choices} or None")
    return CastPolicy(answer), f"{type(rules).__name__}.policy_for"
