"""transformers models (tiny configs, random weights, no download), trained as their users do:
with `model.gradient_checkpointing_enable()`, and without it for comparison."""

from __future__ import annotations

import torch
import transformers

from .groups import HF
from .harness import Pattern

BATCH, SEQ, VOCAB, HIDDEN = 2, 12, 96, 32
_TEXT = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False)


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **_TEXT))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * HIDDEN, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **_TEXT))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ, **_TEXT))


def _build(factory, checkpointing: bool):
    def build():
        model = factory()
        if checkpointing:
            model.gradient_checkpointing_enable()
        return model, (torch.randint(0, VOCAB, (BATCH, SEQ)),)
    return build


def _logits(model, inputs):
    return model(*inputs).logits


def _hf(name: str, factory, checkpointing: bool, slow: bool = False) -> Pattern:
    suffix = ", gradient_checkpointing_enable()" if checkpointing else ""
    return Pattern(f"hf_{name}{'_gc' if checkpointing else ''}", HF,
                   f"transformers {factory.__name__[1:]} (tiny config){suffix}",
                   _build(factory, checkpointing), call=_logits, slow=slow)


PATTERNS = [
    _hf("gpt2", _gpt2, checkpointing=True),
    _hf("bert", _bert, checkpointing=True, slow=True),
    _hf("llama", _llama, checkpointing=True),
    _hf("llama", _llama, checkpointing=False, slow=True),
]
