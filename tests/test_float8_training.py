"""A small Llama (transformers config, random weights) trained in float8 against bf16 (O1, CPU):
the losses stay within 2 % (200 steps: `-m slow`; a short run in the default suite) and every
GEMM of the model, the tied lm_head included, runs in float8."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxamp

VOCAB, SEQ, BATCH = 128, 16, 4


def _llama(layers: int = 2, attn: str = "sdpa"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
        tie_word_embeddings=True, attn_implementation=attn)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4,
                                     n_positions=SEQ, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def _batch(gen):
    # a learnable sequence (each token 3 * the previous + 1, mod VOCAB, from a random start)
    # with a quarter of the tokens replaced by random ones: the loss settles well above zero,
    # where a 2 % difference means something
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    steps = torch.arange(SEQ).view(1, -1)
    ids = (start * 3 ** steps + (3 ** steps - 1) // 2) % VOCAB
    noise = torch.rand(BATCH, SEQ, generator=gen) < 0.25
    return torch.where(noise, torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), ids)


def train(steps: int, float8, compiler="inductor", model=None) -> list[float]:
    model = model or _llama()
    fxamp.compile(model, opt_level="O1", float8=float8, compiler=compiler)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = _batch(gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _final(losses, n):
    return sum(losses[-n:]) / n


@pytest.mark.slow
def test_200_steps_float8_within_2_percent_of_bf16():
    bf16, f8 = train(200, None), train(200, "tensorwise")
    assert _final(bf16, 20) < 0.6 * bf16[0]  # it learns
    assert abs(_final(f8, 20) - _final(bf16, 20)) <= 0.02 * _final(bf16, 20), (bf16[-5:], f8[-5:])


def test_short_float8_run_reaches_every_gemm():
    # The default suite's share: one float8 run (one layer, no Inductor), every GEMM of the
    # model in float8 -- q, k, v, o, gate, up, down and the tied lm_head -- and it learns.
    model = _llama(layers=1)
    losses = train(6, "tensorwise", compiler="aot_eager", model=model)
    assert losses[-1] < losses[0] and all(l == l for l in losses)
    gemms = [n.meta["fxamp_float8"] for g in fxamp.backend_of(model).compiled_graphs
             for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta]
    assert len(gemms) == 7 + 1
    assert all(g.float8 for g in gemms), [g.reason for g in gemms if not g.float8]


@pytest.mark.slow
def test_gpu_benchmark_smoke_runs_every_mode():
    # benchmarks/float8_gpu.py on CPU, tiny models: every mode runs (torchao's when installed)
    from benchmarks import float8_gpu

    results = float8_gpu.main(["--smoke", "--models", "gpt2"])
    ran = {m for m, r in results["gpt2"].items() if "seconds" in r}
    assert {"bf16", "fxamp-f8", "fxamp-f8-delay"} <= ran, results


# eager attention: q @ k^T and attn @ v are batched matmuls over (batch, head)
MODELS = {"llama": lambda: _llama(layers=1, attn="eager"), "gpt2": _gpt2}


def _gemm_nodes(report):
    from fxamp.passes.float8 import GEMM_OPS, is_float8_gemm

    return [n for g in report.graphs for n in g.graph_module.graph.nodes
            if n.op == "call_function" and (n.target in GEMM_OPS or is_float8_gemm(n))]


@pytest.mark.parametrize("arch", MODELS)
def test_every_gemm_is_float8_or_named_with_its_reason(arch):
    ids = _batch(torch.Generator().manual_seed(1))
    f8 = fxamp.Float8Config(min_dim=16)
    report = fxamp.explain(MODELS[arch](), ids, opt_level="O1", float8=f8)
    nodes = _gemm_nodes(report)
    assert len(nodes) == len(report.gemms) and all("fxamp_float8" in n.meta for n in nodes)
    stays = [g for g in report.gemms if not g.float8]
    # the two attention GEMMs stay, named; every other GEMM (projections, MLP, the tied
    # lm_head; GPT-2's Conv1D addmms) is float8
    assert [(g.op, g.batch) for g in stays] == [("matmul", BATCH * 4)] * 2, stays
    assert all("attention-style batched GEMM" in g.reason for g in stays)
    assert all(g.reason for g in report.gemms)


@pytest.mark.slow
def test_eager_attention_trains_in_float8():
    # with batched_activations=True every GEMM is float8, q @ k^T and attn @ v too (one GEMM
    # per (batch, head)), through the backward (the default suite's share of this:
    # tests/test_float8_batched.py, test_compiled_model_runs_its_batched_gemms_in_float8)
    model = _llama(layers=1, attn="eager")
    f8 = fxamp.Float8Config(min_dim=16, batched_activations=True)
    losses = train(3, f8, compiler="aot_eager", model=model)
    assert losses[-1] < losses[0] and all(l == l for l in losses)
    gemms = [n.meta["fxamp_float8"] for g in fxamp.backend_of(model).compiled_graphs
             for n in g.graph_module.graph.nodes if "fxamp_float8" in n.meta]
    assert all(g.float8 for g in gemms), [g.reason for g in gemms if not g.float8]
    assert sum(g.batch == BATCH * 4 for g in gemms) == 2
