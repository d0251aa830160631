"""Both distributions as a user gets them: `python -m build` makes their sdists and wheels (the
wheels built from the sdists, so an sdist missing a file fails here), `twine check --strict`
accepts their metadata, the client wheel installs alone in a fresh venv and works there without
torch, NIXL or the daemon, and the daemon wheel (not editable) installs in another and runs
`kvd --version` and `kvd serve --print-config`.

Kept to about a minute: each venv is made without pip (this environment's pip installs into it,
``pip --python``) and gets its wheel with ``--no-deps`` plus the few dependencies the check
needs, at the versions installed here (so pip takes them from its cache, PyPI only when it must).
"""

from __future__ import annotations

import email.parser
import importlib.metadata
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from release_kit import REPO, one, run, tracked_files

import kvd

pytestmark = pytest.mark.slow

CLIENT_DEPS = ("grpcio", "protobuf", "typing-extensions")  # typing-extensions: grpcio's own dependency
DAEMON_CLI_DEPS = (*CLIENT_DEPS, "prometheus_client")  # what `kvd --version` and `--print-config` import
SOURCE_FOLDERS = {"kvd": "kvd", "client": "kvd_client", "engine_patch": "kvd_engine"}
"""Folder in the repository -> its import name (setup.py's mapping, the other way round)."""
NOT_SHIPPED = {"client/setup.py", "client/pyproject.toml", "client/README.md"}
"""The client folder's own build files: in the folder, not in the package."""


@pytest.fixture
def dist(release_dist: Path) -> Path:
    return release_dist


def shipped_files(folder: str) -> set[str]:
    """Every file of a source folder that the code can import or read (modules, stubs, markers),
    by the name it has in a wheel: ``client/v1/router_pb2.pyi`` -> ``kvd_client/v1/router_pb2.pyi``."""
    names = set()
    for name in tracked_files():
        top, _, rest = name.partition("/")
        if top != folder or name in NOT_SHIPPED or "/tests/" in name:
            continue
        if name.endswith((".py", ".pyi")) or rest.endswith("py.typed"):
            names.add(f"{SOURCE_FOLDERS[top]}/{rest}")
    return names


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if ".dist-info/" not in n}


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _requires(wheel: Path) -> set[str]:
    """The wheel's unconditional requirements, as names."""
    reqs = _metadata(wheel).get_all("Requires-Dist") or []
    return {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in reqs if "extra ==" not in r}


def _venv(path: Path, *requirements: str | Path) -> Path:
    """A fresh venv (no pip, no system site-packages) holding exactly ``requirements``."""
    run(sys.executable, "-m", "venv", "--without-pip", path, cwd=path.parent)
    python = path / "bin" / "python"
    run(
        sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
        "--disable-pip-version-check", *requirements, cwd=path.parent,
    )  # fmt: skip
    return python


def _pinned(*names: str) -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def test_every_importable_file_is_in_the_wheels_and_nothing_else(dist: Path) -> None:
    """Packages are discovered (setup.py), not listed: a new subpackage, stub or marker ships
    without anyone naming it, and the daemon's wheel has all three folders (the data-plane
    worker included: a wheel once shipped without ``kvd/worker`` and no daemon could start)."""
    daemon, client = wheel_files(one(dist, "kvd-*.whl")), wheel_files(one(dist, "kvd_client-*.whl"))
    wanted_daemon = shipped_files("kvd") | shipped_files("client") | shipped_files("engine_patch")
    assert any(name.startswith("kvd/worker/") for name in wanted_daemon)
    assert sorted(wanted_daemon - daemon) == [], "missing from the daemon's wheel"
    assert sorted(daemon - wanted_daemon) == [], "in the daemon's wheel but not in the source folders"
    wanted_client = shipped_files("client")
    assert sorted(wanted_client - client) == [], "missing from the client's wheel"
    assert sorted(client - wanted_client) == [], "in the client's wheel but not in client/"


def test_both_distributions_build_at_the_one_version_and_pass_twine_check(dist: Path) -> None:
    version = kvd.__version__
    names = sorted(p.name for p in dist.iterdir())
    assert names == [
        f"kvd-{version}-py3-none-any.whl",
        f"kvd-{version}.tar.gz",
        f"kvd_client-{version}-py3-none-any.whl",
        f"kvd_client-{version}.tar.gz",
    ]
    result = run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()), cwd=dist)
    assert result.stdout.count("PASSED") == 4, result.stdout

    client = one(dist, "kvd_client-*.whl")
    assert _requires(client) == {"grpcio", "protobuf"}
    assert _metadata(client)["Version"] == version
    with zipfile.ZipFile(client) as zf:
        files = set(zf.namelist())
    assert {"kvd_client/version.py", "kvd_client/py.typed", "kvd_client/v1/router_pb2.pyi"} <= files
    assert not any(f.startswith(("kvd/", "kvd_engine/")) for f in files)

    daemon = one(dist, "kvd-*.whl")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert _requires(daemon) == {d.split(">")[0].split("=")[0].strip() for d in declared}
    with zipfile.ZipFile(daemon) as zf:
        files = set(zf.namelist())
        entry_points = zf.read(f"kvd-{version}.dist-info/entry_points.txt").decode()
    assert {
        "kvd/cli/main.py",
        "kvd/server/client_versions.py",
        "kvd_client/version.py",
        "kvd_engine/__init__.py",
    } <= files
    assert "kvd = kvd.cli.main:main" in entry_points


def test_the_client_wheel_installs_and_works_alone(dist: Path, tmp_path: Path) -> None:
    """grpcio and protobuf only: no torch, no NIXL, no daemon, and `pip check` is satisfied."""
    python = _venv(tmp_path / "client-venv", one(dist, "kvd_client-*.whl"), *_pinned(*CLIENT_DEPS))
    code = f"""
import asyncio, importlib, importlib.metadata, importlib.util, pkgutil
import kvd_client
assert kvd_client.__version__ == importlib.metadata.version("kvd-client") == {kvd.__version__!r}
assert "site-packages" in kvd_client.__file__, kvd_client.__file__
for absent in ("kvd", "kvd_engine", "torch", "nixl", "numpy", "prometheus_client"):
    assert importlib.util.find_spec(absent) is None, absent
for info in pkgutil.walk_packages(kvd_client.__path__, "kvd_client."):
    importlib.import_module(info.name)
from kvd_client import AsyncKvdClient, KvdClient
from kvd_client.channel import DEFAULT_OPTIONS
assert ("grpc.primary_user_agent", "kvd-client/{kvd.__version__}") in DEFAULT_OPTIONS
with KvdClient("127.0.0.1:1", timeout_s=1) as client:
    assert client.health_check() is False
async def main():
    async with AsyncKvdClient("127.0.0.1:1", timeout_s=1) as client:
        assert await client.health_check() is False
asyncio.run(main())
print("client ok")
"""
    assert run(python, "-I", "-c", code, cwd=tmp_path).stdout.strip() == "client ok"
    run(sys.executable, "-m", "pip", "--python", python, "check", cwd=tmp_path)


def test_the_daemon_wheel_installs_and_runs_its_cli(dist: Path, tmp_path: Path) -> None:
    """The wheel, not the checkout (not editable): `kvd --version` and `kvd serve --print-config`."""
    venv = tmp_path / "daemon-venv"
    _venv(venv, one(dist, "kvd-*.whl"), *_pinned(*DAEMON_CLI_DEPS))
    kvd_script = venv / "bin" / "kvd"
    assert run(kvd_script, "--version", cwd=tmp_path).stdout.strip() == f"kvd {kvd.__version__}"
    printed = run(kvd_script, "serve", "--print-config", "--port", "50199", cwd=tmp_path).stdout
    assert "50199" in printed and "unix_socket" in printed
    where = run(venv / "bin" / "python", "-I", "-c", "import kvd; print(kvd.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where
