"""What the daemon's TCP listeners and its calls to peers authenticate with, read from the config
once at start: gRPC's TLS credentials, the framed peer port's TLS contexts from the same files
(kvd.server.peer_frames), and the authorization policy (kvd.server.authz). Unusable files or
tokens are start-up errors naming the keys to fix."""

from __future__ import annotations

import ssl

import grpc

from kvd.config import KvdConfig
from kvd.server import startup
from kvd.server.authz import Policy
from kvd.server.peer_frames import tls_contexts
from kvd.server.startup import CONFIG_ERROR, StartupError


def grpc_credentials(config: KvdConfig) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    """(server, channel) TLS credentials of the gRPC port and of calls to peers; None without TLS.
    A client certificate is required exactly where ``tls_ca`` is set."""
    if not config.tls_enabled:
        return None, None
    cert = startup.read_tls_file("tls_cert", config.tls_cert)
    key = startup.read_tls_file("tls_key", config.tls_key)
    ca = startup.read_tls_file("tls_ca", config.tls_ca) if config.tls_ca else None
    try:
        server = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
        channel = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StartupError(
            f"the TLS files are not usable: {exc}", "check tls_cert, tls_key and tls_ca", CONFIG_ERROR
        ) from exc
    return server, channel


def frames_tls(config: KvdConfig) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """The framed peer port's TLS (server, client), from the gRPC port's files (kvd.server.peer_frames)."""
    try:
        return tls_contexts(config)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise StartupError(
            f"the TLS files are not usable for the peer stream: {exc}",
            "check tls_cert, tls_key and tls_ca",
            CONFIG_ERROR,
        ) from exc


def policy(config: KvdConfig) -> Policy:
    """The roles of every kind of caller (kvd.server.authz), router tokens read once."""
    try:
        return Policy.from_config(config)
    except (OSError, ValueError) as exc:
        raise StartupError(
            f"cannot read router_token_file {config.router_token_file}: {exc}",
            "fix router_token_file (one token per line, readable by the daemon)",
            CONFIG_ERROR,
        ) from exc
