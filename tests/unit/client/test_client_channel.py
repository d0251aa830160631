"""Channel creation: target strings, options, TLS and mTLS against a real server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from client_fakes import FakeDaemon, FakeRouterService
from kvtest import make_pki

from kvd_client import KvdClient, TlsConfig, errors
from kvd_client.channel import (
    MAX_MESSAGE_BYTES,
    channel_options,
    is_unix_target,
    normalize_target,
)
from kvd_client.v1 import router_pb2_grpc


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("unix:///run/kvd.sock", "unix:///run/kvd.sock"),
        ("unix:/run/kvd.sock", "unix:/run/kvd.sock"),
        ("/run/kvd.sock", "unix:///run/kvd.sock"),
        ("10.0.0.1:7070", "10.0.0.1:7070"),
        ("[::1]:7070", "[::1]:7070"),
        ("dns:///kvd.local:7070", "dns:///kvd.local:7070"),
        ("  localhost:1 ", "localhost:1"),
    ],
)
def test_normalize_target(given: str, expected: str) -> None:
    assert normalize_target(given) == expected


def test_empty_target_is_refused() -> None:
    with pytest.raises(ValueError):
        normalize_target(" ")
    with pytest.raises(ValueError):
        KvdClient("")


def test_is_unix_target() -> None:
    assert is_unix_target("unix:/a") and is_unix_target("/a")
    assert not is_unix_target("127.0.0.1:1")


def test_default_options_and_overrides() -> None:
    opts = dict(channel_options())
    assert opts["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    assert opts["grpc.max_send_message_length"] == MAX_MESSAGE_BYTES
    assert opts["grpc.keepalive_time_ms"] > 0
    tls = TlsConfig(server_name_override="kvd.test")
    merged = dict(channel_options(tls, [("grpc.keepalive_time_ms", 1234)]))
    assert merged["grpc.keepalive_time_ms"] == 1234
    assert merged["grpc.ssl_target_name_override"] == "kvd.test"
    assert len(channel_options(tls, [("grpc.keepalive_time_ms", 1)])) == len(merged)


@pytest.mark.parametrize("form", ["unix:///", "unix:/", "/"])
def test_unix_target_forms_connect(daemon: FakeDaemon, form: str) -> None:
    path = str(daemon.unix_path).lstrip("/")
    with KvdClient(form + path) as kvd:
        assert kvd.get_status().serving


def test_tls_needs_both_halves_of_a_client_identity() -> None:
    with pytest.raises(ValueError, match="both"):
        TlsConfig(certificate_chain=b"cert")
    with pytest.raises(ValueError, match="both"):
        TlsConfig(private_key=b"key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server certificate for localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    return make_pki(tmp_path_factory.mktemp("pki"), ("server", "client"))


@pytest.fixture
def mtls_target(pki: Path) -> Iterator[str]:
    """A RouterService over TLS that requires a client certificate signed by the CA."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    router_pb2_grpc.add_RouterServiceServicer_to_server(FakeRouterService(), server)
    creds = grpc.ssl_server_credentials(
        [((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())],
        root_certificates=(pki / "ca.pem").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        yield f"localhost:{port}"
    finally:
        server.stop(grace=None).wait(5)


def test_mtls_round_trip(pki: Path, mtls_target: str) -> None:
    tls = TlsConfig.from_files(root_cert=pki / "ca.pem", client_cert=pki / "client.pem", client_key=pki / "client.key")
    with KvdClient(mtls_target, tls=tls) as kvd:
        assert kvd.get_status().serving


def test_mtls_refuses_a_client_without_certificate(pki: Path, mtls_target: str) -> None:
    tls = TlsConfig.from_files(root_cert=pki / "ca.pem")
    with KvdClient(mtls_target, tls=tls, timeout_s=5) as kvd, pytest.raises(errors.Unavailable):
        kvd.get_status()


def test_plaintext_client_cannot_talk_to_a_tls_server(mtls_target: str) -> None:
    with KvdClient(mtls_target, timeout_s=5) as kvd, pytest.raises(errors.Unavailable):
        kvd.get_status()
