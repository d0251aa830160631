"""The peer stream over a holder's framed TCP port (``peer_stream_port``), real daemons.

A reader's calls to a holder go there once it connected after the handshake (``kvd status``
says so per peer), and pulls move exact bytes over it, with the default transports and over UCX
TCP. A holder that serves no such port is called over gRPC. The port is the gRPC port's door:
over mTLS only a certificate naming a peer gets through (a router's is refused PERMISSION_DENIED
and runs nothing; no certificate, no TLS session), and on plaintext loopback only a trusted uid.
Hostile bytes end that connection alone with a precise status; the holder serves on.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from kvtest import ShmEngine, engine_pair, small_spec
from pki import make_identities
from test_stream_pulls import Heard, assert_exact, hold_each, pull, wait_takes_pulls

from kvd_client import KvdClient, TlsConfig, errors
from kvd_client._frames import MAX_FRAME_BYTES, encode, end_error
from kvd_client.v1 import common_pb2, peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.integration

MAGIC = b"KVDPEER1"


def framed_port(tcp: str, tls: TlsConfig | None = None) -> int:
    """The port a daemon names in its handshake (0: it serves none)."""
    channel = grpc.secure_channel(tcp, tls.credentials()) if tls is not None else grpc.insecure_channel(tcp)
    with channel:
        return int(
            peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=10).peer_stream_port
        )


def frames_of(sock: socket.socket | ssl.SSLSocket) -> list[peer_pb2.PeerFrame]:
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except (ConnectionError, ssl.SSLError):
            break
        if not chunk:
            break
        data += chunk
    frames = []
    while len(data) >= 4:
        (length,) = struct.unpack(">I", data[:4])
        frames.append(peer_pb2.PeerFrame.FromString(data[4 : 4 + length]))
        data = data[4 + length :]
    return frames


def end_of(sock: socket.socket | ssl.SSLSocket) -> tuple[list[peer_pb2.PeerFrame], errors.KvdError | None]:
    frames = frames_of(sock)
    assert frames and frames[-1].WhichOneof("kind") == "end", frames
    return frames[:-1], end_error(frames[-1].end)


def peer_framed(client: KvdClient, address: str) -> bool:
    return any(p.framed_stream for p in client.get_status().peers if p.address == address)


def wait_framed(client: KvdClient, address: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not peer_framed(client, address):
        assert time.monotonic() < deadline, f"calls to {address} never went on its framed port"
        time.sleep(0.02)


def pull_on_stream(holder: ShmEngine, reader: ShmEngine, rids: list[str]) -> None:
    """Pull ``rids`` on the reader's engine stream; every one exact."""
    stream = reader.client.open_engine_stream("reader", 0)
    try:
        wait_takes_pulls(stream)
        held, local, params = hold_each(holder, rids)
        seq = stream.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in rids])
        heard = Heard(stream)
        heard.until(lambda: seq in heard.answers() and set(rids) <= set(heard.finished()), what="the pulls")
        for rid in rids:
            assert_exact(holder, reader, held[rid], local[rid], rid)
    finally:
        stream.close()


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_a_readers_calls_go_on_the_holders_framed_port_and_pulls_are_exact(spawn_daemon, transports: str) -> None:
    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    a, b = spawn_daemon(name="a", env=env), spawn_daemon(name="b", env=env)
    assert framed_port(a.tcp) > 0
    with engine_pair(a.unix_target, b.unix_target, small_spec(num_blocks=48), seed=41) as (holder, reader):
        pull_on_stream(holder, reader, ["warm-up"])
        wait_framed(reader.client, a.tcp)
        pull_on_stream(holder, reader, [f"req-{i}" for i in range(6)])
        assert peer_framed(reader.client, a.tcp)


def test_a_holder_without_the_port_is_called_over_grpc(spawn_daemon) -> None:
    a = spawn_daemon(name="a", env={**os.environ, "KVD_PEER_STREAM_PORT": "-1"})
    b = spawn_daemon(name="b")
    assert framed_port(a.tcp) == 0
    with engine_pair(a.unix_target, b.unix_target, small_spec(num_blocks=48), seed=42) as (holder, reader):
        pull_on_stream(holder, reader, ["req-0", "req-1"])
        time.sleep(0.3)
        assert not peer_framed(reader.client, a.tcp)
        pull_on_stream(holder, reader, ["req-2"])


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=15)
    return sock


def test_hostile_bytes_end_that_connection_alone_and_the_holder_serves_on(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    port = framed_port(a.tcp)
    cases = {
        "wrong magic": (b"PRI * HTTP/2.0\r\n", errors.InvalidArgument, "not a kvd peer stream"),
        "a frame over the limit": (MAGIC + struct.pack(">I", MAX_FRAME_BYTES + 1), errors.InvalidArgument, "over the"),
        "bytes that are no PeerCalls": (
            MAGIC + struct.pack(">I", 5) + b"\xff\xff\xff\xff\xff",
            errors.InvalidArgument,
            "malformed kvd.v1.PeerCalls",
        ),
        "a stream cut inside a frame": (MAGIC + struct.pack(">I", 64) + b"\x0a\x00", errors.InvalidArgument, "inside"),
    }
    for case, (payload, cls, words) in cases.items():
        with _raw(port) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            _, error = end_of(sock)
        assert type(error) is cls and words in error.message, (case, error)
    # A well-formed call of a lease nobody holds: answered with its exact class, the stream ends OK.
    call = peer_pb2.PeerCall(
        call_id=7, timeout_ms=5000, prepare_pull=peer_pb2.PreparePullRequest(lease_id="no-such-lease", engine_id="x")
    )
    with _raw(port) as sock:
        sock.sendall(MAGIC + encode(peer_pb2.PeerCalls(calls=[call])))
        sock.shutdown(socket.SHUT_WR)
        frames, error = end_of(sock)
    (reply,) = [r for f in frames for r in f.replies.replies]
    assert error is None and reply.call_id == 7 and reply.error_class == "UnknownLease", reply
    with engine_pair(a.unix_target, b.unix_target, small_spec(num_blocks=48), seed=43) as (holder, reader):
        pull_on_stream(holder, reader, ["req-after"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_identities(
        tmp_path_factory.mktemp("pki"),
        {
            "node-a": ["URI:spiffe://kvd.test/node/a"],
            "node-b": ["URI:spiffe://kvd.test/node/b"],
            "router": ["DNS:router.kvd.test"],
        },
    )


def _flags(pki: Path, node: str) -> list[str]:
    return [
        f"--tls-cert={pki / node}.pem",
        f"--tls-key={pki / node}.key",
        f"--tls-ca={pki / 'ca.pem'}",
        "--tls-peer-names=spiffe://kvd.test/node/*",
        "--tls-router-names=router.kvd.test",
    ]


def _tls_socket(pki: Path, port: int, identity: str | None) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if identity is not None:
        context.load_cert_chain(str(pki / f"{identity}.pem"), str(pki / f"{identity}.key"))
    return context.wrap_socket(_raw(port), server_hostname="127.0.0.1")


def test_over_mtls_only_a_peer_certificate_gets_through(spawn_daemon, pki: Path) -> None:
    a, b = spawn_daemon(*_flags(pki, "node-a"), name="a"), spawn_daemon(*_flags(pki, "node-b"), name="b")
    peer_tls = TlsConfig.from_files(
        root_cert=pki / "ca.pem", client_cert=pki / "node-b.pem", client_key=pki / "node-b.key"
    )
    port = framed_port(a.tcp, peer_tls)
    assert port > 0
    with engine_pair(a.unix_target, b.unix_target, small_spec(num_blocks=48), seed=44) as (holder, reader):
        pull_on_stream(holder, reader, ["warm-up"])
        wait_framed(reader.client, a.tcp)
        pull_on_stream(holder, reader, ["req-0", "req-1", "req-2"])
    # A router's certificate: TLS succeeds, the stream is refused before anything runs.
    with _tls_socket(pki, port, "router") as sock:
        sock.sendall(MAGIC)
        frames, error = end_of(sock)
    assert not frames and type(error) is errors.PermissionDenied and "needs role peer" in error.message, error
    # No certificate: the server asks for one, so the TLS session never carries a byte of the stream.
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)), _tls_socket(pki, port, None) as sock:
        sock.sendall(MAGIC)
        assert not frames_of(sock)
        raise ConnectionError("closed without an answer")
    # Plaintext on the TLS port: no answer either.
    with _raw(port) as sock:
        sock.sendall(MAGIC + encode(peer_pb2.PeerCalls()))
        sock.shutdown(socket.SHUT_WR)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError, AssertionError)):
            end_of(sock)


_AS_NOBODY = textwrap.dedent(
    """
    import encodings.idna, os, socket, struct, sys  # every import before the uid drops (root-only paths)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=15)
    sock.sendall(b"KVDPEER1")
    sock.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sys.stdout.buffer.write(data)
    """
)


@pytest.mark.skipif(os.getuid() != 0, reason="dropping to another uid needs root")
def test_another_uid_on_loopback_is_refused_unauthenticated(spawn_daemon) -> None:
    a = spawn_daemon(name="a")
    port = framed_port(a.tcp)
    out = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(port)], capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    (length,) = struct.unpack(">I", out.stdout[:4])
    frame = peer_pb2.PeerFrame.FromString(out.stdout[4 : 4 + length])
    error = end_error(frame.end)
    assert type(error) is errors.Unauthenticated and "uid 65534" in error.message, error
    assert isinstance(frame.end, common_pb2.StreamEnd)
