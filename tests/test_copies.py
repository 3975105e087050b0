"""Copies of an fxamp-compiled model are fxamp-compiled models with the same config.

Note [Copies keep the compiled call] (fxamp/model/copies.py). Before, a copy kept fxamp's weights
and marker but lost the compiled call: at O2 it failed with a dtype mismatch, at O1 it ran
silently in fp32, and fxamp.compile refused it as "already prepared". A copy must give the
original's output bit for bit (same weights, same graph) and train.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel

import fxamp


def _deepcopy(model):
    return copy.deepcopy(model)


def _pickle(model):
    return pickle.loads(pickle.dumps(model))


def _torch_save(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _averaged(model):
    return AveragedModel(model)


COPIES = {"deepcopy": _deepcopy, "pickle": _pickle, "torch_save": _torch_save,
          "averaged_model": _averaged}


def _model(level):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return fxamp.compile(net, opt_level=level, compiler="aot_eager")


def _inner(model):
    return model.module if isinstance(model, AveragedModel) else model


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("how", sorted(COPIES))
def test_copy_is_compiled_with_the_same_config(how, level):
    model = _model(level).eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    expected = model(x)
    copied = COPIES[how](model)
    inner = _inner(copied)
    assert fxamp.config_of(inner) == fxamp.config_of(model)
    out = copied(x)
    assert out.dtype == expected.dtype and torch.equal(out, expected)
    assert len(fxamp.backend_of(inner).compiled_graphs) >= 1  # ran fxamp's graph
    assert inner[0].weight.dtype == model[0].weight.dtype


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_copy_trains(level):
    copied = _pickle(_model(level)).train()
    copied(torch.randn(4, 8)).float().sum().backward()
    assert all(p.grad is not None for p in copied.parameters())


def test_copy_of_a_copy():
    model = _model("O2").eval()
    x = torch.randn(4, 8)
    assert torch.equal(_deepcopy(_pickle(model))(x), model(x))


def test_copies_state_dict_is_the_copys_stored_weights_as_the_originals():
    model = _model("O2")
    copied = _deepcopy(model)
    assert copied.state_dict()["0.weight"].dtype == model.state_dict()["0.weight"].dtype
    assert copied.state_dict()["0.weight"].data_ptr() == copied[0].weight.data_ptr()
