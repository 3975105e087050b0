"""The real training scripts users start from, patched with the recipes docs/integrations.md
shows, run in this process.

The scripts are not in any package (timm's wheel and sdist leave out `train.py`, transformers'
leave out `examples/`) and nothing is downloaded at test time, so a test reads them from
`$FXAMP_UPSTREAM_SCRIPTS` (default: `.upstream/` in the repository, git-ignored), laid out as
the upstream repositories are:

    .upstream/timm/train.py                      pytorch-image-models, train.py
    .upstream/transformers/run_clm.py            transformers, examples/pytorch/language-modeling

and skips with that instruction when one is missing. The versions tested are the ones named in
docs/integrations.md ("Scripts tested").
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
from typing import Iterator

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FOLDER = pathlib.Path(os.environ.get("FXAMP_UPSTREAM_SCRIPTS", REPO / ".upstream"))


def script(relative: str) -> pathlib.Path:
    """The upstream script at `relative` under FOLDER; the test skips without it."""
    path = FOLDER / relative
    if not path.is_file():
        pytest.skip(f"{path} is missing: put the upstream script there (or point "
                    "$FXAMP_UPSTREAM_SCRIPTS at a folder holding it); see "
                    "tests/integrations/upstream_scripts.py")
    return path


def recipe(section: str) -> str:
    """The ```diff block of docs/integrations.md's section `section` (a `## ` heading)."""
    page = (REPO / "docs" / "integrations.md").read_text()
    body = page.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^```diff\n(.*?)^```\n", body, re.S | re.M)
    assert len(found) == 1, f"docs/integrations.md '{section}' has {len(found)} diff blocks"
    return found[0]


def patched(source: pathlib.Path, diff: str, folder: pathlib.Path) -> pathlib.Path:
    """`source` copied into `folder` with `diff` applied as `patch` applies it (exactly: no
    fuzz), so a recipe that no longer applies fails here."""
    target = folder / source.name
    target.write_text(source.read_text())
    done = subprocess.run(["patch", "--fuzz=0", "--no-backup-if-mismatch", str(target)],
                          input=diff, text=True, capture_output=True)
    assert done.returncode == 0, f"the recipe does not apply to {source}:\n{done.stdout}{done.stderr}"
    return target


def load(path: pathlib.Path, name: str):
    """Import the script at `path` as module `name` (its `main()` is not run)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def argv(args: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = args
    try:
        yield
    finally:
        sys.argv = saved
