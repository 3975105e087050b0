"""Patterns built on torch.nn's bigger modules and on what users do with a whole model:
recurrent layers, TransformerEncoder, a channels_last ResNet, inference modes, copies."""

from __future__ import annotations

import copy
import io

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import fxamp

from .groups import COPIES, ENCODER, INFERENCE, LAYERS, RECURRENT
from .harness import Pattern, Run

B, D, T = 4, 16, 6


class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 3)
        self.rnn = getattr(nn, kind)(D, D, batch_first=True) if kind != "RNNCell" else \
            nn.RNNCell(D, D)
        self.rnn.register_forward_hook(_record_dtype)

    def forward(self, x):
        h = self.inp(x)
        if isinstance(self.rnn, nn.RNNCell):
            state = torch.zeros(x.shape[0], D, dtype=h.dtype)
            for t in range(x.shape[1]):
                state = self.rnn(h[:, t], state)
            return self.head(state)
        return self.head(self.rnn(h)[0][:, -1])


def _record_dtype(module, args, output):
    # What dtype the recurrent layer computed in (checked at O1: see _rnn_honours_o1).
    module.ran_in = (output[0] if isinstance(output, tuple) else output).dtype


def _rnn_honours_o1(run: Run, ref: Run, level: str) -> None:
    rnn = run.model.rnn
    if level != "O1" or rnn.ran_in != torch.float32:
        return
    named = [w for w in run.warnings if type(rnn).__name__ in w]
    assert named, (f"at O1 the {type(rnn).__name__} ran in fp32 and fxamp did not warn "
                   f"(warnings: {run.warnings})")


def _recurrent(kind: str):
    return lambda: (Recurrent(kind), (torch.randn(B, T, D),))


def _encoder():
    layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(B, T, D),)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """torchvision's resnet layout (stem, basic blocks, projection shortcuts), 2 tiny stages."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.layer1, self.layer2 = BasicBlock(8, 8, 1), BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _resnet_channels_last():
    model = ResNet().to(memory_format=torch.channels_last)
    return model, (torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last),)


def _keeps_channels_last(run: Run, ref: Run, level: str) -> None:
    conv = run.model.layer2.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last), "weights left channels_last"


def _convnet():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 5))
    return model, (torch.randn(4, 3, 8, 8),)


def _pickled(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _is_fxamp_model(run: Run, ref: Run, level: str) -> None:
    config = fxamp.config_of(run.model.module if isinstance(run.model, AveragedModel)
                             else run.model)
    assert config is not None and config.opt_level == level, (
        f"the copy is not an fxamp-compiled {level} model (config_of gives {config})")


def _copy_pattern(name: str, summary: str, copier, xfail: dict) -> Pattern:
    return Pattern(name, COPIES, summary, lambda: (ResNet(), (torch.randn(4, 3, 16, 16),)),
                   copy=copier, check=_is_fxamp_model, xfail=xfail)


PATTERNS = [
    Pattern("lstm", RECURRENT, "nn.LSTM (batch_first) between Linear layers", _recurrent("LSTM"),
            check=_rnn_honours_o1),
    Pattern("gru", RECURRENT, "nn.GRU (batch_first) between Linear layers", _recurrent("GRU"),
            check=_rnn_honours_o1),
    Pattern("rnn_cell", RECURRENT, "nn.RNNCell unrolled in a Python loop", _recurrent("RNNCell"),
            check=_rnn_honours_o1),
    Pattern("transformer_encoder_train", ENCODER,
            "nn.TransformerEncoder (2 post-LN layers), train()",
            _encoder, inductor=True),
    Pattern("transformer_encoder_eval", ENCODER, "nn.TransformerEncoder in eval() under no_grad "
            "(the fused fast path)", _encoder, eval=True, grad_mode="no_grad"),
    Pattern("resnet_channels_last", LAYERS,
            "torchvision-style ResNet, model and input channels_last",
            _resnet_channels_last, levels=("O1", "O2", "O3"), check=_keeps_channels_last,
            inductor=True),
    Pattern("inference_no_grad", INFERENCE,
            "conv + BatchNorm(eval) + Linear under torch.no_grad()",
            _convnet, eval=True, grad_mode="no_grad", levels=("O1", "O2", "O3")),
    Pattern("inference_mode", INFERENCE,
            "conv + BatchNorm(eval) + Linear under torch.inference_mode()",
            _convnet, eval=True, grad_mode="inference_mode", levels=("O1", "O2", "O3")),
    _copy_pattern("deepcopy", "copy.deepcopy of the compiled model", copy.deepcopy, {}),
    _copy_pattern("pickle", "torch.save(model) / torch.load round trip", _pickled, {}),
    _copy_pattern("averaged_model", "torch.optim.swa_utils.AveragedModel (EMA) of the model",
                  AveragedModel, {}),
]
