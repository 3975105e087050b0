"""How much of compile time the float8 pass takes (issue 15 target: <= 5 %), on CPU.

    python3 -m benchmarks.float8_compile_share            # a 2-layer Llama, Inductor

Compiles the same model twice in one process, fxamp O1 without and with float8="tensorwise",
and prints: each first call's wall time (Dynamo, fxamp, AOTAutograd, Inductor); the float8
pass's own time (deciding and rewriting the GEMMs of the captured graph, timed on a copy of
it); and the extra compile time float8 costs in total (the pass plus tracing and compiling the
float8 ops it adds), each as a share of the float8 compile.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Optional

import torch
import transformers

import fxamp
from fxamp.config import AmpConfig
from fxamp.passes.float8 import decide_gemms, rewrite_gemms


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="sdpa"))


def _first_call(float8: Optional[str], ids: torch.Tensor):
    model = fxamp.compile(_llama(), opt_level="O1", float8=float8)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start, fxamp.backend_of(model).compiled_graphs


def _pass_seconds(graphs, config: AmpConfig, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        copies = [copy.deepcopy(g.graph_module) for g in graphs]
        start = time.perf_counter()
        for gm in copies:
            decide_gemms(gm, config)
            rewrite_gemms(gm, config)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: Optional[list[str]] = None) -> dict:
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    plain_s, graphs = _first_call(None, ids)
    float8_s, f8_graphs = _first_call("tensorwise", ids)
    config = AmpConfig.from_opt_level("O1", float8="tensorwise").resolve("cpu")
    pass_s = _pass_seconds(graphs, config)
    gemms = sum(g.stats.float8_gemms for g in f8_graphs)
    result = {"compile_s_bf16": plain_s, "compile_s_float8": float8_s, "pass_s": pass_s,
              "float8_gemms": gemms, "pass_share": pass_s / float8_s,
              "total_extra_share": (float8_s - plain_s) / float8_s}
    print(f"first call (compile) without float8: {plain_s:.1f} s, with: {float8_s:.1f} s "
          f"({gemms} GEMMs rewritten)")
    print(f"float8 pass: {1000 * pass_s:.1f} ms = {100 * result['pass_share']:.2f} % of the "
          f"float8 compile (target <= 5 %)")
    print(f"all float8 adds (pass + tracing/compiling its ops): "
          f"{100 * result['total_extra_share']:.1f} % of the float8 compile")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
