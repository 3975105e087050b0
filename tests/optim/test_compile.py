"""The compiled step: hyperparameter changes never recompile, and the graphs do not depend on
the number of parameter tensors (on a GPU, no host synchronisation: tests/gpu/test_cuda_optim.py;
one compile per kind, shared by every optimizer: test_compile_once.py)."""

import pytest
import torch
from optim_helpers import make_mlp, train

import fxamp.optim as fo
from fxamp.optim.functional import fused_step


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

    def captured_ops(model):
        fused_step.forget_compiled()  # each traces its own graphs, to compare them
        opt = fo.AdamW(model.parameters(), max_grad_norm=1.0)
        width = model[0].in_features
        scaler.scale(model(torch.randn(2, width)).square().sum()).backward()
        before = torch._dynamo.utils.counters["stats"]["calls_captured"]
        opt.step(scaler)
        assert len(opt.buckets) == 1
        return torch._dynamo.utils.counters["stats"]["calls_captured"] - before

    # 4 or 300 parameter tensors in one flat bucket make graphs of the same size (and one
    # kind: Note [One compiled step per kind]).
    assert captured_ops(_stack(2)) == captured_ops(_stack(150, width=32)) > 0


def _twelve_cases():
    """(model, optimizer, scaler factory) for twelve optimizers of different structures and
    sizes: four rules, fp32 / bf16 with and without masters, one and two groups, clipping."""
    cases = []
    for i in range(12):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        model = _stack(1 + i % 3, width=3 + i).to(dtype)
        rule = (fo.AdamW, fo.Adam, fo.SGD, fo.LAMB)[i % 4]
        kw = dict(momentum=0.9) if rule is fo.SGD else {}
        clip = 1.0 if i % 3 == 0 else None

        def make(model, compile, rule=rule, kw=kw, clip=clip, i=i):
            params = model.parameters() if i % 4 else [
                {"params": [model[0].weight]},
                {"params": [model[0].bias, *model[1:].parameters()], "lr": 3e-3}]
            return rule(params, lr=1e-2, max_grad_norm=clip, master_weights=i % 5 != 1,
                        compile=compile, **kw)

        cases.append((model, make, ("apex", "torch", "deepspeed")[i % 3]))
    return cases


@pytest.mark.slow  # ~30 s: twelve compiled steps in one process (the others here compile a few)
def test_twelve_optimizers_and_their_loss_scalers_compile_in_one_process():
    # Dynamo's default recompile limit (8 per code object; an error under fullgraph=True) is
    # never reached: each kind of step and of loss-scale update has a Dynamo cache of its own
    # (Note [One compiled step per kind]); every compiled step matches the eager one.
    import copy

    for model, make, semantics in _twelve_cases():
        eager_model = copy.deepcopy(model)
        pairs = [(m, make(m, compile), fo.LossScaler(semantics=semantics, growth_interval=2,
                                                    compile=compile))
                 for m, compile in ((model, True), (eager_model, False))]
        for step in range(3):
            x = torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(step))
            for m, opt, scaler in pairs:
                opt.zero_grad()
                scaler.scale(m(x.to(m[0].weight.dtype)).float().square().mean()).backward()
                if step == 1:
                    m[0].weight.grad[0, 0] = float("inf")
                opt.step(scaler)
        (_, compiled, scaler), (_, eager, eager_scaler) = pairs
        assert scaler.get_scale() == eager_scaler.get_scale()
        assert compiled.last_step_skipped() is eager.last_step_skipped() is False
        for a, b in zip(model.parameters(), eager_model.parameters()):
            tol = {} if a.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)  # bf16: 1 ulp
            torch.testing.assert_close(a, b, **tol)



def test_ten_loss_scalers_with_different_rules_update_in_one_process():
    # Each kind of rule has its own compiled update (Note [One compiled step per kind]); ten
    # rules would be ten entries on one shared function, past the limit of 8.
    rules = [dict(semantics=s, growth_interval=g) for s in ("apex", "torch", "deepspeed")
             for g in (1, 2, 3)] + [dict(semantics="apex", growth_interval=1, max_loss_scale=4.0)]
    overflows = [False, True, False, False, True, False, False]
    for rule in rules:
        compiled, eager = fo.LossScaler(**rule), fo.LossScaler(**rule, compile=False)
        for overflow in overflows:
            for scaler in (compiled, eager):
                scaler.update(torch.tensor(overflow))
        assert compiled.state_dict() == eager.state_dict(), rule


def _prologue_graph(opt, scaler):
    """The ATen graph of `opt`'s prologue for its next step, traced (not run) with make_fx."""
    from fxamp._compat import make_fx
    from fxamp.optim.functional import fused_step

    state = opt._device_state
    grads = state.grads()
    step_state = fused_step.StepState(state.hyper, state.step_count, opt.found_inf,
                                      opt.grad_norm)
    scaler_state = scaler.state_tensors(state.device)

    def prologue(*flat):
        return fused_step.prologue(list(flat[:len(grads)]), step_state, scaler_state, None,
                                   coefs_fn=opt.algorithm.coefs, check=True,
                                   max_norm=opt.max_grad_norm, rule=scaler.rule)

    return make_fx(prologue)(*grads)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_every_per_step_scalar_is_one_element_read_after_the_reduction(clip):
    # Note [One kernel for the per-step scalars]: on CUDA, Inductor computes the prologue's
    # scalars in the reduction's last kernel only if each has the reduction's output shape (one
    # element) and reads its result; a scalar of the hyperparameters alone, or a stacked [G, K]
    # tensor, was a kernel of its own (8 launches per step on an H100).
    model = _stack(3)
    opt = fo.AdamW(model.parameters(), max_grad_norm=clip, compile=False)
    scaler = fo.LossScaler(compile=False)
    scaler.scale(model(torch.randn(2, 4)).square().sum()).backward()
    opt.step(scaler)  # creates the device state
    graph = _prologue_graph(opt, scaler).graph
    reductions = [n for n in graph.nodes if n.op == "call_function"
                  and n.target.__name__.split(".")[0] in ("any", "all", "sum")]
    assert reductions

    def reads_reduction(node, seen=None):
        seen = set() if seen is None else seen
        if node in reductions:
            return True
        seen.add(node)
        return any(reads_reduction(a, seen) for a in node.all_input_nodes if a not in seen)

    (rows,) = [n.args[0] for n in graph.nodes if n.op == "output"]
    (outputs,) = rows  # one param group
    assert len(outputs) == 8 + 3  # AdamW's 8 columns, the step, the gradient scale, the skip
    for out in outputs:
        assert out.meta["val"].dim() == 0, out
        assert reads_reduction(out), f"{out} does not read the overflow/norm reduction"
