"""Every pattern of the corpus, and the matrix of cases the tests run over it.

Levels: every pattern runs at O1 and O2. O3 differs from O2 only in BatchNorm (16-bit) and in
having no master weights, which one forward/backward cannot see: the patterns with BatchNorm
(and the MLP baseline) run it; elsewhere O3 gave O2's numbers bit for bit (measured on
transformer_encoder_train, sdpa_pad_mask, weight_tying, functional_call).
"""

from __future__ import annotations

import pytest
import torch

from . import (corpus_autograd, corpus_grads, corpus_hf, corpus_layers, corpus_modules,
               corpus_views)
from .harness import Pattern

PATTERNS: list[Pattern] = [*corpus_layers.PATTERNS, *corpus_views.PATTERNS,
                           *corpus_autograd.PATTERNS, *corpus_grads.PATTERNS,
                           *corpus_modules.PATTERNS, *corpus_hf.PATTERNS]
BY_NAME = {p.name: p for p in PATTERNS}
assert len(BY_NAME) == len(PATTERNS), "pattern names must be unique"

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LEVELS = ("O1", "O2", "O3")


def _marks(pattern: Pattern, level: str, slow: bool) -> list:
    marks = [pytest.mark.slow] if slow or pattern.slow else []
    reason = pattern.xfail_reason(level)
    fixed = pattern.xfail_before is not None and TORCH_VERSION >= pattern.xfail_before
    if reason and not fixed:
        marks.append(pytest.mark.xfail(strict=True, reason=reason))
    return marks


# Inductor compiles a case in 10-40 s on 2 cores: one case by default, the others `-m slow`.
DEFAULT_INDUCTOR = ("mlp", "O1")


def cases() -> list:
    """(pattern, level, dtype, compiler): bf16 with aot_eager by default; fp16 and Inductor
    (the patterns marked `inductor`, at every level, bf16) under `-m slow`."""
    out = []
    for p in PATTERNS:
        for level in p.levels:
            for dname in DTYPES:
                out.append(pytest.param(p.name, level, dname, p.compiler or "aot_eager",
                                        id=f"{p.name}-{level}-{dname}",
                                        marks=_marks(p, level, slow=dname != "bf16")))
            if p.inductor:
                slow = (p.name, level) != DEFAULT_INDUCTOR
                out.append(pytest.param(p.name, level, "bf16", "inductor",
                                        id=f"{p.name}-{level}-bf16-inductor",
                                        marks=_marks(p, level, slow=slow)))
    return out
