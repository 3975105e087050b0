"""Higher-order ops fxamp keeps as nodes: custom autograd.Function, checkpointing, tensor hooks.

Note [Higher-order ops keep their bodies]: Dynamo turns a custom `torch.autograd.Function`
into `autograd_function_apply(fwd_body, bwd_body, *args)`, `torch.utils.checkpoint` into
`tag_activation_checkpoint(body, *args)` and `Tensor.register_hook` in forward into
`register_hook(t, hook_body)`. Traced to ATen inline they lose what makes them what they are:
the Function's forward runs under no_grad and its backward is gone (every parameter before it
silently got no gradient), the recomputation is gone, the hook is gone. So fxamp keeps each one
as a node. The bodies that run forward code are re-traced to ATen and annotated under the same
policy as the graph around them (autocast applies inside a Function's forward and inside a
checkpointed region too); backward bodies and hooks run as the user wrote them (autocast does
not apply to backward either). AOTAutograd then runs the higher-order ops as it does for
`torch.compile`, so the user's backward, the recomputation and the hooks are in the joint graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch.fx as fx

from fxamp._compat import HigherOrderOperator

__all__ = ["HopSpec", "hop_spec", "body_inputs", "policy_bodies"]


@dataclasses.dataclass(frozen=True)
class HopSpec:
    """How fxamp treats one higher-order op.

    Attributes:
        policy_bodies: positions of the body arguments that run forward code (annotated under
            the policy); the other bodies (a backward, a hook) run as traced.
        output: (outputs of the first policy body or None, the node's args) -> the node's value.
    """

    policy_bodies: tuple[int, ...]
    output: Callable[[Any, tuple[Any, ...]], Any]


# Keyed by the op's registered name, which is the same object identity across torch versions
# that spell the Python class differently.
HOPS: dict[str, HopSpec] = {
    # fwd_body returns (outputs, saved values); the op returns the outputs.
    "autograd_function_apply": HopSpec((0,), lambda outs, args: outs[0]),
    "tag_activation_checkpoint": HopSpec((0,), lambda outs, args: outs),
    # register_hook(t, hook_body, *freevars) returns t itself, now with the hook.
    "register_hook": HopSpec((), lambda outs, args: args[0]),
}


def hop_spec(target: Any) -> Optional[HopSpec]:
    """The spec of a higher-order op fxamp keeps as a node, or None."""
    return HOPS.get(target.name()) if isinstance(target, HigherOrderOperator) else None


def body_inputs(args: tuple[Any, ...]) -> list[Any]:
    """What a policy body is called with: the op's arguments after its bodies."""
    return [a for a in args if not isinstance(a, fx.GraphModule)]


def policy_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """Every body in `gm` (recursively) that fxamp annotated under the policy."""
    found = []
    for node in gm.graph.nodes:
        spec = hop_spec(node.target) if node.op == "call_function" else None
        for i in spec.policy_bodies if spec else ():
            body = gm.get_submodule(node.args[i].target)
            found += [body, *policy_bodies(body)]
    return found
