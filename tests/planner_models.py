"""Models for the planner's tests, benchmark and example: an MLP with a planted outlier layer,
and a GPT-2 (transformers config, random init) with its loss."""

import torch
import torch.nn.functional as F
from torch import nn


class Outlier(nn.Module):
    """A linear layer whose input carries one huge feature (1e6, a planted 'massive
    activation') that its weight ignores (masked to zero): exact in fp32 and bf16; in float8
    the feature sets the scale and every other input underflows to zero; in fp16 it is inf."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        spike, mask = torch.zeros(d_in), torch.ones(d_out, d_in)
        spike[0], mask[:, 0] = 1e6, 0
        self.register_buffer("spike", spike)
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.linear(x + self.spike, self.linear.weight * self.mask, self.linear.bias)


def outlier_mlp(d: int = 64, h: int = 128, out: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), Outlier(h, h), nn.GELU(), nn.Linear(h, out))


def regression_batches(steps: int, d: int = 64, out: int = 64, batch: int = 64):
    """(x, y) pairs of a fixed random teacher with label noise (std 0.5): the loss settles
    well above zero, where a relative difference of losses means something."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(d, out, generator=gen) / d ** 0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, d, generator=gen)
        batches.append((x, torch.tanh(x @ teacher) + 0.5 * torch.randn(batch, out, generator=gen)))
    return batches


def gpt2(d: int = 2048, layers: int = 1, vocab: int = 512, seq: int = 32):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers,
                                     n_head=max(1, d // 128), n_positions=seq,
                                     bos_token_id=0, eos_token_id=0,
                                     attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config)


def lm_loss(output, ids):
    return F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def token_batch(batch: int = 2, seq: int = 32, vocab: int = 512, seed: int = 0):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, ids
