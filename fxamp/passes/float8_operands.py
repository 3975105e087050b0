"""What a matmul-family node multiplies, in the form the float8 rewrite takes it.

`gemm_operands(gm, node)` reads a GEMM node of the pre-dispatch ATen graph: its left [.., K]
and right [K, N] (or batched [.., K, N]) operands, bias, and which of the three float8 forms
it has (Note [Batched float8 GEMMs] in docs/design.md):
- a 2-D GEMM (linear, mm, addmm, matmul with a 2-D right operand), the left one flattened;
- a flattened batched GEMM: a bmm/matmul whose right operand has one batch entry (an
  `expand` of a weight, found through the casts between them, or [1, K, N]);
- a batched GEMM, one GEMM per batch entry.

Note [Attention-style batched GEMMs stay by default]: a batched GEMM neither of whose operands
is (a view or cast of) a parameter is attention's q @ k^T or attn @ v. It stays in the model
dtype unless `Float8Config(batched_activations=True)`: per (batch, head) the GEMMs are small
(K or N is head_dim), so float8 gains little, the scores feed a softmax whose exponent
amplifies the rounding, and the references keep attention out of their float8 GEMMs too
(torchao converts nn.Linear only; TransformerEngine has a separate fp8 attention kernel). A
batched GEMM with a parameter operand (a grouped expert weight [E, K, N]) runs in float8.
"Parameter" means a graph input that requires grad (`TRAINABLE`, tagged at capture) or a
`get_attr` of one: a frozen weight counts as an activation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.fx as fx

from fxamp.passes.capture import TRAINABLE

__all__ = ["GEMM_OPS", "GemmOperands", "gemm_operands"]

aten = torch.ops.aten

# The matmul-family ops pre-dispatch tracing leaves (nn.Linear and F.linear are aten.linear;
# `@` on 2-D operands is aten.mm, on others aten.matmul).
GEMM_OPS: dict[Any, str] = {aten.linear.default: "linear", aten.mm.default: "mm",
                            aten.matmul.default: "matmul", aten.addmm.default: "addmm",
                            aten.bmm.default: "bmm", aten.baddbmm.default: "baddbmm"}
# Ops that pass a tensor on unchanged but for dtype, layout or view: followed back from an
# operand to find a parameter or a broadcast.
_CASTS = frozenset({aten._to_copy.default, aten.to.dtype, aten.clone.default,
                    aten.alias.default, aten.detach.default})
_VIEWS = _CASTS | frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.transpose.int, aten.t.default, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.select.int, aten.slice.Tensor})


@dataclasses.dataclass(frozen=True)
class GemmOperands:
    """The operands of one GEMM node (fake values `a`, `b`; nodes `left`, `right`, `bias`).

    `batch`: batch entries of a GEMM done one by one (0: one 2-D GEMM, flattened or not).
    `flattened`: a batched GEMM done as one 2-D GEMM; `right` is then the node the rewrite
    multiplies by: the source of the broadcast, not the `expand`. `activations`: a batched GEMM with no parameter operand.
    `refusal`: why this node cannot be a float8 GEMM at all (then the rest may be None).
    """

    a: Any = None
    b: Any = None
    left: Optional[fx.Node] = None
    right: Optional[fx.Node] = None
    bias: Optional[fx.Node] = None
    batch: int = 0
    activations: bool = False
    flattened: bool = False
    alpha: Any = 1
    beta: Any = 1
    refusal: Optional[str] = None

    @property
    def mkn(self) -> tuple:
        """M x K x N of one GEMM (M of the flattened left operand when not batched)."""
        rows = self.a.shape[-2] if self.batch else math.prod(self.a.shape[:-1])
        return rows, self.a.shape[-1], self.b.shape[-1]


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _dims(val: Any) -> str:
    return f"{val.dim()}-D" if isinstance(val, torch.Tensor) else "non-tensor"


def _through(node: Any, ops: frozenset) -> Any:
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in ops:
        node = node.args[0]
    return node


def _is_parameter(gm: fx.GraphModule, node: Any) -> bool:
    """`node` is a view or cast of a parameter (Note [Attention-style
    batched GEMMs stay by default])."""
    node = _through(node, _VIEWS)
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder":
        return bool(node.meta.get(TRAINABLE))
    if node.op == "get_attr":
        value = gm
        for atom in node.target.split("."):
            value = getattr(value, atom, None)
        return isinstance(value, torch.Tensor) and value.requires_grad
    return False


def _broadcast_source(right: fx.Node) -> Optional[fx.Node]:
    # bmm(x, w.expand(B, K, N)), possibly cast after the expand: the 2-D GEMM is x @ w
    expand = _through(right, _CASTS)
    if not (isinstance(expand, fx.Node) and expand.target == aten.expand.default):
        return None
    source = expand.args[0]
    val = _val(source)
    if isinstance(val, torch.Tensor) and val.dim() >= 2 and math.prod(val.shape[:-2]) == 1:
        return source
    return None


def _two_d(node: fx.Node, op: str) -> GemmOperands:
    scalars = {k: node.kwargs.get(k, 1) for k in ("alpha", "beta")} if op == "addmm" else {}
    if op == "linear":
        x, w, *rest = node.args
        a, b = _val(x), _val(w)
        b = b.t() if isinstance(b, torch.Tensor) and b.dim() == 2 else b
        bias = rest[0] if rest else node.kwargs.get("bias")
        left, right = x, w
    else:
        left, right = (node.args[1], node.args[2]) if op == "addmm" else node.args[:2]
        bias = node.args[0] if op == "addmm" else None
        a, b = _val(left), _val(right)
    if a is None or b is None or a.dim() < 2 or b.dim() != 2:
        return GemmOperands(refusal=f"{op} of a {_dims(a)} and a {_dims(b)} operand (float8 "
                                    "needs [..., K] @ [K, N])")
    return GemmOperands(a, b, left, right, bias, **scalars)


def _batched(gm: fx.GraphModule, node: fx.Node, op: str) -> GemmOperands:
    left, right = (node.args[1], node.args[2]) if op == "baddbmm" else node.args[:2]
    bias = node.args[0] if op == "baddbmm" else None
    scalars = {k: node.kwargs.get(k, 1) for k in ("alpha", "beta")}
    a, b = _val(left), _val(right)
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in (a, b)):
        return GemmOperands(refusal=f"{op} of a {_dims(a)} and a {_dims(b)} operand")
    if not all(isinstance(d, int) for d in (*a.shape[:-2], *b.shape[:-2])):
        # decided before any comparison, so that deciding adds no guard on it
        return GemmOperands(refusal=f"{op} with a dynamic batch size")
    source = _broadcast_source(right)
    if (source is not None or math.prod(b.shape[:-2]) == 1) and a.dim() >= b.dim():
        return GemmOperands(a, b, left, source or right, bias, flattened=True, **scalars)
    if a.shape[:-2] != b.shape[:-2]:
        return GemmOperands(refusal=f"{op} with broadcast batch dims "
                                    f"{list(a.shape[:-2])} and {list(b.shape[:-2])}")
    activations = not (_is_parameter(gm, left) or _is_parameter(gm, right))
    return GemmOperands(a, b, left, right, bias, math.prod(a.shape[:-2]), activations,
                        **scalars)


def gemm_operands(gm: fx.GraphModule, node: fx.Node) -> GemmOperands:
    """The operands of GEMM node `node` of `gm` (a GEMM_OPS target)."""
    op = GEMM_OPS[node.target]
    right = _val(node.args[1])
    if op in ("bmm", "baddbmm") or (op == "matmul" and isinstance(right, torch.Tensor)
                                    and right.dim() > 2):
        return _batched(gm, node, op)
    return _two_d(node, op)
