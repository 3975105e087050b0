"""The package's import graph: no cycles (function-level imports included, and the
`__init__` of every package an import runs), and
fxamp/testing.py is for tests only (no module of fxamp imports it)."""

from __future__ import annotations

import ast
import pathlib

import fxamp

ROOT = pathlib.Path(fxamp.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (never executed)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The fxamp modules `path` imports when it runs: at the top or in a function's body
    (imports for type checkers only are not run, so they make no cycle)."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {name for name in out if name in modules}


def _packages_run(name: str, importer: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """What importing module `name` from module `importer` runs: `name` and the `__init__` of
    each package above it, but for the top-level package `fxamp` (run before any of its
    modules) and the packages `importer` is itself in (already running when it is imported).
    """
    parts = name.split(".")
    above = {".".join(parts[:i]) for i in range(2, len(parts))}
    inside = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return ({name} | above) - inside & set(modules)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set().union(*(_packages_run(dep, name, modules)
                                for dep in _imports(path, modules))) - {name}
            for name, path in modules.items()}


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str]:
    # Depth-first search for a path from `start` back to itself.
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for nxt in sorted(graph[name]):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return []


def test_the_walk_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_from("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_from("d", graph) == []


def test_importing_a_module_runs_the_packages_above_it():
    modules = {name: ROOT for name in ("fxamp", "fxamp.a", "fxamp.a.b", "fxamp.a.b.c", "fxamp.d")}
    assert _packages_run("fxamp.a.b.c", "fxamp.d", modules) == {"fxamp.a", "fxamp.a.b",
                                                                "fxamp.a.b.c"}
    assert _packages_run("fxamp.a.b.c", "fxamp.a.x", modules) == {"fxamp.a.b", "fxamp.a.b.c"}


def test_fxamp_has_no_import_cycles():
    graph = _graph()
    assert "fxamp.passes.annotate" in graph["fxamp.passes"]  # the walk sees the package
    assert "fxamp.optim" in graph["fxamp.distributed"]  # ... and counts its __init__
    cycles = [" -> ".join(c) for name in sorted(graph) if (c := _cycle_from(name, graph))]
    assert not cycles, "import cycles in fxamp/:\n" + "\n".join(cycles)


def test_only_tests_import_fxamp_testing():
    importers = sorted(name for name, deps in _graph().items() if "fxamp.testing" in deps)
    assert importers == []
