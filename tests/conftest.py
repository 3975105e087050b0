"""Shared by every test folder.

pytest puts the folder of a conftest.py outside a package on sys.path, so the helper modules
here (zoo.py, doc_snippets.py, autocast_lists.py) import by name from tests/ and its subfolders.

# Note [One thread per test worker]
The default suite runs in pytest-xdist workers, one per core (`-n auto --dist loadfile` in
pyproject.toml: a file's tests stay together in one worker, in order, with its module-scoped
fixtures). The tests' models are small, so a second OpenMP thread per worker buys little and,
with every core already running a worker, costs much: a parallel region waits for its
descheduled thread a scheduler tick at a time. So a worker runs torch on one thread and
compiles Inductor's kernels in its own process (no pool of compile workers per worker), unless
the environment says otherwise. This runs before any test module imports torch.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
