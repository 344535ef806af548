"""The house rules, read off the installed package with ``ast`` (no module is imported).

Layers, top to bottom (docs/ARCHITECTURE.md):
cli → front door (llmc/*.py) → measurement wing (llmc.runtime.bench) → engine core
(llmc.runtime) → compiler (llmc.compiler) → op layer (llmc.cuda) → base (llmc.base).

Every import counts, whether at module level, inside a function or under TYPE_CHECKING:
a lazy import is still a dependency. Rules:
- nothing outside cli/ imports ``llmc.cli``;
- the engine core never imports the measurement wing;
- the op layer never imports the runtime (core or wing);
- a module imports only its own layer or the layers below it;
- no import cycle between files, and none between folders.
"""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

KNOWN_DEBT: set[tuple[str, str]] = set()
"""Edges the house issue removes; each must still exist (test_known_debt_is_current), so an
entry goes when its edge goes. The set is empty when the house is done."""

LAYERS = ("cli", "front", "bench", "core", "compiler", "op", "base", "profiles")
RANK = {name: i for i, name in enumerate(LAYERS)}


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("api", "api_inputs", "profiler_api", "errors", "serve"):
        return "front"  # llmc.serve: the HTTP server, a client of the front door
    top = parts[1]
    if top == "runtime":
        return "bench" if len(parts) > 2 and parts[2] == "bench" else "core"
    return {"cli": "cli", "compiler": "compiler", "cuda": "op", "base": "base"}.get(top, top)


@cache
def modules() -> dict[str, Path]:
    """Every module of the installed ``llmc`` package, by dotted name → source file. The
    package names come from pyproject.toml (an editable install maps each one to its folder),
    their locations from the import system."""
    out: dict[str, Path] = {}
    pending = list(tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"])
    while pending:
        pkg = pending.pop()
        spec = importlib.util.find_spec(pkg)
        assert spec is not None and spec.submodule_search_locations, pkg
        for loc in spec.submodule_search_locations:
            for path in sorted(Path(loc).iterdir()):
                if path.name == "__init__.py":
                    out[pkg] = path
                elif path.suffix == ".py":
                    out[f"{pkg}.{path.stem}"] = path
                elif path.is_dir() and (path / "__init__.py").is_file():
                    if f"{pkg}.{path.name}" not in out:
                        pending.append(f"{pkg}.{path.name}")
    return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports() -> dict[str, dict[str, int]]:
    """module → {imported llmc module: line of the first such import}."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node, path.name == "__init__.py")
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods and "." in t:  # `import llmc.x.y.Name` forms
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod and (mod, t) not in KNOWN_DEBT:
                    edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def folder(module: str) -> str:
    return str(modules()[module].parent)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _where(src: str, dst: str) -> str:
    return f"{modules()[src]}:{imports()[src][dst]} ({src} → {dst})"


def test_walk_sees_the_whole_package():
    mods = modules()
    for name in ("llmc.cli.main", "llmc.runtime.executor", "llmc.runtime.bench.metrics",
                 "llmc.cuda.backend", "llmc.compiler.builder", "llmc.base.errors"):  # fmt: skip
        assert name in mods
    assert "llmc.cuda.backend" in imports()["llmc.runtime.model_runner"]


def test_layer_rules():
    bad = []
    for src, edges in imports().items():
        for dst in edges:
            ls, ld = layer(src), layer(dst)
            if ld == "cli" and ls != "cli":
                bad.append(f"imports the CLI: {_where(src, dst)}")
            elif ls == "core" and ld == "bench":
                bad.append(f"engine core imports the measurement wing: {_where(src, dst)}")
            elif ls == "op" and ld in ("core", "bench"):
                bad.append(f"op layer imports the runtime: {_where(src, dst)}")
            elif RANK[ld] < RANK[ls]:
                bad.append(f"{ls} imports the layer above it ({ld}): {_where(src, dst)}")
    assert not bad, "\n".join(bad)


def test_no_cycle_between_files():
    graph = {m: set(e) for m, e in imports().items()}
    assert not _cycles(graph), _cycles(graph)


def test_no_cycle_between_folders():
    graph: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for src, edges in imports().items():
        for dst in edges:
            a, b = folder(src), folder(dst)
            if a != b:
                graph[a].add(b)
                why.setdefault((a, b), _where(src, dst))
    cycles = _cycles(graph)
    detail = [why[(a, b)] for c in cycles for a in c for b in c if (a, b) in why]
    assert not cycles, "\n".join(detail)


@pytest.mark.parametrize(
    "src,dst,expect",
    [
        ("llmc.runtime.executor", "llmc.runtime.bench.metrics", "core imports the wing"),
        ("llmc.cuda.backend", "llmc.runtime.types", "op imports runtime"),
        ("llmc.compiler.builder", "llmc.cli.main", "imports the CLI"),
    ],
)
def test_rules_catch_a_bad_edge(src, dst, expect):
    """The checks above are not vacuous: one added bad edge makes them fail."""
    graph = imports()
    saved = dict(graph[src])
    graph[src][dst] = 1
    try:
        with pytest.raises(AssertionError):
            test_layer_rules()
    finally:
        graph[src].clear()
        graph[src].update(saved)


def test_known_debt_is_current():
    """Every allowed edge still exists in the code (remove the entry once it is gone)."""
    global KNOWN_DEBT
    saved, KNOWN_DEBT = KNOWN_DEBT, set()
    imports.cache_clear()
    try:
        graph = imports()
        stale = [(a, b) for a, b in sorted(saved) if b not in graph.get(a, {})]
    finally:
        KNOWN_DEBT = saved
        imports.cache_clear()
    assert not stale, f"remove from KNOWN_DEBT: {stale}"


def test_cycle_finder():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _source_files() -> list[Path]:
    """Every source file of the package: its modules and the op layer's kernels."""
    files = set(modules().values())
    kernels = modules()["llmc.cuda"].parent
    files |= {p for p in kernels.iterdir() if p.suffix in (".cu", ".cuh")}
    return sorted(files)


def test_no_source_file_over_500_lines():
    long = [
        f"{p}: {n} lines" for p in _source_files() if (n := len(p.read_text().splitlines())) > 500
    ]
    assert not long, "split by job: " + ", ".join(long)


def test_architecture_doc_names_every_source_file():
    doc = (PYPROJECT.parent / "docs" / "ARCHITECTURE.md").read_text()
    root = PYPROJECT.parent
    missing = [
        str(p.relative_to(root))
        for p in _source_files()
        if p.name != "__init__.py" and f"`{p.relative_to(root)}`" not in doc
    ]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_architecture_doc_names_no_missing_file():
    """Every repository path the doc names in backticks exists (no stale names)."""
    import re

    root = PYPROJECT.parent
    doc = (root / "docs" / "ARCHITECTURE.md").read_text()
    named = set(
        re.findall(
            r"`((?:cli|compiler|runtime|cuda|llmc|tests|scripts)/[\w/.]+\.(?:py|cu|cuh|sh|md|yaml|json|h))`",
            doc,
        )
    )
    missing = sorted(p for p in named if not (root / p).exists())
    assert named and not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
