"""`kvd serve` speaks systemd's notify protocol to a real AF_UNIX datagram socket (Type=notify)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    yield sock, path
    sock.close()


def _serve(tmp_path: Path, env: dict[str, str], *flags: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kvd.cli.main", "serve",
        "--unix-socket", str(tmp_path / "run" / "engine.sock"),
        "--port", "0", "--metrics-port", "0", "--health-port", "0",
        "--ready-file", str(tmp_path / "ready.json"),
        *flags,
    ]  # fmt: skip
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def _next(sock: socket.socket, timeout_s: float) -> dict[str, str]:
    sock.settimeout(timeout_s)
    data = sock.recv(65536).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_ready_once_every_listener_serves_then_watchdog_then_stopping(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    process = _serve(tmp_path, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "600000"})  # pings every 0.3 s
    try:
        messages = []
        while True:
            message = _next(sock, 90)
            messages.append(message)
            if message.get("READY") == "1":
                break
        # STATUS= lines came before READY (systemctl status shows what start-up is doing)
        assert any("starting" in m.get("STATUS", "") for m in messages[:-1]), messages
        ready = messages[-1]
        assert ready["MAINPID"] == str(process.pid)
        assert ready["STATUS"].startswith("serving on ")
        # READY=1 means every listener answers, right now
        info = json.loads((tmp_path / "ready.json").read_text())
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _health(info["tcp"]) == serving
        assert _health(f"unix://{info['unix']}") == serving
        assert _health(info["health"]) == serving

        pings = []
        deadline = time.monotonic() + 30
        while len(pings) < 3 and time.monotonic() < deadline:
            message = _next(sock, 10)
            if message.get("WATCHDOG") == "1":
                pings.append(time.monotonic())
                assert message["STATUS"].startswith("serving on ")  # live status rides on each ping
        assert len(pings) == 3

        process.send_signal(signal.SIGTERM)
        while True:
            message = _next(sock, 30)
            if message.get("STOPPING") == "1":
                break
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_no_watchdog_pings_without_watchdog_usec_or_for_another_pid(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    """WATCHDOG_PID names the process the watchdog is for; a daemon that is not it does not ping."""
    sock, path = notify_socket
    process = _serve(tmp_path, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    try:
        while _next(sock, 90).get("READY") != "1":
            pass
        sock.settimeout(1.5)
        with pytest.raises(TimeoutError):
            while True:
                assert "WATCHDOG" not in _next(sock, 1.5)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0


def test_a_failed_start_reports_its_status_and_never_ready(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        env = {**os.environ, "NOTIFY_SOCKET": path}
        cmd = [sys.executable, "-m", "kvd.cli.main", "serve", "--unix-socket", str(tmp_path / "e.sock"), "--port", port]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    finally:
        taken.close()
    assert result.returncode == 1
    message = _next(sock, 5)
    assert "READY" not in message
    assert message["STATUS"].startswith("failed to start: TCP port") and port in message["STATUS"]
