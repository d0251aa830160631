"""The peer stream over a holder's framed TCP port, without gRPC (proto/kvd/v1/peer.proto,
``PeerFrame``, says how).

Every pull's admission is a PreparePull on the peer stream (kvd.server.peer_stream): a message
each way between two daemons, on the pull's critical path. A gRPC stream message cost 0.3-0.4 ms
each way there under a pull's load; the same bytes on a plain socket cost a fraction of it
(docs/performance.md, "The peer stream without gRPC"). So a holder also serves the peer stream on
a TCP port of its own (``peer_stream_port``; 0: any free port), which it names in every handshake
(``HandshakeResponse.peer_stream_port``); a reader connects there in the background after the
handshake and sends its calls on it once connected, on gRPC's stream until then, and for good
where it cannot connect (kvd.server.peer_stream.PeerStreamCaller).

The same door as the gRPC port: TLS exactly when gRPC is, with the same certificate, key and CA
(:func:`tls_contexts`: the caller must present a certificate where ``tls_ca`` is set, and the
reader checks the holder's name as gRPC does); the caller must hold role ``peer``, decided by the
one policy (kvd.server.authz: certificate SANs, a trusted uid on loopback, ``allow_insecure_tcp``);
each frame is parsed and bounded as a gRPC request is (kvd.server.request_bounds); and the holder
runs the very stream the gRPC one runs (:func:`kvd.server.peer_stream.serve_peer_stream`), so
every rule of a call (ids, deadlines, withdrawals, errors, bounds) is the same. Hostile bytes end
that connection alone, INVALID_ARGUMENT; a caller that is not a peer gets PERMISSION_DENIED or
UNAUTHENTICATED, as from gRPC, having run nothing. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvd.config import KvdConfig
from kvd.core.metrics import Metrics
from kvd.server.authz import PEER, Policy, denial
from kvd.server.edge import as_kvd_error
from kvd.server.framed import FramedListener, end_of
from kvd.server.peer_stream import PeerHandlers, StreamBroken, serve_peer_stream
from kvd.server.request_bounds import check_request, parser_of
from kvd_client._frames import HEADER, encode, end_error, frame_length
from kvd_client.errors import InvalidArgument, KvdError, PeerUnavailable, Unavailable
from kvd_client.v1 import common_pb2, peer_pb2

logger = logging.getLogger(__name__)

MAGIC = b"KVDPEER1"
"""What a reader writes first on a holder's framed port: the protocol and its version."""
HELLO_TIMEOUT_S = 10.0  # a connection must send its first 8 bytes within this (then it is dropped)
CONNECT_TIMEOUT_S = 3.0  # a reader gives up connecting after this, and keeps calling on gRPC
READ_LIMIT = 1 << 20
METHOD = "/kvd.v1.PeerService/PeerStream"  # the roles it needs are that RPC's (kvd.server.authz)
_parse = parser_of(peer_pb2.PeerCalls)


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on a framed peer connection, as gRPC's keepalive on a peer channel (ping after
    10 s idle, every 5 s): a peer that vanished without a reset (a cut link, a dead host) breaks the
    stream within ~25 s, and its calls go back on gRPC, instead of each waiting out its deadline."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def tls_contexts(config: KvdConfig) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server, client) TLS contexts matching the gRPC port's credentials (kvd.server.app), or
    (None, None) without TLS. The server asks for a client certificate exactly where gRPC
    requires one (``tls_ca`` set); the client presents this daemon's certificate and checks the
    holder's against ``tls_ca`` (else the system's roots) and its name, as a gRPC channel does."""
    if not config.tls_enabled:
        return None, None
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_2
    server.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_ca:
        server.load_verify_locations(cafile=config.tls_ca)
        server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca or None)
    client.minimum_version = ssl.TLSVersion.TLSv1_2
    client.load_cert_chain(config.tls_cert, config.tls_key)
    return server, client


def _peer_of(writer: asyncio.StreamWriter) -> str:
    """The caller as gRPC names a TCP peer (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    name = writer.get_extra_info("peername")
    if not isinstance(name, tuple) or len(name) < 2:
        return ""
    host, port = name[0], name[1]
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def _auth_of(writer: asyncio.StreamWriter) -> dict[str, list[bytes]]:
    """What gRPC's auth context says of a TLS caller: the SANs of a verified client certificate."""
    ssl_object = writer.get_extra_info("ssl_object")
    if ssl_object is None:
        return {}
    cert = ssl_object.getpeercert() or {}
    names = cert.get("subjectAltName", ())
    return {
        "transport_security_type": [b"ssl"],
        "peer_dns": [str(value).encode() for kind, value in names if kind == "DNS"],
        "peer_uri": [str(value).encode() for kind, value in names if kind == "URI"],
    }


class _Refused(Exception):
    """The caller may not use the peer stream (its status, as the gRPC port would answer)."""

    def __init__(self, error: KvdError) -> None:
        super().__init__(error.message)
        self.error = error


class PeerFrames:
    """A holder's framed peer-stream listener (module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        policy: Policy,
        handlers: Callable[[], PeerHandlers],
        metrics: Metrics,
        server_tls: ssl.SSLContext | None,
        on_denied: Callable[[str, str], None] | None = None,
    ) -> None:
        self._host = host
        self._asked_port = port
        self._policy = policy
        self._handlers = handlers
        self._metrics = metrics
        self._tls = server_tls
        self._on_denied = on_denied
        self._listener = FramedListener(
            self._run,
            lambda end: encode(peer_pb2.PeerFrame(end=end)),
            Unavailable("the daemon is shutting down: call its replacement"),
        )
        self.port = 0

    async def start(self) -> int:
        """Listen; the port bound (the one asked for, or a free one for 0)."""
        server = self._listener.server = await asyncio.start_server(
            self._listener.serve,
            host=self._host,
            port=self._asked_port,
            ssl=self._tls,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if self._tls is not None else None,
            limit=READ_LIMIT,
            reuse_address=True,
        )
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stop listening and end every stream UNAVAILABLE (as the gRPC server's stop ends its calls)."""
        await self._listener.stop()

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> common_pb2.StreamEnd:
        keep_alive(writer)
        try:
            self._authorize(writer)
            try:
                magic = await asyncio.wait_for(reader.readexactly(len(MAGIC)), HELLO_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError):
                raise InvalidArgument(
                    f"not a kvd peer stream: it must begin with {MAGIC!r} within {HELLO_TIMEOUT_S:.0f} s"
                ) from None
            if magic != MAGIC:
                raise InvalidArgument(f"not a kvd peer stream: it must begin with {MAGIC!r}, got {magic!r}")
            async for replies in serve_peer_stream(self._requests(reader), self._handlers(), self._metrics):
                writer.write(encode(peer_pb2.PeerFrame(replies=replies)))
                await writer.drain()
        except _Refused as refused:
            return end_of(refused.error)  # counted by on_denied, as the gRPC port counts it
        except KvdError as exc:
            return end_of(as_kvd_error(self._metrics, "PeerStream", exc))
        return common_pb2.StreamEnd()

    def _authorize(self, writer: asyncio.StreamWriter) -> None:
        principal = self._policy.tcp_principal(_auth_of(writer), _peer_of(writer), (), self.port)
        if PEER in principal.roles:
            return
        error = denial(METHOD, frozenset({PEER}), principal)
        logger.info("refused the framed peer stream from %s: %s", principal.description, error.message)
        if self._on_denied is not None:
            self._on_denied(METHOD, error.code.name)
        raise _Refused(error)

    async def _requests(self, reader: asyncio.StreamReader) -> AsyncIterator[peer_pb2.PeerCalls]:
        """The reader's messages, each parsed and bounded as a gRPC request is; ends at its
        half-close (the end of its bytes, between two frames)."""
        while True:
            try:
                header = await reader.readexactly(HEADER.size)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise InvalidArgument("the peer stream ended inside a frame's length") from None
                return
            length = frame_length(header)
            try:
                body = await reader.readexactly(length)
            except asyncio.IncompleteReadError:
                raise InvalidArgument(f"the peer stream ended inside a frame of {length} bytes") from None
            yield check_request(_parse(body))  # type: ignore[misc]


class FramedPeerCall:
    """The reader's end of one framed peer stream: what kvd.server.peer_stream's open stream
    uses in place of a grpc.aio stream call (``write``, ``read``, ``cancel``)."""

    def __init__(self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._address = address
        self._reader = reader
        self._writer = writer
        self._cancelled = False

    @classmethod
    async def connect(cls, address: str, host: str, port: int, tls: ssl.SSLContext | None) -> FramedPeerCall:
        """Connect to the holder's framed port (its name checked as gRPC checks it, over TLS)."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=tls, server_hostname=host if tls is not None else None, limit=READ_LIMIT
            ),
            CONNECT_TIMEOUT_S,
        )
        keep_alive(writer)
        writer.write(MAGIC)
        return cls(address, reader, writer)

    async def write(self, calls: peer_pb2.PeerCalls) -> None:
        self._writer.write(encode(calls))
        await self._writer.drain()

    def write_now(self, calls: peer_pb2.PeerCalls) -> bool:
        """Write without awaiting, where nothing of this stream is still unsent (so no write
        ever grows the buffer past what :meth:`write`'s drain bounds); False: nothing written."""
        if self._cancelled or self._writer.transport.get_write_buffer_size():
            return False
        self._writer.write(encode(calls))
        return True

    async def read(self) -> peer_pb2.PeerReplies | Any:
        """The holder's next replies; ``grpc.aio.EOF`` at its clean end; StreamBroken otherwise."""
        try:
            body = await self._reader.readexactly(frame_length(await self._reader.readexactly(HEADER.size)))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError):
            why = "this daemon dropped it" if self._cancelled else "the connection closed without an end"
            raise StreamBroken(why) from None
        frame = peer_pb2.PeerFrame.FromString(body)
        if frame.WhichOneof("kind") == "replies":
            return frame.replies
        error = end_error(frame.end)
        if error is None:
            return grpc.aio.EOF
        raise StreamBroken(error.message, error.code, frame.end.error_class)

    def cancel(self) -> None:
        self._cancelled = True
        self._writer.close()


def split_host(address: str) -> str:
    """The host of a peer address (``10.0.0.13:50151``, ``[fd00::1]:50151``, ``node-a:50151``)."""
    host, _, _ = address.rpartition(":")
    if not host:
        raise PeerUnavailable(f"peer address {address!r} names no host")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
