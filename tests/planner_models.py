"""Models for the planner's tests, benchmark and example: an MLP with a planted outlier layer,
and a GPT-2 (transformers config, random init) with its loss."""

import math

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


# ------------------------------------------------------------------ hostile to the measuring
# Each GEMM below computes more than its product: a bias or an addmm/baddbmm input that
# cancels the product (a folded normalisation: bias = -W @ mean), alpha and beta, a batch dim
# broadcast, a 1-D operand. The error of the op as it runs, not of its product, decides.
OFFSET = 200.0  # the inputs' common offset: bf16 rounds it to 1 (one ulp at 200-250)


def offset_batch(batch: int = 32, d: int = 64, seed: int = 0):
    """(x, zeros): inputs whose features sit at OFFSET..1.25 OFFSET with unit noise."""
    gen = torch.Generator().manual_seed(seed)
    mean = OFFSET * (1 + 0.25 * torch.rand(d, generator=torch.Generator().manual_seed(7)))
    return mean + torch.randn(batch, d, generator=gen), mean


class FoldedNorm(nn.Linear):
    """A Linear with the input's normalisation folded in: bias = -W @ mean, so the output is
    W @ (x - mean), small, while the product W @ x is large."""

    def __init__(self, mean: torch.Tensor, d_out: int):
        super().__init__(mean.numel(), d_out)
        with torch.no_grad():
            self.bias.copy_(-self.weight @ mean)


def folded_norm_mlp(mean: torch.Tensor, h: int = 64, out: int = 16) -> nn.Module:
    """A frozen FoldedNorm (a normalisation folded into a fixed first layer), then a trained
    GELU MLP head."""
    torch.manual_seed(0)
    model = nn.Sequential(FoldedNorm(mean, h), nn.GELU(), nn.Linear(h, out))
    model[0].requires_grad_(False)
    return model


def offset_regression(steps: int, d: int = 64, out: int = 16, batch: int = 64):
    """(batches, mean): offset inputs (offset_batch), targets a fixed teacher of x - mean
    with label noise (std 0.1)."""
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(d, out, generator=gen) / 8
    batches = []
    for step in range(steps):
        x, mean = offset_batch(batch, d, seed=10 + step)
        noise = 0.1 * torch.randn(batch, out, generator=gen)
        batches.append((x, torch.tanh((x - mean) @ teacher) + noise))
    return batches, mean


class Addmm(nn.Module):
    """beta * c + alpha * (x @ w) with c cancelling the product; `ignored`: a c full of inf
    under beta=0, which addmm ignores."""

    def __init__(self, mean: torch.Tensor, d_out: int, alpha: float = 2.0, beta: float = 0.5,
                 ignored: bool = False):
        super().__init__()
        self.alpha, self.beta = alpha, (0.0 if ignored else beta)
        self.w = nn.Parameter(torch.randn(mean.numel(), d_out) / mean.numel() ** 0.5)
        c = torch.full((d_out,), math.inf) if ignored else -(alpha / beta) * (mean @ self.w)
        self.register_buffer("c", c.detach())

    def forward(self, x):
        return torch.addmm(self.c, x, self.w, beta=self.beta, alpha=self.alpha)


class Baddbmm(nn.Module):
    """baddbmm of [B, 1, K] by [B, K, N] (a weight per batch entry) with c cancelling it."""

    def __init__(self, mean: torch.Tensor, d_out: int, batch: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(batch, mean.numel(), d_out) / mean.numel() ** 0.5)
        self.register_buffer("c", -(mean @ self.w).unsqueeze(1).detach())

    def forward(self, x):
        return torch.baddbmm(self.c, x.unsqueeze(1), self.w).squeeze(1)


class Broadcast(nn.Module):
    """x [2, 1, M, K] @ w [3, K, N]: batch dims broadcast (float8 cannot run it)."""

    def __init__(self, d: int, d_out: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, d, d_out) / d ** 0.5)

    def forward(self, x):
        return x.reshape(2, 1, -1, x.shape[-1]) @ self.w


class MatVec(nn.Module):
    """x [M, K] @ v [K]: a 1-D operand."""

    def __init__(self, d: int):
        super().__init__()
        self.v = nn.Parameter(torch.randn(d) / d ** 0.5)

    def forward(self, x):
        return x @ self.v


class Hostile(nn.Module):
    """One GEMM of each kind above, each in its own module, on the same offset input; the
    output is all of theirs, flattened."""

    def __init__(self, mean: torch.Tensor, d_out: int = 32, batch: int = 32):
        super().__init__()
        torch.manual_seed(0)
        d = mean.numel()
        self.folded = FoldedNorm(mean, d_out)
        self.addmm = Addmm(mean, d_out)
        self.ignored = Addmm(mean, d_out, ignored=True)
        self.baddbmm = Baddbmm(mean, d_out, batch)
        self.broadcast = Broadcast(d, d_out)
        self.matvec = MatVec(d)

    def forward(self, x):
        return torch.cat([m(x).reshape(-1) for m in self.children()])
