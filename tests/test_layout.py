"""The layout rules of issue 26, as tests: modules of at most 300 lines, packages of at most 12
modules (the package root at most 14), module docstrings of at most 25 lines, no reference to a
file outside the repository, every `Note [...]` that something points to written down (in the
code or in docs/), and the invariants the layout depends on held by code, not by a comment."""

from __future__ import annotations

import ast
import collections
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = REPO / "fxamp"
MAX_LINES = 300
MAX_MODULES = 12
MAX_ROOT_MODULES = 14


def _text_files(*roots: str):
    """The .py and .md files under `roots` (folders or files, relative to the repository)."""
    for root in roots:
        path = REPO / root
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.suffix in (".py", ".md")
                        and "__pycache__" not in p.parts)


def test_no_module_over_300_lines():
    long = {str(p.relative_to(REPO)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


MAX_MODULE_DOCSTRING = 25


def test_module_docstrings_are_short():
    # Essays ahead of the code: what a module is for in a few lines; the long why is a note in
    # docs/design.md that the module points to in one line.
    long = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        body = ast.parse(p.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > MAX_MODULE_DOCSTRING:
                long[str(p.relative_to(REPO))] = n
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING} lines: {long}"


def test_packages_are_small():
    counts = {str(d.relative_to(REPO)): len(list(d.glob("*.py")))
              for d in [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir())]
              if (d / "__init__.py").exists()}
    assert counts["fxamp"] <= MAX_ROOT_MODULES, (
        f"fxamp/ holds {counts['fxamp']} modules, at most {MAX_ROOT_MODULES}: move some into a "
        "sub-package")
    big = {d: n for d, n in counts.items() if d != "fxamp" and n > MAX_MODULES}
    assert not big, f"sub-packages over {MAX_MODULES} modules (its __init__ counted): {big}"


# A path that leaves the repository: up and out of it, a machine's own folders, the reference
# notes of the workplace this was written in, or an upstream project's source tree (cite the
# project by name, its module by its dotted name, or a public URL instead).
OUTSIDE = re.compile(r"(?<![\w.])\.\./|/work/|/home/|shared/reference|(?<![\w./])apex/amp/|"
                     r"(?<![\w./])torch/testing/_internal")


def test_no_reference_to_a_file_outside_the_repository():
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
             for p in _text_files("fxamp", "docs", "tests", "examples", "benchmarks", "README.md")
             if p != pathlib.Path(__file__).resolve()
             for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_the_outside_pattern_catches_what_it_should():
    # The rule above must fail on the references issue 26 found, and pass their replacements.
    for bad in ["(../../../shared/reference/MEASURED_HERE.md)", "see /work/venv-2.11",
                "Apex (apex/amp/rnn_compat.py)", "torch/testing/_internal/autocast_test_lists.py"]:
        assert OUTSIDE.search(bad), bad
    for good in ["fxamp/optim/functional/codecs.py", "docs/design.md", "Apex's amp.rnn_compat",
                 "https://github.com/NVIDIA/apex", "torch.testing._internal.autocast_test_lists"]:
        assert not OUTSIDE.search(good), good


# A note is written where its name starts a line (after a comment's `#`, a docstring's quotes or
# a Markdown heading's `#`s) and is followed by `:` or ends the line. Anything else that says
# `Note [name]` points to it. Names wrap across lines in comments and docstrings, and across the
# pieces of a string literal split over lines.
_DEFINED = re.compile(r"^[ \t]*(?:#+[ \t]*|\"\"\")?Note \[([^\]\n]*)\](?::|[ \t]*$)", re.M)
_NAMED = re.compile(r"Note\s\[([^\]]*)\]")


def _notes() -> tuple[set[str], dict[str, set[str]]]:
    defined, named = set(), collections.defaultdict(set)
    for path in _text_files("fxamp", "docs", "tests", "examples", "benchmarks", "README.md"):
        if path == pathlib.Path(__file__).resolve():
            continue  # its examples below name no real note
        text = path.read_text()
        defined.update(" ".join(m.group(1).split()) for m in _DEFINED.finditer(text))
        joined = re.sub(r"[\"']\n[ \t]*[\"']", "", text)  # "... stay "\n  "by default]"
        joined = re.sub(r"\n[ \t]*(#+[ \t]*)?", "\n", joined)
        for m in _NAMED.finditer(joined):
            named[" ".join(m.group(1).split())].add(str(path.relative_to(REPO)))
    return defined, named


def test_every_note_pointed_to_is_written_down():
    defined, named = _notes()
    missing = {name: sorted(where) for name, where in named.items() if name not in defined}
    assert not missing, ("notes pointed to but written nowhere (a cut-short name, or a note "
                         f"that was moved without its pointers): {missing}")


def test_design_notes_in_docs_are_named_like_the_pointers():
    # docs/design.md holds the long notes; each heading is a note some code points to.
    defined, named = _notes()
    headings = re.findall(r"^#+ Note \[([^\]]*)\]", (REPO / "docs/design.md").read_text(), re.M)
    assert headings
    unused = [h for h in headings if not (named[h] - {"docs/design.md"})]
    assert not unused, f"notes in docs/design.md that nothing points to: {unused}"


@pytest.mark.parametrize("text,defines", [
    ("# Note [A name]\n", True),
    ('"""Note [A name]: why.\n', True),
    ("## Note [A name]\n", True),
    ("# see Note [A name] in x.py\n", False),
    ("# Note [A name] in x.py says why\n", False),
])
def test_note_definitions_are_recognised(text, defines):
    assert bool(_DEFINED.search(text)) == defines


def test_an_8bit_block_never_straddles_two_parameters():
    # Note [8-bit moments]: a block of an 8-bit moment must lie inside one parameter's slice of
    # the flat buffer (and inside one FSDP2 shard), which holds because BLOCK is the alignment
    # every parameter starts on.
    from fxamp.optim.buffers.bucket import ALIGN
    from fxamp.optim.functional.codecs import BLOCK

    assert BLOCK == ALIGN
