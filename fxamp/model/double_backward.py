"""Higher-order gradients through fxamp's graphs: the "eager" compiler, and the refusal of a
`create_graph=True` backward through a graph AOTAutograd compiled.

Note [Double backward runs the cast graph eagerly]: AOTAutograd traces one backward graph per
forward graph, and that backward is not differentiable again ("torch.compile with aot_autograd
does not currently support double backward"). fxamp's passes run before autograd exists: their
output, the pre-dispatch ATen graph with the casts (docs/architecture.md), is an ordinary
differentiable program. `compiler="eager"` runs that graph op by op under eager autograd, as
`torch.compile(backend="eager")` runs Dynamo's graph, so `torch.autograd.grad(...,
create_graph=True)` (gradient penalties, MAML, input-gradient regularisers, through activation
checkpointing too) differentiates the same casts a second time. The cost is that nothing is
fused: the graph runs at eager speed.

Whether gradients will be differentiated again cannot be known when a graph is compiled (the
forward runs before anyone calls `grad`), so fxamp does not guess: the user asks for it with
`compiler="eager"`. Every graph another compiler made refuses, at the backward that asks for
it (`create_graph=True`), with a ConfigError naming that fix; torch's own error would come only
at the second backward. A backward that asks for `create_graph=True` only to read first-order
gradients is refused too: it runs under `compiler="eager"`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from fxamp.errors import ConfigError

__all__ = ["eager_autograd", "first_order_only", "DOUBLE_BACKWARD_FIX"]

DOUBLE_BACKWARD_FIX = (
    "a backward with create_graph=True (torch.autograd.grad(..., create_graph=True), "
    "backward(create_graph=True)) reached a graph fxamp compiled with compiler={compiler}, "
    "whose AOTAutograd backward cannot be differentiated again; compile the model with "
    "fxamp.compile(..., compiler='eager') (fxamp.backend(..., compiler='eager')), which runs "
    "fxamp's cast graph under eager autograd, so higher-order gradients work "
    "(Note [Double backward runs the cast graph eagerly])")


def eager_autograd(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The "eager" compiler: fxamp's cast graph itself, run op by op under eager autograd."""
    return gm


def first_order_only(compiled: Callable[..., Any], compiler: str) -> Callable[..., Any]:
    """`compiled` whose outputs refuse a `create_graph=True` backward with a ConfigError (Dynamo's
    calling convention kept). Costs one hook per output's autograd node per call with grad."""
    message = DOUBLE_BACKWARD_FIX.format(compiler=compiler)

    def refuse(grad_outputs: tuple) -> None:
        if torch.is_grad_enabled():  # the engine runs a backward with grad mode = create_graph
            raise ConfigError(message)

    def call(*args: Any) -> Any:
        outputs = compiled(*args)
        seen = set()
        for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            node = getattr(out, "grad_fn", None)
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                node.register_prehook(refuse)
        return outputs

    call._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return call
