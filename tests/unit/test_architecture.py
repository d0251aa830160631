"""The dependency lines the folders promise: the client at the bottom, the daemon and the engine
patch above it, the daemon's core and layout free of grpc, and no import cycle among modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Source folder -> import name (as the root pyproject.toml maps them).
PACKAGES = {"kvd": "kvd", "client": "kvd_client", "engine_patch": "kvd_engine"}


def _modules(folder: str) -> Iterator[tuple[str, Path]]:
    root = REPO / folder
    for path in sorted(root.rglob("*.py")):
        if "build" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join([PACKAGES[folder], *parts]), path


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (also inside functions), TYPE_CHECKING excluded."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _first_party_graph() -> dict[str, set[str]]:
    modules = {name: path for folder in PACKAGES for name, path in _modules(folder)}
    return {name: {m for m in _imports(name, path) if m in modules and m != name} for name, path in modules.items()}


def _importers_of(prefixes: tuple[str, ...], within: str) -> list[str]:
    bad = []
    for folder, top in PACKAGES.items():
        if top != within:
            continue
        for name, path in _modules(folder):
            for imported in sorted(_imports(name, path)):
                if imported.split(".")[0] in prefixes or imported.startswith(tuple(p + "." for p in prefixes)):
                    bad.append(f"{name} imports {imported}")
    return bad


def test_the_client_imports_neither_the_daemon_nor_the_engine_patch() -> None:
    """kvd_client is the bottom layer: nothing in it reaches up."""
    assert _importers_of(("kvd", "kvd_engine"), within="kvd_client") == []


def test_the_engine_patch_imports_no_daemon_code() -> None:
    """An engine loads kvd_engine and kvd_client only: the daemon package stays out of its process."""
    assert _importers_of(("kvd",), within="kvd_engine") == []


def test_the_core_and_layout_import_neither_servers_nor_wire_code() -> None:
    """kvd.core and kvd.layout see no server, CLI or generated message code (schema records excepted)."""
    bad = []
    for name, path in _modules("kvd"):
        if not name.startswith(("kvd.core", "kvd.layout")):
            continue
        for imported in sorted(_imports(name, path)):
            if imported.startswith(("kvd.server", "kvd.cli", "kvd.demo", "grpc")) or "_pb2" in imported:
                bad.append(f"{name} imports {imported}")
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_modules() -> None:
    """No two first-party modules import each other, even through a function-level import.

    A package importing its own submodules (``__init__`` re-exports) is not a cycle here.
    """
    graph = _first_party_graph()
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}  # submodule -> its package
    assert _cycles(graph) == []


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_importing_the_core_and_layout_loads_no_grpc() -> None:
    """Every module of kvd.core and kvd.layout imports without grpc, protobuf or the generated stubs."""
    result = _run(
        """
        import importlib, pkgutil, sys
        import kvd.core, kvd.layout
        for package in (kvd.core, kvd.layout):
            for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
                importlib.import_module(info.name)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "grpc" or m.startswith("google.protobuf")
                        or m.endswith(("_pb2", "_pb2_grpc")) or m.startswith(("kvd.server", "kvd_client.v1.c")))
        assert not loaded, loaded
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "module", ["kvd_client.errors", "kvd_client.v1.schema", "kvd_client.records", "kvd_client.shm"]
)
def test_the_shared_client_modules_load_only_the_standard_library(module: str) -> None:
    """What the daemon's core and the engine patch import from the client costs no third-party import."""
    result = _run(
        f"""
        import sys
        before = set(sys.modules)
        import {module}
        third_party = sorted(m for m in set(sys.modules) - before
                             if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "kvd_client")
        assert not third_party, third_party
        """
    )
    assert result.returncode == 0, result.stderr
