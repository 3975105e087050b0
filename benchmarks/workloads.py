"""The end-to-end benchmark's models, batches, and the arithmetic behind tokens/s and MFU.

GPT-2 is transformers' GPT2LMHeadModel from a config (random weights, dropout off). The ResNet
is torchvision's resnet50 at the "large" size when torchvision imports (the model published
images/s figures use), else transformers' ResNetForImageClassification, which at that size is
the same network (bottleneck stages 3-4-6-3 of 256-2048 channels); smaller sizes always use the
transformers one. `Workload.source` records which.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import transformers

# gpt2: (embd, layers, heads, seq, batch, vocab); resnet: (stem, widths, depths, block, image,
# batch). "large" is GPT-2 small (124M) at 1024 tokens and ResNet-50 at 224x224, for a GPU.
SIZES = {
    "tiny": dict(gpt2=(32, 1, 2, 16, 2, 128), resnet=(8, [8, 16], [1, 1], "basic", 16, 2)),
    "small": dict(gpt2=(64, 2, 2, 64, 4, 512), resnet=(16, [16, 32], [1, 1], "basic", 32, 8)),
    "large": dict(gpt2=(768, 12, 12, 1024, 8, 50257),
                  resnet=(64, [256, 512, 1024, 2048], [3, 4, 6, 3], "bottleneck", 224, 64)),
}
# Dense bf16/fp16 tensor-core peaks (no sparsity), from NVIDIA's datasheets; the first name
# that occurs in torch.cuda.get_device_name() wins.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
               ("A100", 312.0))


@dataclasses.dataclass
class Workload:
    make_model: Callable[[], torch.nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor
    unit: str  # what one step processes: "tokens" or "images"
    items: int  # of them per step
    flops: Optional[float]  # model FLOPs of one training step, where counted
    source: str


def gpt2(embd: int, layers: int, heads: int, seq: int, batch: int, vocab: int) -> Workload:
    config = transformers.GPT2Config(n_embd=embd, n_layer=layers, n_head=heads, n_positions=seq,
                                     vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return Workload(lambda: transformers.GPT2LMHeadModel(config), ids, ids.roll(-1, 1), "tokens",
                    batch * seq, gpt2_flops_per_token(config, seq) * batch * seq,
                    "transformers.GPT2LMHeadModel")


def gpt2_flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token, as PaLM's appendix and nanoGPT count them: 6 per parameter
    (forward 2, backward 4; the tied embedding counted once, as the output matmul, and the
    position table not at all) plus 12 * layers * width * seq for attention's two matmuls."""
    d, layers, vocab = config.n_embd, config.n_layer, config.vocab_size
    per_layer = 12 * d * d + 13 * d  # qkv, proj, mlp (4x) weights and biases; two LayerNorms
    params = layers * per_layer + vocab * d + 2 * d  # + the tied embedding, the final LayerNorm
    return 6 * params + 12 * layers * d * seq


def resnet(stem: int, widths: list[int], depths: list[int], layer_type: str, image: int,
           batch: int) -> Workload:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image, image, generator=gen)
    classes = 1000 if image >= 224 else 10
    labels = torch.randint(0, classes, (batch,), generator=gen)
    resnet50 = (widths, depths, layer_type) == ([256, 512, 1024, 2048], [3, 4, 6, 3],
                                                "bottleneck")
    torchvision = _torchvision() if resnet50 else None
    if torchvision is not None:
        return Workload(lambda: torchvision.models.resnet50(num_classes=classes), images, labels,
                        "images", batch, None, "torchvision.models.resnet50")
    config = transformers.ResNetConfig(embedding_size=stem, hidden_sizes=widths, depths=depths,
                                       layer_type=layer_type, num_labels=classes)
    return Workload(lambda: transformers.ResNetForImageClassification(config), images, labels,
                    "images", batch, None, "transformers.ResNetForImageClassification")


def _torchvision():
    try:
        import torchvision
    except Exception:  # absent, or built for another torch (its C++ ops fail to register)
        return None
    return torchvision


WORKLOADS = {"gpt2": gpt2, "resnet": resnet}


def peak_flops(device: torch.device, override_tflops: Optional[float]) -> Optional[float]:
    """The device's dense 16-bit peak in FLOP/s (None: unknown, so no MFU)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS if key in name), None)
