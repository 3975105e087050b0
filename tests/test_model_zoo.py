"""Real architectures (transformers configs, scaled down, no downloaded weights) through fxamp.

For GPT-2, Llama, ViT and ResNet in CI, and BERT and ConvNeXt marked slow (`pytest -m slow`), at
O1 and O2 in fp16 and bf16:
- training: forward, backward and STEPS steps of fxamp's AdamW with the opt level's loss scaler
  run, the loss after every applied step is within TOLERANCE of the fp32 run's, and the model
  compiles once (no recompile while training);
- graph breaks: fxamp adds none. torch._dynamo.explain of the model as fxamp prepares it (weights
  cast, boundary casts traced in) breaks exactly where the plain model does, and fxamp's backend
  transforms that many graphs;
- explain(): the report covers every graph, puts the matmuls in the low dtype, and counts the
  same graph breaks.

Tolerance (stated, and why): relative to the fp32 run's loss after each of 5 AdamW steps
(lr 1e-3), 1e-2 for bf16 and 2e-3 for fp16. bf16 rounds to 2**-9 (0.2 %) per op, fp16 to 2**-12
(0.02 %); the models' few dozen ops per layer partly cancel, and fp32 masters (O2) or fp32
weights (O1) keep the updates exact. Measured: at most 1.9e-3 (convnext, O2, bf16) and 4.6e-4
(resnet, O1, fp16), so the bounds leave 4-5x margin. The loss moves by 6-33 % over the 5 steps;
leaving the first parameter tensor out of the update moves it by 1.5e-2 to 1.1e-1 relative for
the embeddings and stems of five models, caught by both bounds, and by 3.2e-3 for ViT's CLS
token, caught by the fp16 bound only.
An fp16 step whose scaled gradients overflow at the initial scale (2**16) is skipped, as in
GradScaler (ViT and ConvNeXt skip their first step); the comparison is over applied steps.

Cost: the matrix compiles with compiler="aot_eager" (the same graphs fxamp hands on, without
Inductor: 3-5 s a case on 2 cores, ~90 s for the CI architectures); one case, GPT-2 at O1 in fp16,
goes through Inductor, the model and the optimizer step both (~35 s cold).
"""

import copy

import pytest
import torch

import fxamp
import fxamp.optim
import zoo
from fxamp.model.cast_model import boundary_forward, cast_model

STEPS, LR, MAX_SKIPS = 5, 1e-3, 2
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
CI_ARCHS = ("gpt2", "llama", "vit", "resnet")
SLOW_ARCHS = ("bert", "convnext")
ARCHS = [pytest.param(name, marks=() if name in CI_ARCHS else pytest.mark.slow)
         for name in (*CI_ARCHS, *SLOW_ARCHS)]
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
LEVELS = pytest.mark.parametrize("opt_level", ["O1", "O2"])
MATMULS = ("linear.default", "addmm.default", "mm.default", "bmm.default", "matmul.default",
           "conv2d.default", "convolution.default")


@pytest.fixture(scope="module")
def cases():
    return {}


@pytest.fixture(scope="module")
def fp32_losses():
    return {}


def _case(cases, name):
    if name not in cases:
        cases[name] = zoo.CASES[name]()
    return cases[name]


def _train(case, model, *, config=None, compile_step=False):
    """Losses of STEPS applied steps (skipped ones dropped), and how many were skipped."""
    master = bool(config and config.master_weights)
    opt = fxamp.optim.AdamW(model.parameters(), lr=LR, master_weights=master,
                            compile=compile_step)
    scaler = None if config is None else fxamp.optim.LossScaler(config.loss_scale)
    losses, skipped = [], 0
    while len(losses) < STEPS and skipped <= MAX_SKIPS:
        loss = case.loss(model(*case.inputs))
        (loss if scaler is None else scaler.scale(loss)).backward()
        opt.step(scaler)
        opt.zero_grad()
        if opt.last_step_skipped():  # the parameters did not move: this loss comes again
            skipped += 1
        else:
            losses.append(loss.item())
    return losses, skipped


def _reference(cases, fp32_losses, name):
    if name not in fp32_losses:
        case = _case(cases, name)
        fp32_losses[name] = _train(case, copy.deepcopy(case.model))[0]
    return fp32_losses[name]


def _check_tracks_fp32(cases, fp32_losses, name, opt_level, dtype, compiler):
    case = _case(cases, name)
    expected = _reference(cases, fp32_losses, name)
    model = fxamp.compile(copy.deepcopy(case.model), opt_level=opt_level, dtype=dtype,
                          compiler=compiler)
    losses, skipped = _train(case, model, config=fxamp.config_of(model),
                             compile_step=compiler == "inductor")
    assert skipped <= MAX_SKIPS and len(losses) == STEPS, (skipped, losses)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    assert rel <= TOLERANCE[dtype], (losses, expected)
    assert losses[-1] < losses[0]
    assert len(fxamp.backend_of(model).compiled_graphs) == 1  # no recompile while training


@pytest.mark.parametrize("name", ARCHS)
@LEVELS
@DTYPES
def test_training_tracks_fp32(cases, fp32_losses, name, opt_level, dtype):
    _check_tracks_fp32(cases, fp32_losses, name, opt_level, dtype, "aot_eager")


@pytest.mark.slow  # ~30 s; Inductor's training is in the default tier in tests/test_training.py
def test_training_through_inductor(cases, fp32_losses):
    _check_tracks_fp32(cases, fp32_losses, "gpt2", "O1", torch.float16, "inductor")


@pytest.mark.parametrize("name", ARCHS)
@LEVELS
def test_no_graph_breaks_added_and_explain_works(cases, name, opt_level):
    case = _case(cases, name)
    # Each torch._dynamo.explain resets Dynamo's caches; nothing compiled here outlives it.
    plain = torch._dynamo.explain(copy.deepcopy(case.model))(*case.inputs)
    config = fxamp.AmpConfig.from_opt_level(opt_level, dtype=torch.float16).resolve("cpu")
    prepared = copy.deepcopy(case.model)
    cast_model(prepared, config)
    with_fxamp = torch._dynamo.explain(boundary_forward(prepared, config))(*case.inputs)
    assert with_fxamp.graph_break_count == plain.graph_break_count, with_fxamp.break_reasons
    assert with_fxamp.graph_count == plain.graph_count

    report = fxamp.explain(case.model, *case.inputs, opt_level=opt_level, dtype=torch.float16)
    assert report.graph_breaks == plain.graph_break_count
    assert len(report.graphs) == plain.graph_count
    assert report.rows and str(report)
    assert report.casts_inserted > 0 or opt_level == "O2"  # O2 casts the weights instead
    matmuls = [r for r in report.rows if r.op in MATMULS]
    assert matmuls and all(r.output == "f16" for r in matmuls), [
        (r.op, r.module, r.output) for r in matmuls if r.output != "f16"]


def test_o2_keeps_the_model_output_type(cases):
    case = _case(cases, "gpt2")
    model = fxamp.compile(copy.deepcopy(case.model), opt_level="O2", compiler="aot_eager")
    output = model(*case.inputs)
    assert type(output) is type(case.model(*case.inputs))
    assert output.logits.dtype == torch.float32
