"""Patterns that update part of a tensor in place through a view (issue 24 item 1): a class
token added to position 0, gated slices, rows written through narrow, select, as_strided and
views of slices, a view read after its base is written, and a view crossing a graph break.

At O1 the embedding's output is fp32 and the Linear reading it runs in the low dtype: the
cast must be taken after the writes (Note [Casts and in-place updates of views])."""

from __future__ import annotations

import torch
from torch import nn

from .groups import VIEWS
from .harness import Pattern

B, T, D, VOCAB = 4, 8, 32, 50


class ViewWrites(nn.Module):
    """An embedding whose rows are updated in place through views, then mixed by a Linear."""

    def __init__(self, write):
        super().__init__()
        self.emb, self.mix = nn.Embedding(VOCAB, D), nn.Linear(D, D)
        self.cls, self.gate = nn.Parameter(torch.randn(D)), nn.Parameter(torch.rand(D) + 0.5)
        self.write = write

    def forward(self, ids):
        return self.mix(self.write(self, self.emb(ids)))


def _cls_token(m, h):
    h[:, 0] += m.cls  # the example
    return h


def _every_view(m, h):
    h.narrow(1, 1, 2).mul_(m.gate)
    h.select(1, 3).add_(m.cls)
    h[:, 4:6].view(h.shape[0], 2 * D).copy_(torch.cat([m.cls, m.gate]).expand(h.shape[0], -1))
    h[:, 6].unsqueeze(1).mul_(m.gate)
    h.as_strided((h.shape[0], 1, D), (T * D, D, 1), 7 * D).add_(m.gate)
    return h


def _base_written(m, h):
    first = h[:, 0]
    h.mul_(m.gate)  # the view, read next by the Linear, sees the write to its base
    return first


class AcrossGraphBreak(ViewWrites):
    def __init__(self):
        super().__init__(None)

    def forward(self, ids):
        h = self.emb(ids)
        first = h[:, 0]
        torch._dynamo.graph_break()  # the next graph gets `first` and `h`: aliased inputs
        first += self.cls
        return self.mix(h)


def _ids():
    return torch.randint(0, VOCAB, (B, T))


def _pattern(name, summary, write, **kwargs):
    return Pattern(name, VIEWS, summary, lambda: (ViewWrites(write), (_ids(),)), **kwargs)


PATTERNS = [
    _pattern("view_cls_token", "h = emb(ids); h[:, 0] += cls; mix(h)", _cls_token,
             inductor=True),
    _pattern("view_writes", "narrow().mul_, select().add_, h[:, a:b].view().copy_, "
             "h[:, i].unsqueeze().mul_, as_strided().add_", _every_view, inductor=True),
    _pattern("view_base_written", "a view read after its base is written in place",
             _base_written),
    Pattern("view_graph_break", VIEWS, "a view written after a graph break (aliased graph "
            "inputs)", lambda: (AcrossGraphBreak(), (_ids(),))),
]
