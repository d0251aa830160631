"""Channels to kvd daemons: targets, TLS and every channel option, for clients and daemons alike.

Engines reach their node's daemon over a Unix socket; routers and peers over TCP, optionally with
(m)TLS. The sync and asyncio clients, the engine patch's config and the daemon (its servers and
its peer client) all take their targets and options from here, so that a target string, a TLS
config and a keepalive mean the same thing everywhere.

Every channel made here names its version: grpc sends ``user-agent: kvd-client/<version> grpc-...``
with each call (:data:`USER_AGENT_OPTION`). A channel option rather than an interceptor: it covers
the sync and asyncio clients, every kind of call (streams, health checks) and the daemon's own peer
channels alike, and costs nothing per call. The daemon logs clients older than it supports
(``kvd.server.client_versions``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from .version import USER_AGENT

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest message either way: registration requests carry one entry per layer and region, status
responses one per engine and peer; 64 MiB leaves room without letting a bug allocate unbounded."""

ChannelOptions = Sequence[tuple[str, Any]]

USER_AGENT_OPTION: tuple[str, Any] = ("grpc.primary_user_agent", USER_AGENT)
"""``kvd-client/<version>`` at the head of every call's ``user-agent`` (grpc appends its own)."""

DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive finds a dead peer daemon across nodes (a half-open TCP connection) in ~40 s
    # instead of the kernel's hours. No pings without calls: a server with stock settings would
    # answer an idle client's pings with GOAWAY (too_many_pings).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # Reconnect quickly after a daemon restart: engines must not wait long for their node's daemon.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    USER_AGENT_OPTION,
)
"""Options of a client's channel (engines and routers to their daemon)."""

PEER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Daemon to daemon: a pull waits on its peer, so a dead or frozen peer must be noticed within
    # ~15 s, sooner than a client needs to notice its own node's daemon.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)
"""Options of the daemon's channels to peer daemons, and of the daemon's own servers."""

PEER_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (*PEER_OPTIONS, USER_AGENT_OPTION)
"""The daemon's channels to peer daemons: a peer's log names a daemon older than it supports too."""

SERVER_OPTIONS = [*PEER_OPTIONS, ("grpc.so_reuseport", 0)]
"""The daemon's servers. gRPC turns SO_REUSEPORT on by default; two daemons on one port must be an
error, not a coin toss."""


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """TLS material for a TCP channel, as PEM bytes.

    With only ``root_certificates`` the client checks the daemon; adding ``certificate_chain`` and
    ``private_key`` also authenticates the client (mTLS), which is what protects a daemon's NIXL
    agent metadata from callers that merely reach its port.
    """

    root_certificates: bytes | None = None
    """PEM of the CAs that signed the daemon's certificate; None: the system's roots."""
    certificate_chain: bytes | None = None
    """PEM of the client's certificate (mTLS); needs ``private_key``."""
    private_key: bytes | None = None
    """PEM of the client's private key (mTLS); needs ``certificate_chain``."""
    server_name_override: str | None = None
    """Name to check the daemon's certificate against when it differs from the target host
    (tests, or addressing a daemon by IP); never use it to paper over a wrong certificate."""

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mTLS needs both certificate_chain and private_key, or neither")

    @classmethod
    def from_files(
        cls,
        root_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name_override: str | None = None,
    ) -> TlsConfig:
        """Read the PEM files an operator points at (paths, as in a config file)."""

        def read(path: str | Path | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(
            root_certificates=read(root_cert),
            certificate_chain=read(client_cert),
            private_key=read(client_key),
            server_name_override=server_name_override,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """The grpc channel credentials for this config."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def normalize_target(target: str) -> str:
    """The grpc target for what an operator typed.

    Accepted: ``unix:///abs/path``, ``unix:/abs/path``, ``unix:rel/path``, a bare absolute path
    (``/run/kvd/engine.sock``, taken as a Unix socket: ``unix:///run/kvd/engine.sock``),
    ``host:port``, ``[v6]:port`` and any other grpc URI (``dns:///host:port``,
    ``unix-abstract:name``), passed through unchanged.
    """
    target = target.strip()
    if not target:
        raise ValueError("empty kvd target")
    if target.startswith("/"):
        return "unix://" + target
    return target


def is_unix_target(target: str) -> bool:
    """Whether ``target`` names a Unix socket (engine-facing traffic, where TLS is pointless)."""
    return normalize_target(target).startswith(("unix:", "unix-abstract:"))


def channel_options(tls: TlsConfig | None = None, extra: ChannelOptions = ()) -> list[tuple[str, Any]]:
    """The default options, then TLS's, then ``extra``; later entries replace earlier ones."""
    merged: dict[str, Any] = dict(DEFAULT_OPTIONS)
    if tls is not None and tls.server_name_override:
        merged["grpc.ssl_target_name_override"] = tls.server_name_override
    merged.update(dict(extra))
    return list(merged.items())


def create_channel(target: str, *, tls: TlsConfig | None = None, options: ChannelOptions = ()) -> grpc.Channel:
    """A sync channel to a daemon (see :func:`normalize_target` for ``target``)."""
    address = normalize_target(target)
    opts = channel_options(tls, options)
    logger.debug("opening channel to %s (tls=%s)", address, tls is not None)
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, tls.credentials(), options=opts)


def create_aio_channel(target: str, *, tls: TlsConfig | None = None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An asyncio channel to a daemon; call it from the event loop that will use it."""
    address = normalize_target(target)
    opts = channel_options(tls, options)
    logger.debug("opening aio channel to %s (tls=%s)", address, tls is not None)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, tls.credentials(), options=opts)
