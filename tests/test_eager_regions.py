"""Modules Dynamo does not trace (nn.RNN, nn.GRU, nn.LSTM) run eagerly under the level's policy.

Note [Eager regions run under autocast] (fxamp/eager_regions.py): before, at O1 an RNN ran
entirely in fp32 with no word (0 graphs compiled). Now it runs under torch.autocast, as it
does under plain autocast, fxamp.compile warns once naming it (EagerRegionWarning) and
explain() lists it. Known torch limitation, checked here: nn.LSTM under CPU bf16 autocast
fails inside oneDNN, with fxamp and with plain torch.autocast alike. Tolerances: parity.py.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import fxamp
import parity


class Recurrent(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.rnn = cls(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        out = self.rnn(self.inp(x))[0]
        return self.head(out[:, -1])


def _make(cls):
    def make():
        torch.manual_seed(0)
        return Recurrent(cls)

    return make


def _x():
    return torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN])
def test_rnn_runs_under_the_level_at_o1(cls):
    model = fxamp.compile(_make(cls)(), opt_level="O1", compiler="aot_eager")
    out = model(_x())
    assert out.dtype == torch.bfloat16  # as under torch.autocast; fp32 before
    parity.check(_make(cls), [_x()], "O1")


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_gru_at_o2_o3(level):
    parity.check(_make(nn.GRU), [_x()], level)


def test_warns_once_naming_the_module():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fxamp.compile(_make(nn.GRU)(), opt_level="O1", compiler="aot_eager")
        model(_x())
        model(_x())
    eager = [w for w in caught if issubclass(w.category, fxamp.EagerRegionWarning)]
    assert len(eager) == 1
    assert "rnn (GRU)" in str(eager[0].message) and "torch.autocast('cpu'" in str(
        eager[0].message)


def test_explain_lists_it():
    explanation = fxamp.explain(_make(nn.GRU)(), _x(), opt_level="O1")
    assert explanation.eager_modules == ["rnn (GRU)"]
    assert "!! run eagerly, not traced by Dynamo: rnn (GRU)" in str(explanation)


def test_lstm_bf16_autocast_on_cpu_fails_in_onednn_also_without_fxamp():
    # The caveat docs/backend.md states: if torch fixes it, this test tells us to drop it.
    # An fp32 input straight into the LSTM (no lowered op before it).
    with pytest.raises(RuntimeError, match="primitive descriptor"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(8, 16, batch_first=True)(_x())
