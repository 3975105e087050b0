"""Gradient parity of an fxamp-compiled model with fp32 eager and torch.compile + autocast.

Tolerances (stated once, used by test_hops, test_graph_breaks, test_checkpointing,
test_eager_regions, test_copies): the relative error of the flat gradient and of the loss
against fp32 eager on the same weights and batch,
- O0: at most 1e-5 (fp32 throughout; only the summation order may differ);
- O1: at most 2x torch.compile + torch.autocast's own error, plus 1e-3 (the same op table:
  the rounding is the same up to where casts sit);
- O2/O3: at most 5e-2 (weights and activations stored in bf16, 2**-9 relative rounding
  each, a few layers deep; a lost or doubled gradient is off by 100 %).
A gradient that is None anywhere fails outright (the failure this guards against). fxamp's
model is called twice and the second call compared (recompiles and guards show there).
"""

from __future__ import annotations

import copy

import torch

import fxamp

LOW = torch.bfloat16  # CPU: the device default


def _loss(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().pow(2).mean()


def grads(model: torch.nn.Module, *inputs) -> tuple[float, torch.Tensor]:
    """Run one forward/backward; (loss, every parameter's gradient flattened in fp32)."""
    model.zero_grad(set_to_none=True)
    loss = _loss(model(*inputs))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing}"
    flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
    return loss.item(), flat


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def autocast_grads(model: torch.nn.Module, *inputs):
    compiled = torch.compile(model, backend="aot_eager")
    with torch.autocast("cpu", dtype=LOW):
        return grads(compiled, *inputs)


def check(make_model, inputs, opt_level: str, *, compiled=None) -> dict:
    """fxamp at `opt_level` vs fp32 eager (and vs autocast at O1); returns the errors."""
    base = make_model()
    ref_loss, ref = grads(copy.deepcopy(base), *inputs)
    model = compiled(copy.deepcopy(base)) if compiled else fxamp.compile(
        copy.deepcopy(base), opt_level=opt_level, compiler="aot_eager")
    grads(model, *inputs)  # the second call is compared: recompiles and guards show there
    loss, got = grads(model, *inputs)
    errors = {"grad": rel(got, ref), "loss": rel(loss, ref_loss)}
    if opt_level == "O0":
        bound = {"grad": 1e-5, "loss": 1e-5}
    elif opt_level == "O1":
        ac_loss, ac = autocast_grads(copy.deepcopy(base), *inputs)
        bound = {"grad": 2 * rel(ac, ref) + 1e-3, "loss": 2 * rel(ac_loss, ref_loss) + 1e-3}
    else:
        bound = {"grad": 5e-2, "loss": 5e-2}
    for what in errors:
        assert errors[what] <= bound[what], f"{opt_level} {what}: {errors} > {bound}"
    return errors
