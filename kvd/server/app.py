"""Start-up and shutdown of `kvd serve`: two gRPC servers, metrics, signals.

* Unix socket (owner-only): EngineService + RouterService + health, for engines on this node.
* TCP (loopback unless configured; mTLS optional): PeerService + RouterService + health +
  reflection, for peer daemons and routers.
* Prometheus ``/metrics`` over HTTP.

SIGTERM / SIGINT: health goes NOT_SERVING, in-flight pulls finish or are aborted within the
grace period, every lease and registration is released, exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import stat
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvd.config import KvdConfig
from kvd.core.daemon import Daemon
from kvd.core.metrics import Metrics
from kvd.server.peer_client import GrpcPeerTransport
from kvd.server.servicers import EngineServicer, PeerServicer, RouterServicer
from kvd_client.channel import SERVER_OPTIONS
from kvd_client.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAMES = (
    engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
    peer_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name,
    router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
)


@dataclasses.dataclass
class Running:
    """A started daemon and its servers (what tests and `kvd selftest` in-process use)."""

    daemon: Daemon
    unix_server: grpc.aio.Server
    tcp_server: grpc.aio.Server
    health: HealthServicer
    tcp_address: str
    unix_socket: str
    metrics_address: str
    metrics_server: object | None


def _credentials(config: KvdConfig) -> tuple[grpc.ServerCredentials | None, grpc.ChannelCredentials | None]:
    if not config.tls_enabled:
        return None, None
    cert = Path(config.tls_cert).read_bytes()
    key = Path(config.tls_key).read_bytes()
    ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
    server = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
    channel = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return server, channel


def _prepare_unix_socket(path: str) -> None:
    """Owner-only directory; refuse to steal a live daemon's socket, remove a stale one."""
    sock_path = Path(path)
    sock_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not sock_path.exists():
        return
    if not stat.S_ISSOCK(sock_path.stat().st_mode):
        raise SystemExit(f"kvd: {path} exists and is not a socket; choose another --unix-socket")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except OSError:
        sock_path.unlink()  # stale: its daemon is gone
        return
    finally:
        probe.close()
    raise SystemExit(f"kvd: another daemon is serving on {path}; stop it or choose another --unix-socket")


async def start(config: KvdConfig) -> Running:
    """Start the daemon and its servers; returns once everything listens."""
    server_creds, channel_creds = _credentials(config)
    metrics = Metrics()
    holder: list[Daemon] = []
    transport = GrpcPeerTransport(
        lambda: holder[0].advertise_address, lambda: holder[0].incarnation, channel_creds
    )
    daemon = Daemon(config, transport, metrics)
    holder.append(daemon)
    await daemon.start()

    health = HealthServicer()
    engine, peer, router = EngineServicer(daemon), PeerServicer(daemon), RouterServicer(daemon)

    unix_server = grpc.aio.server(options=SERVER_OPTIONS)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, unix_server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, unix_server)
    health_pb2_grpc.add_HealthServicer_to_server(health, unix_server)
    _prepare_unix_socket(config.unix_socket)
    unix_server.add_insecure_port(f"unix:{config.unix_socket}")

    tcp_server = grpc.aio.server(options=SERVER_OPTIONS)
    peer_pb2_grpc.add_PeerServiceServicer_to_server(peer, tcp_server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, tcp_server)
    health_pb2_grpc.add_HealthServicer_to_server(health, tcp_server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        tcp_server,
    )
    bind = f"{config.host}:{config.port}"
    port = tcp_server.add_secure_port(bind, server_creds) if server_creds else tcp_server.add_insecure_port(bind)
    if port == 0:
        raise SystemExit(f"kvd: cannot listen on {bind}")
    tcp_address = f"{config.host}:{port}"
    daemon.advertise_address = config.advertise_address or tcp_address

    await unix_server.start()
    os.chmod(config.unix_socket, 0o600)
    await tcp_server.start()

    metrics_server = None
    metrics_address = ""
    if config.metrics_port >= 0:
        metrics_server, _ = start_http_server(config.metrics_port, config.metrics_host, registry=metrics.registry)
        metrics_address = f"{config.metrics_host}:{metrics_server.server_port}"

    for name in ("", *SERVICE_NAMES):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = Running(
        daemon, unix_server, tcp_server, health, tcp_address, config.unix_socket, metrics_address, metrics_server
    )
    if config.ready_file:
        _write_ready_file(config.ready_file, running)
    logger.info(
        "kvd serving: engines on unix:%s, peers/routers on %s (advertised %s), metrics on %s",
        config.unix_socket,
        tcp_address,
        daemon.advertise_address,
        metrics_address or "off",
    )
    return running


def _write_ready_file(path: str, running: Running) -> None:
    payload = {
        "pid": os.getpid(),
        "incarnation": running.daemon.incarnation,
        "agent_name": running.daemon.agent_name,
        "tcp": running.tcp_address,
        "advertise": running.daemon.advertise_address,
        "unix": running.unix_socket,
        "metrics": running.metrics_address,
    }
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    tmp.replace(path)


async def stop(running: Running, grace_s: float) -> None:
    """Graceful shutdown (see module docstring)."""
    await running.health.enter_graceful_shutdown()
    await running.daemon.shutdown(grace_s)
    await asyncio.gather(running.tcp_server.stop(1.0), running.unix_server.stop(1.0))
    if running.metrics_server is not None:
        running.metrics_server.shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(running.unix_socket)


async def serve(config: KvdConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code."""
    running = await start(config)
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)
    await stop_event.wait()
    logger.info("signal received: shutting down (grace %.1fs)", config.shutdown_grace_s)
    await stop(running, config.shutdown_grace_s)
    return 0
