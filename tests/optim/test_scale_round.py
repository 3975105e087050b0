"""The scaler's per-step bookkeeping as named states (scale_round.py): the transitions alone,
then as `scale_loss` exits and folds with several optimizers drive them."""

import pytest
import torch
from optim_helpers import loss_of, make_mlp

import fxamp.optim as fo
from fxamp.optim.scaling.scale_round import ExitState, FoldState, ScaleRound

pytest.importorskip("fxamp.backend")


def test_transitions():
    r, a, b = ScaleRound(), object(), object()
    assert (r.exit_state, r.fold_state) == (ExitState.NONE, FoldState.IDLE)
    r.record_exit((a,))
    assert r.exit_state is ExitState.PENDING and r.exit_includes(a) and not r.exit_includes(b)
    assert r.end_exit() == (a,) and r.exit_state is ExitState.NONE and r.end_exit() == ()
    r.join(a), r.join(b), r.join(a)
    assert r.members == [a, b] and r.fold_state is FoldState.AWAITING_STEPS
    assert not r.leave(a) and r.fold_state is FoldState.AWAITING_STEPS
    assert r.leave(b) and r.fold_state is FoldState.IDLE


def test_folds_by_two_optimizers_move_the_scale_when_the_last_leaves():
    m1, m2 = make_mlp(), make_mlp(seed=1)
    o1, o2 = (fo.AdamW(m.parameters(), lr=1e-2, compile=False) for m in (m1, m2))
    scaler = fo.LossScaler("dynamic", compile=False)
    m2[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    scaler.scale(loss_of(m1, 0) + loss_of(m2, 0)).backward()
    o1.unscale_(scaler)
    o2.unscale_(scaler)
    assert scaler.scale_round.fold_state is FoldState.AWAITING_STEPS
    o1.step()
    assert scaler.scale_round.fold_state is FoldState.AWAITING_STEPS
    assert scaler.get_scale() == 2.0**16  # o2 has not stepped: the scale waits
    o2.step()
    assert scaler.scale_round.fold_state is FoldState.IDLE and scaler.get_scale() == 2.0**15
    assert not scaler.scale_round.found.item()  # the next round starts clear


@pytest.mark.parametrize("both", [False, True], ids=["one-optimizer", "two-optimizers"])
def test_a_deferred_exit_is_pending_until_a_step_takes_or_resolves_it(both):
    models = [make_mlp(), make_mlp(seed=1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = fo.initialize(models, opts, compiler="aot_eager", opt_level="O0",
                                 loss_scale="dynamic")
    used = opts if both else opts[:1]
    scaler = opts[0].loss_scalers[0]
    loss = sum(loss_of(m, 0) for m in models[:len(used)])
    with fo.scale_loss(loss, used, unscale_on_exit=False) as scaled:
        scaled.backward()
    assert scaler.scale_round.exit_state is ExitState.PENDING
    assert all(scaler.scale_round.exit_includes(o) for o in used)
    opts[0].step()  # alone in the exit: its fused step takes it; else resolved first
    assert scaler.scale_round.exit_state is ExitState.NONE
    assert opts[1].folding.folds_nothing() is not both  # the resolution folded opts[1]'s
