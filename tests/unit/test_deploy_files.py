"""The files in deploy/ stay true: the configs load, the unit is hardened and verifies, the
Kubernetes manifest validates against the API schema and wires kvd the way the docs say."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.cli.main import build_parser
from kvd.config import config_from_args, load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "kvd.service"
MANIFEST = DEPLOY / "daemonset.yaml"
MAX_EXPOSURE = 4.0
K8S_VERSIONS = ("1.29", "1.33", "1.37")

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (scripts/setup.sh installs it with apt-get when run as root)",
)


def _unit_settings() -> dict[str, list[str]]:
    """Every ``Key=value`` of the unit (keys may repeat), comments dropped."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def _manifest() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


# --- the example config ------------------------------------------------------------------------------


def test_example_config_loads() -> None:
    config = load_config(DEPLOY / "kvd.toml", env={})
    assert config.unix_socket == "/run/kvd/engine.sock"  # inside the unit's RuntimeDirectory
    assert config.engine_group == "kvd"  # the unit's Group: engines in it reach the socket
    assert config.port == 50151


# --- systemd -------------------------------------------------------------------------------------------


def test_systemd_unit_command_parses() -> None:
    argv = shlex.split(_unit_settings()["ExecStart"][0])
    assert argv[0].endswith("/kvd") and argv[1:3] == ["serve", "--config"]
    args = build_parser().parse_args(["serve", "--config", str(DEPLOY / "kvd.toml"), *argv[4:]])
    assert args.command == "serve"
    assert config_from_args(args, env={}).port == 50151


def test_systemd_unit_is_notify_with_a_watchdog_and_shares_its_runtime_directory() -> None:
    s = _unit_settings()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert float(s["WatchdogSec"][0]) > 0
    assert s["RuntimeDirectory"] == ["kvd"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert s["Group"] == ["kvd"]
    assert s["LimitMEMLOCK"] == ["infinity"]
    assert s["RestartPreventExitStatus"] == ["2"]  # a config error is not retried
    allowed = " ".join(s["DeviceAllow"])
    for device in ("/dev/nvidiactl", "char-nvidia-frontend", "/dev/nvidia-uvm", "char-infiniband_verbs", "rdma_cm"):
        assert device in allowed
    assert s["DevicePolicy"] == ["closed"]
    assert "PrivateDevices" not in s  # it would hide the GPUs and give a private /dev/shm


def _unit_for_this_machine(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's kvd (verify checks the binary exists)."""
    text = UNIT.read_text().replace("/opt/kvd/.venv/bin/kvd", str(Path(sys.executable).parent / "kvd"))
    path = tmp_path / "kvd.service"
    path.write_text(text)
    return path


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", str(_unit_for_this_machine(tmp_path))],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvd.service" not in result.stderr, result.stderr  # no warnings about the unit either


@needs_systemd_analyze
def test_systemd_analyze_security_rates_the_unit_at_most_4(tmp_path: Path) -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(_unit_for_this_machine(tmp_path))],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    match = re.search(r"Overall exposure level for kvd\.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


# --- Kubernetes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_validates_strictly_against_the_kubernetes_schema(version: str) -> None:
    """Every document, unknown fields included (strict): what `kubectl apply` would accept."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the [test] extra installs it
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert {d["kind"] for d in docs} == {"Namespace", "PriorityClass", "ConfigMap", "DaemonSet"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelled_field_would_fail_validation() -> None:
    """The validation above has teeth: strict mode refuses a field the API does not know."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    ds = _manifest()["DaemonSet"]
    ds["spec"]["template"]["spec"]["tolerations"][0]["efect"] = "NoSchedule"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


def test_configmap_holds_a_config_kvd_loads_with_the_pod_environment(tmp_path: Path) -> None:
    docs = _manifest()
    ds = docs["DaemonSet"]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == "/etc/kvd/kvd.toml"
    mounted = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert mounted["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    path = tmp_path / "kvd.toml"
    path.write_text(docs["ConfigMap"]["data"]["kvd.toml"])
    env = {"KVD_HOST": "10.1.2.3", "KVD_HEALTH_HOST": "10.1.2.3"}
    config = load_config(path, env=env)
    assert config.host == "10.1.2.3" and config.health_host == "10.1.2.3"
    assert {e["name"] for e in container["env"]} >= set(env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.port, "health": config.health_port, "metrics": config.metrics_port}
    assert config.unix_socket.startswith("/run/kvd/")
    groups = ds["spec"]["template"]["spec"]["securityContext"]["supplementalGroups"]
    assert int(config.engine_group) in groups  # the daemon may give its socket to the engines' group


def test_daemonset_is_schedulable_on_gpu_nodes_and_wired_like_the_docs_say() -> None:
    docs = _manifest()
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # QoS: requests and limits (not BestEffort), a priority class that exists in the manifest
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]
    assert pod["priorityClassName"] == docs["PriorityClass"]["metadata"]["name"]
    # GPU nodes: tolerated, GPUs visible without claiming them
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # RDMA devices, /dev/shm of the host, the socket directory on the host
    assert any(k.startswith("rdma/") for k in container["resources"]["limits"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["hostPath"]["path"] == "/dev/shm"
    assert volumes[mounts["/run/kvd"]]["hostPath"]["path"] == "/run/kvd"
    assert pod["hostIPC"] and pod["hostPID"] and pod["hostNetwork"]


def test_probes_use_the_plaintext_health_listener_not_the_mtls_port() -> None:
    """With tls_ca set, the main port refuses clients without a certificate, the kubelet's probe
    included; the probes target health_port, which serves grpc.health.v1 without TLS."""
    docs = _manifest()
    container = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"] != ports["grpc"]


def test_liveness_asks_for_the_control_process_and_readiness_for_a_serving_worker() -> None:
    """A crash loop's back-off keeps the engines' registrations: readiness follows whether a
    worker serves (the default health name), liveness only whether the control process runs."""
    from kvd.server.app import LIVENESS_SERVICE

    container = _manifest()["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    assert "service" not in container["readinessProbe"]["grpc"]
    assert "service" not in container["startupProbe"]["grpc"]


def test_example_configs_use_mtls_with_named_roles(tmp_path: Path) -> None:
    """Off loopback, plaintext TCP is refused: both examples bind a node address, so both use mTLS
    and say which certificate names hold the peer role (NIXL access to engine memory)."""
    docs = _manifest()
    env = {"KVD_HOST": "10.1.2.3", "KVD_HEALTH_HOST": "10.1.2.3"}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (tmp_path / "configmap.toml").write_text(docs["ConfigMap"]["data"]["kvd.toml"])
    configs = [load_config(tmp_path / "configmap.toml", env=env), load_config(DEPLOY / "kvd.toml", env={})]
    for config in configs:
        assert config.tls_enabled and config.tls_ca and config.tls_peer_names
        assert not config.allow_insecure_tcp
    assert "secret" in volumes[mounts[str(Path(configs[0].tls_cert).parent)]]
