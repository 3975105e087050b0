"""Batched float8 GEMMs (Note [Batched float8 GEMMs]): bmm, baddbmm and batched matmul, one
GEMM per batch entry with scales per entry, or one flattened GEMM when the right operand is a
broadcast weight; attention-style ones excluded by default (Note [Attention-style batched
GEMMs stay by default]); the recipes' numerics against a hand-written reference."""

import pytest
import torch

import fxamp
from float8_reference import dequant
from fxamp import _compat
from fxamp.float8 import RECIPES as SPECS, Float8Config
from fxamp.float8.gemm import Float8MM, float8_bmm, float8_matmul

ROWWISE_ON_CPU = _compat.scaled_mm_refusal("cpu", True, torch.bfloat16) is None
_NO_ROWWISE = pytest.mark.skipif(not ROWWISE_ON_CPU, reason="torch._scaled_mm has no "
                                 "row-scaled CPU kernel before 2.13")
RECIPES = ["tensorwise", pytest.param("rowwise", marks=_NO_ROWWISE),
           pytest.param("rowwise_with_gw_hp", marks=_NO_ROWWISE)]
SMALL = dict(min_dim=16)  # the tests' GEMMs are 16/32 wide


def reference_mm(a, b, g, recipe):
    """Output and gradients of a 2-D a @ b in the recipe (torchao's semantics), in float64:
    output = a8 @ b8; grad_a = g8 @ b^T8 (b^T tensorwise in rowwise_with_gw_hp);
    grad_b = (g^T8 @ a8)^T, or a^T @ g unrounded in rowwise_with_gw_hp."""
    r = SPECS[recipe]
    q = lambda x, dtype, dim, rowwise=r.rowwise: dequant(x, dtype, dim, rowwise, r.pow2_scales)
    out = q(a, r.input, -1) @ q(b, r.weight, 0)
    grad_a = q(g, r.grad_output, -1) @ q(b.t(), r.weight, 0,
                                          r.rowwise and not r.weight_tensorwise_for_grad_input)
    if r.grad_weight_hp:
        grad_b = a.double().t() @ g.double()
    else:
        grad_b = (q(g.t(), r.grad_output, -1) @ q(a, r.input, 0)).t()
    return out, grad_a, grad_b


def _close(actual, expected, what):
    # _scaled_mm accumulates in fp32 and rounds once to bf16; the reference is float64.
    err = (actual.double() - expected).abs().max().item()
    bound = 2 ** -7 * expected.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (one bf16 rounding)"


def _operands(batch=3, m=16, k=32, n=16, seed=0):
    torch.manual_seed(seed)
    # entries of very different magnitudes: one scale for the batch would show
    scales = torch.tensor([1.0, 1e-2, 30.0][:batch]).view(-1, 1, 1)
    a = (torch.randn(batch, m, k) * scales).to(torch.bfloat16).requires_grad_()
    b = (torch.randn(batch, k, n) * 0.1).to(torch.bfloat16).requires_grad_()
    return a, b


@pytest.mark.parametrize("recipe", RECIPES)
def test_batched_gemm_matches_the_hand_written_recipe_per_entry(recipe):
    a, b = _operands()
    y = float8_bmm(a, b, None, recipe)
    g = torch.randn_like(y)
    y.backward(g)
    for i in range(a.shape[0]):
        out, ga, gb = reference_mm(a[i].detach(), b[i].detach(), g[i], recipe)
        _close(y[i], out, f"output[{i}]")
        _close(a.grad[i], ga, f"grad_a[{i}]")
        _close(b.grad[i], gb, f"grad_b[{i}]")


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_batch_entry_is_exactly_the_2d_float8_gemm(recipe):
    # per-entry scales: entry i of the batched GEMM is, bit for bit, the 2-D GEMM of entry i
    a, b = _operands()
    y = float8_bmm(a, b, None, recipe)
    g = torch.randn_like(y)
    y.backward(g)
    for i in range(a.shape[0]):
        ai, bi = a[i].detach().requires_grad_(), b[i].detach().requires_grad_()
        yi = Float8MM.apply(ai, bi, recipe)
        yi.backward(g[i])
        assert torch.equal(y[i], yi)
        assert torch.equal(a.grad[i], ai.grad) and torch.equal(b.grad[i], bi.grad)


def test_baddbmm_alpha_beta_and_4d_matmul():
    a, b = _operands(batch=2)
    bias = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    plain = float8_bmm(a, b, None, "tensorwise")
    y = float8_bmm(a, b, bias, "tensorwise", alpha=0.5, beta=2.0)
    assert torch.equal(y, plain * 0.5 + 2.0 * bias)
    # [2, 2, M, K] @ [2, 2, K, N]: four entries
    a4, b4 = a.detach().repeat(2, 1, 1).view(2, 2, 16, 32), b.detach().repeat(2, 1, 1)
    y4 = float8_bmm(a4, b4.view(2, 2, 32, 16), None, "tensorwise")
    assert y4.shape == (2, 2, 16, 16) and torch.equal(y4.reshape(4, 16, 16)[:2], plain)


class Experts(torch.nn.Module):
    """A grouped expert GEMM (bmm with a [E, K, N] parameter), a linear written as a bmm of
    an expanded weight, and an attention-style bmm."""

    def __init__(self, experts=2):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(experts, 32, 16) * 0.1)
        self.proj = torch.nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self, x):
        h = torch.bmm(x, self.w)                                      # per expert
        h = torch.bmm(h, self.proj.expand(x.shape[0], 16, 16))        # flattened linear
        return torch.bmm(h, h.transpose(1, 2)).softmax(-1) @ h        # attention-style


def test_flattened_bmm_is_the_linear_path_bitwise():
    # bmm(x, w.expand(B, K, N)) runs as one [B*M, K] @ [K, N] GEMM: the same bits as the
    # 2-D float8 GEMM, the weight's gradient summed over the batch by that GEMM
    torch.manual_seed(0)
    x = torch.randn(3, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32, 16) * 0.1).to(torch.bfloat16).requires_grad_()
    y = float8_bmm(x, w, None, "tensorwise")
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = float8_matmul(x2, w2, None, "tensorwise")
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


@pytest.mark.parametrize("attention", [False, True], ids=["default", "batched_activations"])
def test_compiled_model_runs_its_batched_gemms_in_float8(attention):
    # the compiled model's outputs and gradients are float8_bmm's (no Inductor: bit for bit);
    # with batched_activations=True the attention-style GEMMs too
    model, ref = Experts(), Experts()
    fxamp.compile(model, opt_level="O2", compiler="aot_eager",
                  float8=Float8Config(batched_activations=attention, **SMALL))
    ref.to(torch.bfloat16)
    x = torch.randn(2, 16, 32)
    y = model(x)
    xb = x.to(torch.bfloat16)
    h = float8_bmm(xb, ref.w, None, "tensorwise")
    h = float8_bmm(h, ref.proj, None, "tensorwise")
    if attention:
        scores = float8_bmm(h, h.transpose(1, 2), None, "tensorwise")
        y_ref = float8_bmm(scores.softmax(-1), h, None, "tensorwise").float()
    else:
        y_ref = (torch.bmm(h, h.transpose(1, 2)).softmax(-1) @ h).float()
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(model.w.grad, ref.w.grad) and torch.equal(model.proj.grad, ref.proj.grad)


def test_choices_and_reasons():
    report = fxamp.explain(Experts(), torch.randn(2, 16, 32), opt_level="O2",
                           float8=Float8Config(**SMALL))
    by_kind = [(g.op, g.batch, g.float8) for g in report.gemms]
    assert by_kind == [("bmm", 2, True), ("bmm", 0, True), ("bmm", 2, False),
                       ("matmul", 2, False)], report.gemms
    assert all("attention-style" in g.reason for g in report.gemms[2:])
    assert "one flattened GEMM" in report.gemms[1].reason
    with_attention = fxamp.explain(Experts(), torch.randn(2, 16, 32), opt_level="O2",
                                   float8=Float8Config(batched_activations=True, **SMALL))
    assert all(g.float8 for g in with_attention.gemms)
    capped = fxamp.explain(Experts(experts=4), torch.randn(4, 16, 32), opt_level="O2",
                           float8=Float8Config(max_batch=3, **SMALL))
    assert "4 batch entries > max_batch=3" in capped.gemms[0].reason


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_batch=0), "max_batch=0 must be a positive int"),
    (dict(batched_activations=1), "batched_activations=1 must be True or False"),
])
def test_bad_batched_fields_are_refused(kwargs, message):
    with pytest.raises(fxamp.ConfigError, match=message):
        Float8Config(**kwargs)


def _delayed(model):
    fxamp.compile(model, opt_level="O2", float8=Float8Config(scaling="delayed", history_len=4,
                                                             **SMALL), compiler="aot_eager")
    return model


def _step(model, x):
    y = model(x)
    y.sum().backward()
    return y


def test_delayed_scaling_keeps_a_history_per_batch_entry_and_resumes_bit_exactly():
    # the flattened bmm is a 2-D GEMM with one history per operand; the per-expert bmm keeps
    # one per operand and batch entry (Note [Batched float8 GEMMs])
    model = _delayed(Experts())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 16, 32, generator=g) * (i + 1) for i in range(3)]
    _step(model, xs[0])
    histories = {k: v for k, v in model.state_dict().items() if k.startswith("fxamp_float8_")}
    assert {k: tuple(v.shape) for k, v in histories.items()} == {
        "fxamp_float8_amax_root_bmm0_b2_input": (4, 2),
        "fxamp_float8_amax_root_bmm0_b2_weight": (4, 2),
        "fxamp_float8_amax_root_bmm1_input": (4,), "fxamp_float8_amax_root_bmm1_weight": (4,)}
    experts = model.w.detach().to(torch.bfloat16).float().abs().amax(dim=(1, 2))
    assert torch.equal(histories["fxamp_float8_amax_root_bmm0_b2_weight"][0], experts)
    _step(model, xs[1])
    # a fresh model loading the checkpoint before its first call continues bit for bit
    resumed = _delayed(Experts())
    resumed.load_state_dict(model.state_dict())
    assert torch.equal(_step(model, xs[2]), _step(resumed, xs[2]))
    after, resumed_after = model.state_dict(), resumed.state_dict()
    assert all(torch.equal(after[k], resumed_after[k]) for k in histories)


def test_a_dynamic_batch_size_stays_named():
    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(32, 32)

        def forward(self, x):
            h = self.q(x)
            return torch.bmm(h, h.transpose(1, 2))

    model = Scores()
    fxamp.compile(model, opt_level="O2", compiler="aot_eager", dynamic=True,
                  float8=Float8Config(batched_activations=True, **SMALL))
    for batch in (2, 3):
        model(torch.randn(batch, 16, 32)).sum().backward()
    choices = [n.meta["fxamp_float8"] for g in fxamp.backend_of(model).compiled_graphs
               for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta]
    assert [c.reason for c in choices if c.op == "bmm"][-1] == \
        "bmm with a dynamic batch size; stays bf16"


def test_a_batched_gemm_in_a_checkpointed_body_is_named_as_such():
    class Checkpointed(Experts):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(torch.bmm, x, self.w, use_reentrant=False)

    report = fxamp.explain(Checkpointed(), torch.randn(2, 16, 32), opt_level="O2",
                           float8=Float8Config(**SMALL))
    assert [(g.op, g.float8) for g in report.gemms] == [("bmm", False)], report.gemms
    assert "checkpointed body: not rewritten" in report.gemms[0].reason
