"""Peer and router traffic over mutual TLS: daemons pull from each other; strangers are refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest import ShmEngine, make_pki, small_spec

import kvd
from kvd_client import KvdClient, TlsConfig, errors
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA and one certificate per node (server and client use) for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"), ("node-a", "node-b", "router"))


def _tls_flags(pki: Path, node: str) -> list[str]:
    return [
        "--tls-cert",
        str(pki / f"{node}.pem"),
        "--tls-key",
        str(pki / f"{node}.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
    ]


def _pull_checked(holder: ShmEngine, reader: ShmEngine) -> None:
    """Register both engines; the reader pulls two of the holder's blocks, byte-exact."""
    holder.register()
    reader.register()
    holder.fill_random(4)
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[2, 3], num_tokens=30
    ).kv_transfer_params
    started = reader.client.start_pull(
        engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[5, 6], remote=params
    )
    assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
    assert reader.token_bytes([5, 6], 30).equal(holder.token_bytes([2, 3], 30))


def test_daemons_pull_over_mtls_and_refuse_clients_without_a_certificate(spawn_daemon, pki: Path) -> None:
    a = spawn_daemon(*_tls_flags(pki, "node-a"), name="a")
    b = spawn_daemon(*_tls_flags(pki, "node-b"), name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    try:
        _pull_checked(holder, reader)

        router_tls = TlsConfig.from_files(
            root_cert=pki / "ca.pem", client_cert=pki / "router.pem", client_key=pki / "router.key"
        )
        with KvdClient(a.tcp, tls=router_tls, timeout_s=10) as router:
            assert router.get_status().incarnation == a.incarnation
        # Plaintext against a TLS port.
        with KvdClient(a.tcp, timeout_s=3) as stranger, pytest.raises(errors.Unavailable):
            stranger.get_status()
        no_cert = TlsConfig.from_files(root_cert=pki / "ca.pem")
        # TLS but no client certificate.
        with KvdClient(a.tcp, tls=no_cert, timeout_s=3) as anonymous, pytest.raises(errors.Unavailable):
            anonymous.get_status()
    finally:
        holder.close()
        reader.close()


def test_engines_of_one_mtls_daemon_pull_from_each_other(spawn_daemon, pki: Path) -> None:
    """Both engines on one node whose daemon serves peers only over mTLS: its handshake with
    itself goes through its own TLS listener with its own certificate, then the pull reads in place."""
    a = spawn_daemon(*_tls_flags(pki, "node-a"), name="a")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(a.unix_target, "reader", small_spec())
    try:
        _pull_checked(holder, reader)
    finally:
        holder.close()
        reader.close()


def _kvd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_selftest_and_status_check_a_daemon_that_serves_only_mtls(spawn_daemon, pki: Path) -> None:
    """An operator's check of a production daemon: `kvd selftest --peer` and `kvd status` with the
    same three TLS flags. The daemon the selftest starts pulls from the peer over mTLS too."""
    peer = spawn_daemon(*_tls_flags(pki, "node-b"), name="peer")
    plain = _kvd("selftest", "--peer", peer.tcp, "--size-mb", "8", "--iterations", "1")
    assert plain.returncode != 0 and "FAIL" in plain.stdout  # plaintext against an mTLS-only port

    result = _kvd("selftest", "--peer", peer.tcp, *_tls_flags(pki, "node-a"), "--size-mb", "8", "--iterations", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bytes match" in result.stdout and "raw NIXL read 1/1" in result.stdout
    assert result.stdout.rstrip().endswith("PASS")

    status = _kvd("status", "--target", peer.tcp, *_tls_flags(pki, "router"), timeout=30)
    assert status.returncode == 0, status.stderr
    assert f"kvd {peer.incarnation[:8]}" in status.stdout and f"version {kvd.__version__}" in status.stdout

    half = _kvd("selftest", "--peer", peer.tcp, "--tls-cert", str(pki / "node-a.pem"), timeout=30)
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stderr


def _log_says(daemon: object, text: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in daemon.log_path.read_text(errors="replace"):  # type: ignore[attr-defined]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("tls", [True, False], ids=["mtls", "plaintext-loopback"])
def test_a_daemon_warms_its_own_tcp_listener_once_it_serves(spawn_daemon, pki: Path, tls: bool) -> None:
    """kvd.server.warmup: right after it serves, the daemon calls its own TCP listener once (a
    health check, with the credentials it calls peers with), so a reader's first Handshake does
    not pay the listener's first call. It must get through mutual TLS as peers do."""
    flags = [*_tls_flags(pki, "node-a")] if tls else []
    daemon = spawn_daemon(*flags, "--log-level", "DEBUG", name="warm")
    assert _log_says(daemon, f"warmed the TCP listener through {daemon.tcp}"), daemon.log_tail(40)
    assert "warming the TCP listener" not in daemon.log_path.read_text(errors="replace")
