"""The release as a user installs it runs: both wheels built from a clean copy of the checkout,
installed (not editable) into a fresh venv outside it by the node image's own install script
(deploy/image/install-kvd.sh, as deploy/Containerfile runs it), then, from that venv and from a
directory outside the checkout: `kvd --version`, `kvd selftest`, `kvd demo`, and two daemons
serving one pull to a client installed alone (kvd-client, grpcio and protobuf only).

Every test before this one ran the editable checkout; a wheel once shipped without
``kvd/worker`` and no daemon could start from it. About two minutes: torch comes from the same
local wheel the checkout's venv was made from (pip's find-links), NIXL from pip's cache.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from release_kit import REPO, base_python, clean_env, one, run

import kvd
from kvd.spawn import DaemonProcess, Launch, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CLIENT_DEPS = ("grpcio", "protobuf", "typing-extensions")


@pytest.fixture(scope="module")
def release_venv(release_dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv made by the node image's install script from the built wheels alone."""
    work = tmp_path_factory.mktemp("installed")
    venv = work / "venv"
    torch_version = importlib.metadata.version("torch").split("+")[0]
    env = clean_env(KVD_VERSION=kvd.__version__, TORCH_VERSION=torch_version, PYTHON=base_python())
    result = run(REPO / "deploy/image/install-kvd.sh", venv, release_dist, cwd=work, env=env, timeout=900)
    assert f"kvd {kvd.__version__} in {venv}" in result.stdout
    return venv


def test_the_installed_release_is_the_wheels_not_the_checkout(release_venv: Path, tmp_path: Path) -> None:
    kvd_cli = release_venv / "bin" / "kvd"
    assert run(kvd_cli, "--version", cwd=tmp_path, env=clean_env()).stdout.strip() == f"kvd {kvd.__version__}"
    code = "import kvd, kvd.worker, kvd_client, kvd_engine; print(kvd.__file__, kvd.worker.__file__)"
    where = run(release_venv / "bin" / "python", "-I", "-c", code, cwd=tmp_path, env=clean_env()).stdout.split()
    assert all(path.startswith(str(release_venv)) and not path.startswith(str(REPO)) for path in where), where
    run(release_venv / "bin" / "python", "-m", "pip", "check", cwd=tmp_path, env=clean_env())


def test_selftest_and_demo_pass_from_the_installed_release(release_venv: Path, tmp_path: Path) -> None:
    kvd_cli = release_venv / "bin" / "kvd"
    selftest = run(kvd_cli, "selftest", "--size-mb", "32", cwd=tmp_path, env=clean_env(), timeout=300)
    assert selftest.stdout.strip().endswith("PASS"), selftest.stdout[-2000:]
    demo = run(kvd_cli, "demo", cwd=tmp_path, env=clean_env(), timeout=300)
    assert "matched the model bit for bit" in demo.stdout, demo.stdout[-2000:]


def _serve(venv: Path, workdir: Path, name: str) -> DaemonProcess:
    ready = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    command = [
        venv / "bin" / "kvd", "serve", "--unix-socket", workdir / f"{name}.sock", "--port", "0",
        "--metrics-port", "0", "--ready-file", ready,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(c) for c in command], stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=clean_env()
        )
    return wait_ready(Launch(process, name, ready, log_path), ready_timeout_s=120)


def test_daemons_from_the_release_serve_a_pull_to_a_client_installed_alone(
    release_venv: Path, release_dist: Path, tmp_path: Path
) -> None:
    client_venv = tmp_path / "client-venv"
    run(base_python(), "-m", "venv", "--without-pip", client_venv, cwd=tmp_path)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CLIENT_DEPS]
    run(
        sys.executable, "-m", "pip", "--python", client_venv / "bin" / "python", "install", "-q", "--no-deps",
        "--disable-pip-version-check", one(release_dist, "kvd_client-*.whl"), *pins, cwd=tmp_path,
    )  # fmt: skip
    daemons: list[DaemonProcess] = []
    try:
        daemons = [_serve(release_venv, tmp_path, name) for name in ("holder", "reader")]
        holder, reader = daemons
        result = run(
            client_venv / "bin" / "python", "-I", Path(__file__).with_name("release_client_pull.py"),
            holder.tcp, reader.unix_socket, cwd=tmp_path, env=clean_env(), timeout=120,
        )  # fmt: skip
        assert "all match" in result.stdout, result.stdout
    finally:
        for daemon in daemons:
            daemon.process.terminate()
        for daemon in daemons:
            assert daemon.process.wait(timeout=60) == 0, daemon.log_path.read_text()[-3000:]
