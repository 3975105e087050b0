"""The compiled step: hyperparameter changes never recompile, and the graphs do not depend on
the number of parameter tensors (on a GPU, no host synchronisation: tests/gpu/test_cuda_optim.py)."""

import torch
from optim_helpers import make_mlp, train

import fxamp.optim as fo


def _compiles():
    counters = torch._dynamo.utils.counters
    return counters["frames"]["ok"], counters["stats"]["unique_graphs"]


def _schedule(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=60)


def test_lr_schedule_and_hyperparameter_changes_do_not_recompile():
    ours, ref = make_mlp(), make_mlp()
    opt = fo.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched, ref_sched = _schedule(opt), _schedule(ref_opt)  # OneCycle moves lr and beta1
    train(ours, opt, 1, schedule=sched)  # compile (or reuse) the step
    train(ref, ref_opt, 1, schedule=ref_sched)
    before = _compiles()
    for group in (opt.param_groups[0], ref_opt.param_groups[0]):
        group["weight_decay"], group["eps"] = 0.05, 1e-6
    train(ours, opt, 50, schedule=sched, start=1)
    train(ref, ref_opt, 50, schedule=ref_sched, start=1)
    assert _compiles() == before
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _stack(n, width=4):
    torch.manual_seed(n)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])


def test_graphs_do_not_grow_with_the_number_of_tensors():
    scaler = fo.LossScaler()

    def step(model):
        opt = fo.AdamW(model.parameters(), max_grad_norm=1.0)
        width = model[0].in_features
        scaler.scale(model(torch.randn(2, width)).square().sum()).backward()
        opt.step(scaler)
        return len(opt.buckets)

    # A static graph for the first size, then dynamic-size ones; the prologue's reduction
    # takes a second dynamic graph above 4096 elements (an Inductor heuristic guard).
    assert [step(_stack(n)) for n in (2, 5, 40)] == [1, 1, 1]
    before = _compiles()
    assert step(_stack(150, width=32)) == 1  # 300 tensors, one flat bucket, no new graph
    assert _compiles() == before

