"""fxamp's precision on transformers.Trainer subclasses: trl's SFTTrainer with a PEFT LoRA
config (trl's documented LoRA route) and a user's subclass with a constructor argument of its
own, each as `class X(fxamp.integrations.transformers.Trainer, Subclass)`, on a tiny GPT-2 and
a word-level tokenizer built in-process (no download; HF_HUB_OFFLINE holds trl to that)."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")

from fxamp.errors import ConfigError  # noqa: E402
from fxamp.integrations.transformers import Trainer  # noqa: E402

import tiny_gpt2  # noqa: E402

STEPS = 3
WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, "<unk>": len(WORDS) + 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<eos>", unk_token="<unk>")


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                           task_type="CAUSAL_LM")


def _split(model):
    """(LoRA adapter tensors, base tensors) of a PEFT model, by name, detached copies."""
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ({n: v for n, v in named.items() if "lora_" in n},
            {n: v for n, v in named.items() if "lora_" not in n})


def _check_lora_trained(model, before, out_dir):
    adapters, base = _split(model)
    lora_before, base_before = before
    assert adapters.keys() == lora_before.keys() and adapters
    assert any(not torch.equal(v, lora_before[n]) for n, v in adapters.items())  # trained
    assert all(torch.equal(v, base_before[n]) for n, v in base.items())  # frozen
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    model.save_pretrained(out_dir)
    assert os.path.exists(os.path.join(out_dir, "adapter_model.safetensors"))
    loaded = peft.PeftModel.from_pretrained(tiny_gpt2.model(), out_dir)
    assert all(torch.equal(p.detach(), adapters[n].to(p.dtype))
               for n, p in loaded.named_parameters() if "lora_" in n)
    ids = tiny_gpt2.batches(1)[0]
    with torch.no_grad():
        want = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()
        assert isinstance(merged, transformers.GPT2LMHeadModel)
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_trl_sft_trainer_with_peft_config_trains_the_adapters(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    class FxSFT(Trainer, trl.SFTTrainer):
        pass

    rows = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6)) for i in range(16)]
    config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, learning_rate=1e-2,
                           per_device_train_batch_size=4, max_length=tiny_gpt2.SEQ,
                           use_cpu=True, report_to=[], save_strategy="no", logging_steps=1)
    trainer = FxSFT(model=tiny_gpt2.model(), args=config, peft_config=_lora(),
                    train_dataset=datasets.Dataset.from_dict({"text": rows}),
                    processing_class=_tokenizer(), opt_level="O1", compiler="aot_eager")
    model = trainer.model
    assert isinstance(model, peft.PeftModel)
    before = _split(model)
    trainer.train()
    assert type(trainer.optimizer.optimizer).__module__.startswith("fxamp.optim")
    assert len([r for r in trainer.state.log_history if "loss" in r]) == STEPS
    _check_lora_trained(model, before, str(tmp_path / "adapter"))


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = [r for b in tiny_gpt2.batches(STEPS) for r in b]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class Weighted(transformers.Trainer):
    """A user's Trainer subclass with a constructor argument of its own, taking the rest as
    **kwargs."""

    def __init__(self, *args, loss_weight, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_weight = loss_weight

    def compute_loss(self, model, inputs, **kw):
        return super().compute_loss(model, inputs, **kw) * self.loss_weight


class FxWeighted(Trainer, Weighted):
    pass


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4,
        max_steps=STEPS, learning_rate=1e-2, save_strategy="no", logging_steps=1, **kw)


def test_a_users_subclass_with_its_own_argument_and_a_peft_model(tmp_path):
    model = peft.get_peft_model(tiny_gpt2.model(), _lora())
    before = _split(model)
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="fxamp")
    trainer = FxWeighted(model=model, args=args, train_dataset=Rows(), loss_weight=0.5,
                         opt_level="O1", compiler="aot_eager")
    assert trainer.loss_weight == 0.5 and not trainer.args.torch_compile  # fxamp compiles
    assert args.torch_compile  # the user's arguments are left alone
    trainer.train()
    assert type(trainer.optimizer.optimizer).__module__.startswith("fxamp.optim")
    _check_lora_trained(model, before, str(tmp_path / "adapter"))


def test_a_subclass_is_refused_by_what_fxamp_refuses_before_it_is_built(tmp_path):
    model = tiny_gpt2.model()
    rmsprop = torch.optim.RMSprop(model.parameters())
    with pytest.raises(ConfigError, match="RMSprop"):
        FxWeighted(model=model, args=_args(tmp_path), loss_weight=2.0,
                   optimizers=(rmsprop, None))
    with pytest.raises(TypeError, match="loss_weight"):
        FxWeighted(model=model, args=_args(tmp_path), loss_weigth=2.0)
