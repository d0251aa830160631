"""The dependency lines the folders promise: the client at the bottom, the daemon and the engine
patch above it, the daemon's core and layout free of grpc, and no import cycle among modules.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
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
    return _imports_in(name, path, ast.parse(path.read_text()))


def _imports_in(name: str, path: Path, tree: ast.AST) -> set[str]:
    """Every module ``tree`` (the code of module ``name`` at ``path``) imports, TYPE_CHECKING excluded."""
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


def test_the_bench_sits_below_the_cli() -> None:
    """kvd.bench is what `kvd bench` runs; the CLI imports it, never the other way (the daemon
    processes both start come from kvd.spawn, below both)."""
    bad = [
        f"{name} imports {imported}"
        for name, path in _modules("kvd")
        if name.startswith("kvd.bench")
        for imported in sorted(_imports(name, path))
        if imported == "kvd.cli" or imported.startswith("kvd.cli.")
    ]
    assert bad == []


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


# --- the two processes of `kvd serve` ---------------------------------------------------------------


CONTROL_PACKAGES = ("kvd.core", "kvd.server", "kvd.layout")
SERVE_PATH_FUNCTIONS = ("_cmd_serve", "build_parser", "main", "_configure_logging")


def _all_modules() -> dict[str, Path]:
    return {name: path for folder in PACKAGES for name, path in _modules(folder)}


def _serve_path_imports(name: str, path: Path) -> set[str]:
    """What ``kvd serve`` runs of kvd.cli.main: its module level and the serve command's functions."""
    tree = ast.parse(path.read_text())
    kept = [
        node
        for node in tree.body
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        or node.name in SERVE_PATH_FUNCTIONS
    ]
    return _imports_in(name, path, ast.Module(body=kept, type_ignores=[]))


def _module_level_imports(name: str, path: Path) -> set[str]:
    """The imports that run when the module is imported (none inside a function or class)."""
    tree = ast.parse(path.read_text())
    kept = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    return _imports_in(name, path, ast.Module(body=kept, type_ignores=[]))


@functools.cache
def _flag_modules() -> frozenset[str]:
    """The kvd.cli modules kvd.cli.main imports at module level for their commands' flags."""
    modules = _all_modules()
    imported = _module_level_imports("kvd.cli.main", modules["kvd.cli.main"])
    return frozenset(m for m in imported if m in modules and m.startswith("kvd.cli."))


def _control_side_imports(name: str, path: Path) -> set[str]:
    """kvd.cli.main counts with its serve path only, and a module it imports for a command's flags
    (``add_bench_arguments``…) with its module level only: its functions belong to its own command.
    Every other module counts with all its imports, at any depth."""
    if name == "kvd.cli.main":
        return _serve_path_imports(name, path)
    if name in _flag_modules():
        return _module_level_imports(name, path)
    return _imports(name, path)


def _reached(roots: list[str], imports_of: Callable[[str, Path], set[str]]) -> dict[str, tuple[list[str], set[str]]]:
    """Every first-party module ``roots`` load, transitively (a submodule loads its packages):
    module -> (the chain of imports that reaches it, everything it imports)."""
    modules = _all_modules()
    found: dict[str, tuple[list[str], set[str]]] = {}
    queue = [(root, [root]) for root in roots]
    while queue:
        name, chain = queue.pop(0)
        if name in found:
            continue
        imported = imports_of(name, modules[name])
        found[name] = (chain, imported)
        for target in sorted(imported):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the packages above it are loaded too
                module = ".".join(parts[:i])
                if module in modules and module not in found:
                    queue.append((module, [*chain, module]))
    return found


def _offenders(reached: dict[str, tuple[list[str], set[str]]], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for chain, imported in (reached[name] for name in sorted(reached)):
        for target in sorted(imported):
            if target in forbidden or target.startswith(tuple(f + "." for f in forbidden)):
                bad.append(f"{' -> '.join(chain)} imports {target}")
    return bad


def test_the_control_side_imports_neither_nixl_nor_the_worker() -> None:
    """kvd.core, kvd.server, kvd.layout and `kvd serve`'s path through kvd.cli.main, and every
    first-party module they load (at any depth), import no ``nixl`` and no ``kvd.worker``: NIXL
    and UCX live in the worker process only, out of the control process's crash domain.

    kvd.cli.selftest_parts and kvd.bench are separate tools (`kvd selftest`, `kvd bench`) that
    read through raw NIXL agents next to kvd's pulls: they may import nixl directly and are not
    on the control side, so they are left out (reached only from their own commands)."""
    modules = _all_modules()
    roots = sorted(
        m for m in modules if m.startswith(tuple(p + "." for p in CONTROL_PACKAGES)) or m in CONTROL_PACKAGES
    )
    reached = _reached([*roots, "kvd.cli.main"], _control_side_imports)
    assert "kvd.core.dataplane" in reached and "kvd.server.app" in reached  # the scan sees the serve path
    assert _offenders(reached, ("nixl", "kvd.worker")) == []


def test_the_worker_imports_no_grpc_and_no_control_side_code() -> None:
    """kvd.worker, and every first-party module it loads, imports no grpc, no generated wire code
    and nothing of the control process (kvd.core, kvd.server, kvd.cli): it shares only
    kvd.dataplane_protocol (and kvd_client.errors) with it."""
    modules = _all_modules()
    reached = _reached(sorted(m for m in modules if m == "kvd.worker" or m.startswith("kvd.worker.")), _imports)
    assert "kvd.worker.service" in reached and "kvd.dataplane_protocol" in reached
    forbidden = ("grpc", "grpc_health", "kvd_client.v1", "kvd.core", "kvd.server", "kvd.cli")
    assert _offenders(reached, forbidden) == []


def test_the_protocol_imports_only_the_standard_library_and_the_errors() -> None:
    """kvd.dataplane_protocol is the one module both processes load: the standard library and
    kvd_client.errors, nothing else (by its source, and by what importing it loads)."""
    path = _all_modules()["kvd.dataplane_protocol"]
    bad = sorted(
        m
        for m in _imports("kvd.dataplane_protocol", path)
        if m.split(".")[0] not in sys.stdlib_module_names
        and not (m == "kvd_client.errors" or m.startswith("kvd_client.errors."))
    )
    assert bad == []
    result = _run(
        """
        import sys
        before = set(sys.modules)
        import kvd.dataplane_protocol
        new = set(sys.modules) - before
        # kvd's and kvd_client's package modules come with any of their modules (kvd_client.version: the one version)
        allowed = {"kvd", "kvd.dataplane_protocol", "kvd_client", "kvd_client.errors", "kvd_client.version"}
        other = sorted(m for m in new if m.split(".")[0] not in sys.stdlib_module_names and m not in allowed)
        assert not other, other
        """
    )
    assert result.returncode == 0, result.stderr


def test_loading_the_server_and_the_daemon_loads_neither_nixl_nor_the_worker() -> None:
    """What the control process imports (kvd.server.app, kvd.core.daemon) loads no NIXL module
    and no kvd.worker module: checked in a fresh interpreter's sys.modules."""
    result = _run(
        """
        import sys
        import kvd.server.app, kvd.core.daemon
        loaded = sorted(m for m in sys.modules if m.split(".")[0] == "nixl" or m.startswith("nixl_")
                        or m == "kvd.worker" or m.startswith("kvd.worker."))
        assert not loaded, loaded
        """
    )
    assert result.returncode == 0, result.stderr


def test_loading_the_worker_loads_no_grpc_and_no_control_side_code() -> None:
    """The worker's modules (with NIXL and torch) load no grpc, no generated stubs, no control code."""
    result = _run(
        """
        import sys
        import kvd.worker.service, kvd.worker.__main__
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "grpc_health")
                        or m.endswith(("_pb2", "_pb2_grpc")) or m.startswith("kvd_client.v1")
                        or m.startswith(("kvd.core", "kvd.server", "kvd.cli")))
        assert not loaded, loaded
        """
    )
    assert result.returncode == 0, result.stderr
