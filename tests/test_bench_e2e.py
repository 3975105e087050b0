"""The end-to-end benchmark's recipes take a training step on each of its models (tiny sizes,
aot_eager: no Inductor), so that a recipe broken for one model fails here and not on the GPU
machine (the GPU report's CPU smoke runs only in the slow tier)."""

import pytest
import torch

from benchmarks import bench_e2e, workloads


@pytest.mark.parametrize("model", sorted(workloads.WORKLOADS))
@pytest.mark.parametrize("recipe", bench_e2e.RECIPES)
def test_every_recipe_steps_on_every_model(model, recipe):
    work = workloads.WORKLOADS[model](*workloads.SIZES["tiny"][model])
    built = bench_e2e.build(recipe, work.make_model, torch.bfloat16, torch.device("cpu"),
                            compiler="aot_eager")
    before = [p.detach().clone() for p in built.model.parameters()]
    built.step(work.inputs, work.targets)
    after = list(built.model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, a.detach().to(b.dtype)) for b, a in zip(before, after))
