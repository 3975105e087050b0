"""Apex's surface: initialize's permissible invocations and conversions, scale_loss with one or
several losses and optimizers, master_params, the amp state dict and FP16_Optimizer.

Models are compiled with compiler="aot_eager" (same graphs, no Inductor) to keep this fast; the
compiled optimizer step is covered by the other files.
"""

import gc
import warnings
import weakref

import pytest
import torch
from optim_helpers import bit_identical, loss_of, make_mlp, snapshot

import fxamp.optim as fo
from fxamp.errors import ConfigError

pytest.importorskip("fxamp.backend")


# fp32 models (no per-op casts) with a dynamic scale: numerics comparable to an fp32 reference.
FP32_DYNAMIC = dict(opt_level="O0", loss_scale="dynamic")


def _init(models, opts, **kw):
    return fo.initialize(models, opts, compiler="aot_eager", **kw)


def _adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)


def test_permissible_invocations_mirror_their_inputs():
    m = make_mlp()
    model, opt = _init(m, _adamw(m))
    assert model is m and isinstance(opt, fo.AdamW)
    m = make_mlp()
    model, opts = _init(m, [_adamw(m)])
    assert model is m and isinstance(opts, list) and len(opts) == 1
    m1, m2 = make_mlp(), make_mlp(seed=1)
    models, opt = _init([m1, m2], _adamw(m1))
    assert models == [m1, m2] and isinstance(opt, fo.AdamW)
    m1, m2 = make_mlp(), make_mlp(seed=1)
    models, opts = _init([m1, m2], [_adamw(m1), torch.optim.SGD(m2.parameters(), lr=0.1)])
    assert [type(o) for o in opts] == [fo.AdamW, fo.SGD]
    m = make_mlp()
    assert _init(m, None) is m
    o = _adamw(m)
    assert fo.initialize(m, o, enabled=False) == (m, o)


@pytest.mark.parametrize("make_opt,expected", [
    (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.1), fo.Adam),
    (lambda m: torch.optim.Adam(m.parameters(), decoupled_weight_decay=True), fo.AdamW),
    (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True), fo.SGD),
    (lambda m: torch.optim.Adam(m.parameters(), amsgrad=True), fo.FP16_Optimizer),
    (lambda m: torch.optim.RMSprop(m.parameters()), fo.FP16_Optimizer),
])
def test_optimizers_convert_to_fused_or_wrapped(make_opt, expected):
    model = make_mlp()
    torch_opt = make_opt(model)
    hyper = {k: v for k, v in torch_opt.param_groups[0].items() if k in ("lr", "weight_decay")}
    _, opt = _init(model, torch_opt, opt_level="O2")
    assert type(opt) is expected
    assert model[0].weight.dtype == torch.bfloat16
    if expected is not fo.FP16_Optimizer:
        assert all(opt.param_groups[0][k] == v for k, v in hyper.items())
        assert all(b.master is not None for b in opt.buckets)


def _step(model, opt, step, loss_id=0, bad=None):
    # The overflow goes in inside the block, as in Apex's tests: the exit checks it.
    with fo.scale_loss(loss_of(model, step), opt, loss_id=loss_id) as scaled:
        scaled.backward()
        if bad is not None:
            model[0].weight.grad[0, 0] = bad


def test_scale_loss_trains_and_skips_at_o2():
    model = make_mlp()
    _, opt = _init(model, _adamw(model), opt_level="O2")
    first = loss_of(model, 0).item()
    for step in range(8):
        _step(model, opt, step)
        opt.step()
        opt.zero_grad()
    assert loss_of(model, 0).item() < first
    before, scale = snapshot(opt), opt.loss_scalers[0].get_scale()
    _step(model, opt, 8, bad=float("inf"))
    opt.step()
    assert bit_identical(snapshot(opt), before)
    assert opt.loss_scalers[0].get_scale() == scale / 2
    assert fo.amp_state_dict(opt) == {"loss_scaler0": {"loss_scale": scale / 2, "unskipped": 0}}


def test_two_losses_with_their_own_scalers():
    model = make_mlp()
    _, opt = _init(model, _adamw(model), num_losses=2, **FP32_DYNAMIC)
    ref = make_mlp()
    ref_opt = fo.AdamW(ref.parameters(), lr=1e-2, compile=False)
    s0, s1 = opt.loss_scalers
    s1.set_scale(2.0**10)
    for step in range(3):
        _step(model, opt, step, loss_id=0)
        _step(model, opt, step + 100, loss_id=1)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        (loss_of(ref, step) + loss_of(ref, step + 100)).backward()
        ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = snapshot(opt)
    _step(model, opt, 3, loss_id=0)
    _step(model, opt, 4, loss_id=1, bad=float("nan"))
    opt.step()
    assert opt.last_step_skipped() and bit_identical(snapshot(opt), before)
    assert (s0.get_scale(), s1.get_scale()) == (2.0**16, 2.0**9)
    assert fo.amp_state_dict(opt)["loss_scaler0"]["unskipped"] == 4
    fresh = _init(make_mlp(), _adamw(make_mlp()), num_losses=2)[1]  # any level
    fo.load_amp_state_dict(fresh, fo.amp_state_dict(opt))
    assert fresh.loss_scalers[1].get_scale() == 2.0**9


def test_one_loss_over_two_optimizers_skips_both_and_moves_the_scale_once():
    m1, m2 = make_mlp(), make_mlp(seed=1)
    (m1, m2), (o1, o2) = _init([m1, m2], [_adamw(m1), _adamw(m2)])
    before = snapshot(o1), snapshot(o2)
    # scale_loss folds both optimizers' gradients on exit, so inject during the backward
    m2[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    with fo.scale_loss(loss_of(m1, 0) + loss_of(m2, 0), [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    assert bit_identical(snapshot(o1), before[0]) and bit_identical(snapshot(o2), before[1])
    assert o1.loss_scalers[0].get_scale() == 2.0**15


def test_master_params_clip_like_fused_clipping():
    model = make_mlp()
    _, opt = _init(model, _adamw(model), **FP32_DYNAMIC)
    ref = make_mlp()
    ref_opt = fo.AdamW(ref.parameters(), lr=1e-2, max_grad_norm=0.05, compile=False)
    for step in range(4):
        _step(model, opt, step)
        norm = torch.nn.utils.clip_grad_norm_(fo.master_params(opt), 0.05)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        loss_of(ref, step).backward()
        ref_opt.step()
        torch.testing.assert_close(norm, ref_opt.grad_norm, rtol=1e-5, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fp16_optimizer_skips_clips_and_scales():
    model = make_mlp(torch.bfloat16)
    opt = fo.FP16_Optimizer(torch.optim.RMSprop(model.parameters(), lr=1e-3),
                            dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 2},
                            compile=False)
    assert opt.loss_scaler.rule.growth_interval == 2
    opt.backward(loss_of(model, 0))
    assert opt.clip_master_grads(1.0) > 0
    opt.step()
    before = [p.clone() for p in model.parameters()] + [s.master.clone() for s in opt._slots]
    opt.zero_grad()
    opt.backward(loss_of(model, 1), update_master_grads=False)
    model[0].weight.grad[0, 0] = float("inf")
    assert opt.clip_master_grads(1.0) == -1
    opt.step()
    assert opt.overflow and opt.loss_scale == 2.0**15
    assert bit_identical(list(model.parameters()) + [s.master for s in opt._slots], before)
    assert len(list(fo.master_params(opt))) == 4
    opt.loss_scale = 64.0
    assert opt.loss_scaler.get_scale() == 64.0


def test_an_apex_script_runs_with_import_fxamp_as_amp():
    """The one-line migration: Apex's own loop with `import fxamp as amp` tracks fp32 training.
    O1 on CPU runs the matmuls in bf16, and Adam's normalised steps (lr 1e-2) turn its rounding
    into a whole step where a gradient is near 0: weights within 3 steps (measured 2.0e-2),
    loss on an unseen batch within 1e-3 relative (measured 1.2e-4)."""
    import fxamp as amp

    model, ref = make_mlp(), make_mlp()
    model, optimizer = amp.initialize(model, _adamw(model), opt_level="O1",
                                      compiler="aot_eager")
    ref_opt = _adamw(ref)
    for step in range(10):
        optimizer.zero_grad()
        with amp.scale_loss(loss_of(model, step), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        ref_opt.zero_grad()
        loss_of(ref, step).backward()
        ref_opt.step()
    assert [p.dtype for p in amp.master_params(optimizer)] == [torch.float32] * 4
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=0, atol=3e-2)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(model, 99), loss_of(ref, 99), rtol=1e-3, atol=0)


def test_a_scaler_folded_by_two_optimizers_moves_once_after_the_last_step():
    # Note [Which scaler a step divides by] and ScaleRound (scale_round.py): both skip, and the
    # scale halves once, when the second optimizer has stepped.
    m1, m2 = make_mlp(), make_mlp(seed=1)
    o1, o2 = (fo.AdamW(m.parameters(), lr=1e-2, compile=False) for m in (m1, m2))
    scaler = fo.LossScaler("dynamic", compile=False)
    before = snapshot(o1), snapshot(o2)
    m2[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    scaler.scale(loss_of(m1, 0) + loss_of(m2, 0)).backward()
    o1.unscale_(scaler)
    o2.unscale_(scaler)
    o1.step()
    assert o1.last_step_skipped() and scaler.get_scale() == 2.0**16
    o2.step()
    assert o2.last_step_skipped() and scaler.get_scale() == 2.0**15
    assert bit_identical(snapshot(o1), before[0]) and bit_identical(snapshot(o2), before[1])


def test_set_loss_scalers_takes_loss_scalers_only():
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    assert opt.loss_scalers == ()
    with pytest.raises(ConfigError, match=r"AdamW.set_loss_scalers takes a non-empty list of "
                             r"fxamp.optim.LossScaler, not \(\)"):
        opt.set_loss_scalers([])
    wrapped = fo.FP16_Optimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1),
                                compile=False)
    shared = fo.LossScaler("dynamic", compile=False)
    wrapped.set_loss_scalers([shared])
    assert wrapped.loss_scaler is shared and wrapped.loss_scalers == (shared,)


def test_an_fxamp_optimizer_keeps_its_state_format_through_initialize():
    # initialize rebuilds the optimizer over the cast model; the state format it was given
    # used to be dropped without a word (a low_memory run silently kept 16 bytes/param).
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-3, state_format="low_memory", max_grad_norm=1.0)
    model, opt = fo.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                               compiler="aot_eager")
    assert opt.state_format == fo.StateFormat.from_preset("low_memory")
    assert opt.max_grad_norm == 1.0
    with fo.scale_loss(loss_of(model, 0), opt) as loss:
        loss.backward()
    opt.step()
    assert opt.state[next(model.parameters())]["exp_avg"].dtype == torch.int8


@pytest.mark.parametrize("level,overrides,match", [
    ("O3", {"cast_model_type": torch.bfloat16}, "opt_level O3 keeps none"),
    ("O2", {"cast_model_type": torch.float16}, "casts the model to float16; pass "
                                                "cast_model_type=torch.bfloat16")])
def test_a_state_format_the_cast_model_cannot_hold_is_refused_before_anything_changes(
        level, overrides, match):
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-3, state_format="low_memory")
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"optimizers\[0\] \(AdamW\) has state_format "
                                          r"master='int8_error'.*" + match):
        fo.initialize(model, opt, opt_level=level, compiler="aot_eager", **overrides)
    assert all(p.dtype == torch.float32 and torch.equal(p, w)
               for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("make_sched", [
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=5e-2, total_steps=8),
], ids=["lambda", "onecycle"])
def test_a_scheduler_built_before_initialize_drives_the_converted_optimizer(make_sched):
    # Apex's initialize returned the optimizer it was given, so a scheduler built on it before
    # kept driving it (Note [Schedulers of a replaced optimizer]): the same lrs and betas, and
    # the same weights, as a scheduler built on the optimizer initialize returns.
    # The optimizer it was built on never steps: torch's "lr_scheduler.step() before
    # optimizer.step()" warning must not fire (the fused one's steps count).
    def run(before):
        model = make_mlp()
        opt = _adamw(model)
        sched = make_sched(opt) if before else None
        _, opt = _init(model, opt, **FP32_DYNAMIC)
        sched = sched or make_sched(opt)
        seen = []
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*lr_scheduler.step")
            for step in range(4):
                loss_of(model, step).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
        return seen, snapshot(opt)

    seen, state = run(before=True)
    ref_seen, ref_state = run(before=False)
    assert seen == ref_seen and len(set(lr for lr, _ in seen)) == 4
    assert bit_identical(state, ref_state)


def test_an_fxamp_optimizer_rebuilt_over_the_cast_model_hands_over():
    # Built on the fp32 model, then initialize casts it (O2) and rebuilds the optimizer over
    # the 16-bit weights. Its scheduler (and whoever else holds it) keeps it alive: its flat
    # buffers must not be, and its step must not run silently on nothing.
    model = make_mlp()
    opt = fo.AdamW(model.parameters(), lr=1e-2, compile=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    buffers = [weakref.ref(t) for b in opt.buckets for t in (b.param, b.grad) if t is not None]
    model, new = _init(model, opt, opt_level="O2")
    gc.collect()
    assert all(ref() is None for ref in buffers)
    assert opt.handed_over and opt.buckets == [] and not opt.state and not new.handed_over
    with fo.scale_loss(loss_of(model, 0), new) as loss:
        loss.backward()
    new.step()
    sched.step()
    assert new.param_groups[0]["lr"] == 5e-3 and new.step_counts.tolist() == [1.0]
    with pytest.raises(ConfigError, match="this AdamW was replaced by the optimizer that "
                                          "fxamp.initialize .* built over the same param "
                                          "groups; step that one"):
        opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_replaced_torch_optimizer_refuses_to_step_before_changing_anything(level):
    # Apex's initialize patched the optimizer it was given; fxamp returns a new one. A script
    # that keeps stepping its own variable would update the parameters a second time with
    # fresh moments (no masters at O2): refused, naming the fix, with nothing changed.
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, new = _init(model, opt, opt_level=level)
    with fo.scale_loss(loss_of(model, 0), new) as loss:
        loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match="this AdamW was replaced by the optimizer that "
                                          "fxamp.initialize .* step that one"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state
    new.step()  # the returned one steps
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
