"""The import structure of the package: every import (module level or inside a function) points from a higher
layer to a lower one or stays in its layer, and no two modules import each other, directly or through others.

Layers, lowest first (docs/architecture.md): the explicit randomness, device and safe loading; the federated core
(records, the Method interface, the registry, the driver) and the models; privacy, codecs, data and the config;
the language-model stack and the methods; the experiment runner and its reports; the Flower adapters and the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fedtailor"

LAYERS = (
    {"rng", "device", "safeload", "allocator", "blas"},
    {"fl", "models"},
    {"privacy", "codecs", "data", "config"},
    {"lm", "methods"},
    {"experiment", "runner", "rundir", "report", "sweep", "reproduce"},
    {"flower", "cli", "__main__"},
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the fedtailor modules it imports anywhere in its code (tests excluded)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name.endswith("_test.py"):
            continue
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedtailor"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("fedtailor")}
        out[_module(path)] = found
    return out


def _layer(module: str) -> int:
    area = module.split(".")[1] if "." in module else module
    for i, names in enumerate(LAYERS):
        if area in names:
            return i
    raise AssertionError(f"{module}: area {area!r} is in no layer of this test; add it to LAYERS")


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{a} -> {b}" for a, bs in _imports().items() for b in bs if b != "fedtailor" and _layer(b) > _layer(a)]
    assert not upward, upward


def test_no_import_cycle():
    graph = _imports()
    graph = {a: {b for b in bs if b in graph and b != a} for a, bs in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_checks_see_a_planted_violation(tmp_path, monkeypatch):
    """The walk finds an upward import and a cycle when there is one (a check that cannot fail proves nothing)."""
    pkg = tmp_path / "fedtailor"
    (pkg / "fl").mkdir(parents=True)
    (pkg / "cli").mkdir()
    (pkg / "fl" / "a.py").write_text("def f():\n    from fedtailor.cli.b import g\n")
    (pkg / "cli" / "b.py").write_text("from fedtailor.fl.a import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph = _imports()
    assert graph == {"fedtailor.fl.a": {"fedtailor.cli.b"}, "fedtailor.cli.b": {"fedtailor.fl.a"}}
    try:
        test_no_module_imports_from_a_higher_layer()
    except AssertionError as e:
        assert "fedtailor.fl.a -> fedtailor.cli.b" in str(e)
    else:
        raise AssertionError("the upward import was not found")
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "import cycle" in str(e)
    else:
        raise AssertionError("the cycle was not found")
