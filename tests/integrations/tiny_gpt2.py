"""A tiny random GPT-2 and its batches for the integration tests (no download)."""

import torch

VOCAB, SEQ = 64, 8


def model(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=SEQ, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def batches(n: int, batch: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


def poison_grad(model_: torch.nn.Module) -> None:
    """An overflow, as fp16 would make it: one gradient element becomes inf."""
    p = next(p for p in model_.parameters() if p.grad is not None)
    p.grad.view(-1)[0] = float("inf")
