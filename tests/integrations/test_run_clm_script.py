"""transformers' own `examples/pytorch/language-modeling/run_clm.py` with the recipe of
docs/integrations.md ("transformers Trainer") applied as written, training a tiny GPT-2 from a
local config with a tokenizer built here on a local text file (no hub: HF_HUB_OFFLINE), against
the same script under transformers' own `--bf16` and `--fp16` (torch.autocast), on the same seed.

Then `trainer.save_model()` (the script's) -> `from_pretrained`: before issue 32 fxamp's O2 run
saved a config.json whose dtype said float16 over fp32 tensors and the tied `lm_head.weight` as
a tensor of its own. Needs `datasets` and `evaluate` (the script imports both) and the script
(tests/integrations/upstream_scripts.py says where it is read from).
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")
pytest.importorskip("evaluate")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import upstream_scripts  # noqa: E402

WORDS = ("the cat sat on a mat while the dog ran to the park and a bird sang in the tree "
         "near the old house by the river where the children played all day long").split()
STEPS = 6


def _text(path, lines, seed):
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (lines, 12), generator=gen)
    path.write_text("".join(" ".join(WORDS[i] for i in row) + "\n" for row in picks.tolist()))
    return path


def _tokenizer(folder, train_file):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train([str(train_file)], tokenizers.trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "[EOS]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                                eos_token="[EOS]", model_max_length=64)
    fast.save_pretrained(folder)
    return folder, len(fast)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("clm")
    train = _text(root / "train.txt", 48, 0)
    valid = _text(root / "valid.txt", 8, 1)
    tokenizer, vocab = _tokenizer(root / "tokenizer", train)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, tie_word_embeddings=True)
    config.save_pretrained(root / "config")
    source = upstream_scripts.script("transformers/run_clm.py")
    patched = upstream_scripts.patched(source, upstream_scripts.recipe("transformers Trainer"),
                                       root)
    # the test's one change of its own: compile the graphs eagerly (fast), not with Inductor
    patched.write_text(patched.read_text().replace(
        'opt_level="O2",', 'opt_level="O2", compiler="aot_eager",'))
    return root, {"own": source, "fxamp": patched}


def _run(inputs, which, output, monkeypatch, *extra):
    root, scripts = inputs
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
    args = ["run_clm.py", "--config_name", str(root / "config"),
            "--tokenizer_name", str(root / "tokenizer"), "--train_file", str(root / "train.txt"),
            "--validation_file", str(root / "valid.txt"), "--block_size", "16",
            "--cache_dir", str(root / "cache"), "--do_train", "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
            "--max_grad_norm", "1.0", "--logging_steps", "1", "--save_steps", "3",
            "--output_dir", str(output), "--use_cpu", "--seed", "0",
            "--report_to", "none", "--disable_tqdm", "true", *extra]
    module = upstream_scripts.load(scripts[which], f"run_clm_{which}")
    torch._dynamo.reset()
    with upstream_scripts.argv(args):
        module.main()
    return output


@pytest.fixture(scope="module",
                params=["--bf16", pytest.param("--fp16", marks=pytest.mark.slow)])
def runs(inputs, tmp_path_factory, request):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {which: _run(inputs, which, tmp_path_factory.mktemp(which), monkeypatch,
                            request.param)
                for which in ("own", "fxamp")}


def _losses(output):
    state = json.loads((output / "trainer_state.json").read_text())
    return [log["loss"] for log in state["log_history"] if "loss" in log]


def test_run_clm_trains_as_under_transformers_own_amp(runs):
    # O2 (16-bit weights, fp32 masters) against the Trainer's own torch.autocast (fp32
    # weights; on a CPU it scales no loss): losses of the 6 steps within 0.1 % (measured:
    # 1e-4 in bf16, 2e-5 in fp16, where no step overflowed)
    own, ours = _losses(runs["own"]), _losses(runs["fxamp"])
    states = {k: torch.load(runs[k] / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
              for k in runs}
    assert all("master_param" in s for s in states["fxamp"].values())  # fxamp's O2 optimizer
    assert not any("master_param" in s for s in states["own"].values())
    assert len(own) == len(ours) == STEPS
    for step, (a, b) in enumerate(zip(own, ours), 1):
        assert abs(a - b) <= 1e-3 * a, f"step {step}: loss {b} against transformers' {a}"


@pytest.mark.parametrize("which", ["own", "fxamp"])
def test_save_pretrained_round_trips_as_the_users_model(runs, which):
    # the script's trainer.save_model(), and each checkpoint: config.json says float32, the
    # safetensors hold float32, the tied lm_head is written once; from_pretrained gives the
    # model back in fp32, tied, with exactly the saved weights.
    for folder in (runs[which], runs[which] / "checkpoint-3"):
        config = json.loads((folder / "config.json").read_text())
        assert config["dtype"] == "float32", folder
        saved = safetensors_torch.load_file(folder / "model.safetensors")
        assert {v.dtype for v in saved.values()} == {torch.float32}, folder
        assert "lm_head.weight" not in saved and "transformer.wte.weight" in saved
    model = transformers.AutoModelForCausalLM.from_pretrained(runs[which])
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.transformer.wte.weight
    state = model.state_dict()
    saved = safetensors_torch.load_file(runs[which] / "model.safetensors")
    assert all(torch.equal(state[k], v) for k, v in saved.items())
