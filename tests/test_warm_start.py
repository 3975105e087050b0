"""Warm starts: a second process compiles fxamp's graphs (the model's forward and backward at O2,
the optimizer's step) from Inductor's FX graph cache and AOTAutograd's cache, as torch.compile's
own graphs do. Each process runs two training steps of a tiny model with a fresh shared
TORCHINDUCTOR_CACHE_DIR and prints the cache counters."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = """
import json
import torch
import torch.nn.functional as F
import fxamp
import fxamp.optim
from fxamp import _compat

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
model = fxamp.compile(model, opt_level="O2")
opt = fxamp.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
scaler = fxamp.optim.LossScaler()
x, y = torch.randn(4, 8), torch.randn(4, 4)
for _ in range(2):
    scaler.scale(F.mse_loss(model(x).float(), y)).backward()
    opt.step(scaler)
    opt.zero_grad()
print(json.dumps(_compat.compile_cache_counters()))
"""


def _train_in_a_process(cache_dir):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_fxamps_graphs_from_the_caches(tmp_path):
    cold = _train_in_a_process(tmp_path)
    warm = _train_in_a_process(tmp_path)
    # forward + backward of the model, and the optimizer's graphs: all compiled, then all hit
    assert cold["fxgraph_cache_miss"] >= 3 and cold["fxgraph_cache_hit"] == 0, cold
    assert cold["fxgraph_cache_bypass"] == cold["autograd_cache_bypass"] == 0, cold
    assert warm["fxgraph_cache_hit"] == cold["fxgraph_cache_miss"], (cold, warm)
    assert warm["fxgraph_cache_miss"] == warm["fxgraph_cache_bypass"] == 0, warm
    assert warm["autograd_cache_hit"] == cold["autograd_cache_miss"] >= 2, (cold, warm)
    assert warm["autograd_cache_miss"] == warm["autograd_cache_bypass"] == 0, warm
