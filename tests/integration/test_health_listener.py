"""The health-only listener: probes (the kubelet's) work in plaintext while the main port needs mTLS."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtest import make_pki

from kvd.server.app import LIVENESS_SERVICE
from kvd_client.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"), ("node", "operator"))


def _check(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def test_probes_answer_in_plaintext_while_the_main_port_requires_client_certificates(
    spawn_daemon, pki: Path, tmp_path: Path
) -> None:
    tls = ["--tls-cert", str(pki / "node.pem"), "--tls-key", str(pki / "node.key"), "--tls-ca", str(pki / "ca.pem")]
    daemon = spawn_daemon(*tls, "--health-port", "0", name="node")
    health = json.loads((tmp_path / "node.ready.json").read_text())["health"]

    assert _check(health) == health_pb2.HealthCheckResponse.SERVING  # what a kubelet gRPC probe does
    assert _check(health, LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING  # the liveness probe's name
    with pytest.raises(grpc.RpcError) as refused:
        _check(daemon.tcp)  # the same probe against the mTLS port fails
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # the health listener serves health and nothing else
    with grpc.insecure_channel(health) as channel, pytest.raises(grpc.RpcError) as only_health:
        router_pb2_grpc.RouterServiceStub(channel).GetStatus(router_pb2.GetStatusRequest(), timeout=5)
    assert only_health.value.code() == grpc.StatusCode.UNIMPLEMENTED

    # an operator with a certificate still gets the status over mTLS
    tls = [
        "--tls-ca",
        str(pki / "ca.pem"),
        "--tls-cert",
        str(pki / "operator.pem"),
        "--tls-key",
        str(pki / "operator.key"),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", "status", "--target", daemon.tcp, "--json", *tls],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["incarnation"] == daemon.incarnation
