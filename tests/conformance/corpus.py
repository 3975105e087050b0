"""Every pattern of the corpus, and the matrix of cases the tests run over it."""

from __future__ import annotations

import pytest
import torch

from . import corpus_autograd, corpus_layers
from .harness import Pattern

PATTERNS: list[Pattern] = [*corpus_layers.PATTERNS, *corpus_autograd.PATTERNS]
BY_NAME = {p.name: p for p in PATTERNS}
assert len(BY_NAME) == len(PATTERNS), "pattern names must be unique"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LEVELS = ("O1", "O2", "O3")


def _marks(pattern: Pattern, level: str, slow: bool) -> list:
    marks = [pytest.mark.slow] if slow or pattern.slow else []
    reason = pattern.xfail_reason(level)
    if reason:
        marks.append(pytest.mark.xfail(strict=True, reason=reason))
    return marks


def cases() -> list:
    """(pattern, level, dtype, compiler): bf16 with aot_eager by default; fp16 and Inductor
    (the patterns marked `inductor` at their first level by default) under `-m slow`."""
    out = []
    for p in PATTERNS:
        for level in p.levels:
            for dname in DTYPES:
                out.append(pytest.param(p.name, level, dname, "aot_eager",
                                        id=f"{p.name}-{level}-{dname}",
                                        marks=_marks(p, level, slow=dname != "bf16")))
            first = level == p.levels[0]
            if p.inductor:
                out.append(pytest.param(p.name, level, "bf16", "inductor",
                                        id=f"{p.name}-{level}-bf16-inductor",
                                        marks=_marks(p, level, slow=not first)))
    return out
