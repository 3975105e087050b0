"""Real architectures from the transformers package, built from scaled-down configs (no download).

Each factory returns a `Case`: a seeded fp32 model (dropout off, so mixed and fp32 runs see the
same function), one batch of inputs, a target and the loss. Sizes stay at hidden 32, 2 layers,
16 tokens or 16-32 pixel images: 16-bit matmuls are ~40x slower than fp32 on CPUs without
bf16/fp16 units, and the point is the architectures' ops, not their size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
import transformers
from torch import nn

__all__ = ["Case", "CASES", "gpt2", "bert", "llama", "vit", "resnet", "convnext"]

SEED = 0
BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS = 2, 16, 128, 32, 2, 2
IMAGE, CLASSES = 32, 10


@dataclasses.dataclass(frozen=True)
class Case:
    """A model with one batch to train on. `model` is never trained: deep-copy it first."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor

    def loss(self, output: Any) -> torch.Tensor:
        # output["logits"]: a ModelOutput, or the dict fxamp's O2/O3 output cast turns it into.
        logits = output["logits"].float()
        return F.cross_entropy(logits.flatten(0, -2), self.target.flatten())


def _case(name: str, build: Callable[[], nn.Module], inputs: Callable[[torch.Generator], tuple],
          target_shape: tuple[int, ...], classes: int) -> Case:
    # fork_rng: the same weights on every call without disturbing the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = build().train()
    gen = torch.Generator().manual_seed(SEED + 1)
    return Case(name, model, inputs(gen), torch.randint(0, classes, target_shape, generator=gen))


def _token_ids(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),)


def _images(gen: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen),)


# use_cache=False: training code turns the KV cache off (it only serves generation).
_TEXT = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)


def gpt2() -> Case:
    """GPT-2: learned positions, pre-LN blocks, GELU MLP, tied LM head; causal LM."""
    config = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                     n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, **_TEXT)
    return _case("gpt2", lambda: transformers.GPT2LMHeadModel(config), _token_ids,
                 (BATCH, SEQ), VOCAB)


def bert() -> Case:
    """BERT: post-LN encoder, token-type embeddings, MLM head with a LayerNorm transform."""
    config = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                                     max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **_TEXT)
    return _case("bert", lambda: transformers.BertForMaskedLM(config), _token_ids,
                 (BATCH, SEQ), VOCAB)


def llama() -> Case:
    """Llama: RMSNorm (computed in fp32 by the model itself), RoPE, SwiGLU, grouped KV heads."""
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=1, max_position_embeddings=SEQ,
                                      **_TEXT)
    return _case("llama", lambda: transformers.LlamaForCausalLM(config), _token_ids,
                 (BATCH, SEQ), VOCAB)


def vit() -> Case:
    """ViT: conv patch embedding, CLS token, pre-LN encoder, classification head."""
    config = transformers.ViTConfig(image_size=IMAGE // 2, patch_size=4, hidden_size=HIDDEN,
                                    num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                    intermediate_size=2 * HIDDEN, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, num_labels=CLASSES)
    images = lambda gen: (torch.randn(BATCH, 3, IMAGE // 2, IMAGE // 2, generator=gen),)
    return _case("vit", lambda: transformers.ViTForImageClassification(config), images,
                 (BATCH,), CLASSES)


def resnet() -> Case:
    """ResNet: conv stem, BatchNorm, basic residual blocks with a projection shortcut."""
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="basic", num_labels=CLASSES)
    return _case("resnet", lambda: transformers.ResNetForImageClassification(config), _images,
                 (BATCH,), CLASSES)


def convnext() -> Case:
    """ConvNeXt: patchify stem, depthwise 7x7 convs, channels-first LayerNorm, layer scale
    (1e-6: subnormal in fp16), GELU MLP."""
    config = transformers.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                         num_labels=CLASSES)
    return _case("convnext", lambda: transformers.ConvNextForImageClassification(config),
                 _images, (BATCH,), CLASSES)


CASES: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "bert": bert, "llama": llama, "vit": vit, "resnet": resnet,
    "convnext": convnext}
