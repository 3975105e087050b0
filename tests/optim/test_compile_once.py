"""One compiled step per kind (Note [One compiled step per kind] in docs/design.md).

A second optimizer, loss scaler or master-gradient gathering of a kind already compiled in the
process compiles nothing: no new Dynamo graph, no AOTAutograd or Inductor compile, not even a
cache look-up (`_compat.compile_cache_counters` unchanged), whatever its sizes, number of
tensors or hyperparameters; and it still matches torch.optim (fp32, 3 steps, rtol 1e-5, atol
1e-6, as tests/optim/test_numerics.py). A new process finds the graphs in Inductor's on-disk
caches, for other sizes too. The first optimizer of each kind compiles with Inductor (seconds
on a CPU); the kinds no other test of the suite compiles are in the slow tier.
"""

import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Optional

import pytest
import torch
from optim_helpers import snapshot

import fxamp.optim as fo
from fxamp import _compat

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _compiles() -> dict:
    return {"dynamo_graphs": _compat.dynamo_counters["stats"]["unique_graphs"],
            **_compat.compile_cache_counters()}


def _new_compiles(before: dict) -> dict:
    return {k: v - before[k] for k, v in _compiles().items() if v != before[k]}


def _mlp(widths, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    return torch.nn.Sequential(*layers).to(dtype)


@dataclasses.dataclass
class Case:
    """A first optimizer over `first` (widths), then a second over `second`; the second gets
    other hyperparameters (`second_kw`), which must not matter either."""

    rule: str  # AdamW or SGD, fxamp's and torch.optim's name alike
    first: list
    second: list
    kw: dict
    second_kw: dict
    split: bool = False  # two param groups: weights with decay, biases without and another lr
    add_group: bool = False  # the biases come through add_param_group after construction
    max_grad_norm: Optional[float] = None


_ADAMW = dict(lr=1e-2, weight_decay=0.01)
_ADAMW2 = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
_SGD = dict(lr=1e-2, momentum=0.9)
_SGD2 = dict(lr=5e-2, momentum=0.5, dampening=0.1, weight_decay=1e-3)
CASES = {
    "identical model": Case("AdamW", [8, 16, 4], [8, 16, 4], _ADAMW, _ADAMW),
    "other sizes": Case("AdamW", [8, 16, 4], [12, 40, 5], _ADAMW, _ADAMW2),
    "other tensor counts": Case("AdamW", [8, 16, 4], [6, 9, 9, 9, 9, 9, 3], _ADAMW, _ADAMW2),
    "clipping, other max_grad_norm": Case("AdamW", [8, 16, 4], [12, 40, 5], _ADAMW, _ADAMW2,
                                          max_grad_norm=1.0),
    "SGD with momentum": Case("SGD", [8, 16, 4], [12, 40, 24, 5], _SGD, _SGD2),
    "several param groups": Case("AdamW", [8, 16, 4], [12, 40, 24, 5], _ADAMW, _ADAMW2,
                                 split=True),
    "add_param_group": Case("AdamW", [8, 16, 4], [12, 40, 24, 5], _ADAMW, _ADAMW2,
                            split=True, add_group=True),
}


def _groups(model, split):
    if not split:
        return [{"params": list(model.parameters())}]
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
             "lr": 3e-3}]


def _build(case, widths, kw, seed):
    """(model, fxamp optimizer, fp32 reference parameters, torch.optim on them)."""
    model = _mlp(widths, seed=seed)
    ref = copy.deepcopy(model)
    groups, ref_groups = _groups(model, case.split), _groups(ref, case.split)
    cls, ref_cls = getattr(fo, case.rule), getattr(torch.optim, case.rule)
    first = groups if not case.add_group else groups[:1]
    opt = cls(first, max_grad_norm=case.max_grad_norm, **kw)
    ref_opt = ref_cls(ref_groups if not case.add_group else ref_groups[:1], **kw)
    if case.add_group:
        opt.add_param_group(groups[1])
        ref_opt.add_param_group(ref_groups[1])
    return model, opt, ref, ref_opt


def _train(model, opt, scaler, ref, ref_opt, steps, max_grad_norm):
    for step in range(steps):
        x = torch.randn(16, model[0].in_features, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scale = scaler.get_scale()  # a host read, for the reference only
        scaler.scale(model(x).square().mean()).backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            r.grad = p.grad / scale  # the same gradients, unscaled (the scale is a power of 2)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        opt.step(scaler)
        ref_opt.step()


@pytest.mark.parametrize("name", list(CASES))
def test_a_second_optimizer_of_a_kind_compiles_nothing_and_matches_torch(name):
    case = CASES[name]
    scaler = fo.LossScaler()
    model, opt, ref, ref_opt = _build(case, case.first, case.kw, seed=0)
    _train(model, opt, scaler, ref, ref_opt, 2, case.max_grad_norm)  # compiles (or reuses)
    before = _compiles()
    model, opt, ref, ref_opt = _build(case, case.second, case.second_kw, seed=1)
    _train(model, opt, fo.LossScaler(init_scale=2.0**10), ref, ref_opt, 3, case.max_grad_norm)
    assert _new_compiles(before) == {}
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_changed_max_grad_norm_and_lr_schedule_compile_nothing():
    case = CASES["clipping, other max_grad_norm"]
    model, opt, ref, ref_opt = _build(case, case.second, case.kw, seed=2)
    scaler = fo.LossScaler()
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10)
                 for o in (opt, ref_opt)]
    _train(model, opt, scaler, ref, ref_opt, 1, case.max_grad_norm)
    before = _compiles()
    opt.max_grad_norm = 0.01  # a fill of the device copy at the next step
    for step in range(4):
        _train(model, opt, scaler, ref, ref_opt, 1, 0.01)
        for s in schedules:
            s.step()
    assert _new_compiles(before) == {}
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_loss_scaler_with_other_numbers_compiles_nothing():
    def run(scaler, flags):
        for overflow in flags:
            scaler.update(torch.tensor(overflow))  # fxamp's `update(found_inf)`: advance
        return scaler

    flags = [False, True, False, False]
    run(fo.LossScaler(growth_interval=2), flags)
    before = _compiles()
    other = run(fo.LossScaler(init_scale=2.0**8, growth_interval=3), flags)
    eager = run(fo.LossScaler(init_scale=2.0**8, growth_interval=3,
                              compile=False), flags)
    assert _new_compiles(before) == {}
    assert other.state_dict() == eager.state_dict()


@pytest.mark.slow
def test_low_memory_state_format_of_a_second_optimizer_compiles_nothing():
    def run(widths, seed, lr, compile=True):
        model = _mlp(widths, torch.bfloat16, seed)
        opt = fo.AdamW(model.parameters(), lr=lr, state_format="low_memory", compile=compile)
        scaler = fo.LossScaler(compile=compile)
        for step in range(3):
            x = torch.randn(16, widths[0], generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            scaler.scale(model(x.bfloat16()).float().square().mean()).backward()
            opt.step(scaler)
        return snapshot(opt)

    run([8, 16, 4], 0, 1e-2)
    before = _compiles()
    compiled = run([12, 40, 24, 5], 1, 3e-3)
    assert _new_compiles(before) == {}
    # Against the same functions run eagerly; as test_state_format's
    # test_compiled_step_matches_the_eager_functions (1-ulp differences of sqrt move a code
    # across a rounding boundary now and then).
    for ours, eager in zip(compiled, run([12, 40, 24, 5], 1, 3e-3, compile=False)):
        assert ours.dtype == eager.dtype and (ours == eager).double().mean() >= 0.95


@pytest.mark.slow
def test_master_params_and_larc_of_a_second_optimizer_compile_nothing():
    def run(widths, seed, lr):
        model = _mlp(widths, seed=seed)
        opt = fo.LARC(fo.SGD(model.parameters(), lr=lr, momentum=0.9), trust_coefficient=0.02)
        ref_model = copy.deepcopy(model)
        ref = fo.LARC(fo.SGD(ref_model.parameters(), lr=lr, momentum=0.9, compile=False),
                      trust_coefficient=0.02)
        for m, o in ((model, opt), (ref_model, ref)):
            x = torch.randn(16, widths[0], generator=torch.Generator().manual_seed(seed))
            m(x).square().mean().backward()
            grads = [p.grad for p in fo.master_params(o)]  # the gathering, then its step
            torch.nn.utils.clip_grad_norm_(list(fo.master_params(o)), 0.5)
            o.step()
            assert all(g is not None for g in grads)
        return model, ref_model

    run([8, 16, 4], 0, 1e-2)
    before = _compiles()
    model, ref_model = run([12, 40, 24, 5], 1, 3e-2)
    assert _new_compiles(before) == {}
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


_STEP_IN_A_PROCESS = """
import json, sys
import torch
import fxamp.optim as fo
from fxamp import _compat

widths = json.loads(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
opt, scaler = fo.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0), fo.LossScaler()
for _ in range(2):
    scaler.scale(model(torch.randn(4, widths[0])).square().mean()).backward()
    opt.step(scaler)
    opt.zero_grad()
print(json.dumps(_compat.compile_cache_counters()))
"""


def _step_in_a_process(cache_dir, widths):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _STEP_IN_A_PROCESS, json.dumps(widths)],
                          env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_new_process_finds_the_step_in_inductors_caches_for_other_sizes(tmp_path):
    cold = _step_in_a_process(tmp_path, [8, 16, 4])
    warm = _step_in_a_process(tmp_path, [12, 40, 24, 5])  # other sizes, other tensor count
    assert cold["fxgraph_cache_miss"] >= 2 and cold["fxgraph_cache_hit"] == 0, cold
    # No Inductor compile: every graph's kernels come from the FX graph cache.
    assert warm["fxgraph_cache_hit"] == cold["fxgraph_cache_miss"], (cold, warm)
    assert warm["fxgraph_cache_miss"] == 0, warm
    assert warm["fxgraph_cache_bypass"] == warm["autograd_cache_bypass"] == 0, warm
    looked_up = warm["autograd_cache_hit"] + warm["autograd_cache_miss"]
    assert looked_up == cold["autograd_cache_miss"] >= 2, (cold, warm)
    # torch 2.14's AOTAutograd cache keys a size that enters a graph as an int input (the
    # update's number of blocks) by its value: another size runs AOTAutograd again (its
    # trace, not Inductor); 2.11 and 2.13 find every graph.
    assert warm["autograd_cache_hit"] >= (1 if _compat.TORCH_VERSION >= (2, 14) else 2), warm
