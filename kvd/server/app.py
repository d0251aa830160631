"""Start-up and shutdown of `kvd serve`: gRPC servers, metrics, systemd notifications, signals.

* Unix socket (owner-only, or shared with ``engine_group``): EngineService + RouterService +
  health, for engines on this node.
* TCP (loopback unless configured; mTLS optional): PeerService + RouterService + health +
  reflection, for peer daemons and routers. Never ``SO_REUSEPORT``: a second daemon on the same
  port fails to start instead of silently taking half the connections.
* Optional health-only listener (plaintext, grpc.health.v1 only): for kubelet probes, which
  cannot present a client certificate once TCP has mTLS.
* Prometheus ``/metrics`` over HTTP.
* systemd (``Type=notify``): READY=1 once every listener serves, STATUS= lines, WATCHDOG=1 from
  the event loop, STOPPING=1 on SIGTERM (see :mod:`kvd.server.notify`).

Start-up either completes or fails with a :class:`~kvd.server.startup.StartupError` (one line,
cause and fix) after undoing everything it created: no stale socket, no half-started agent.

SIGTERM / SIGINT: health goes NOT_SERVING, in-flight pulls finish or are aborted within the
grace period, every lease and registration is released, exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvd import __version__
from kvd.config import KvdConfig
from kvd.core.daemon import Daemon
from kvd.core.metrics import Metrics
from kvd.server import credentials, startup, warmup
from kvd.server.authz import TCP, UNIX, AuthInterceptor
from kvd.server.client_versions import ClientVersionInterceptor
from kvd.server.engine_frames import EngineFrames
from kvd.server.notify import Notifier, watchdog
from kvd.server.peer_client import GrpcPeerTransport
from kvd.server.peer_frames import PeerFrames
from kvd.server.servicers import EngineServicer, PeerServicer, RouterServicer
from kvd.server.startup import StartupError, Undo
from kvd_client.channel import SERVER_OPTIONS
from kvd_client.v1 import engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

# Clients ping while a call is open (keepalive: peers every 10 s, engines and routers every 30 s),
# and the peer stream and engine streams stay open while idle. At gRPC's default a server takes a
# ping without data in between at most every 5 minutes and answers the third early one with
# GOAWAY too_many_pings: a reader's stream to a holder left idle for a minute and a half (a lull,
# a data-plane restart loop) then failed the next pull (its PreparePull or handshake). Pings as
# often as the clients' are accepted (the key is gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_
# WITHOUT_DATA_MS; an unknown key would be ignored without a word).
SERVER_CHANNEL_OPTIONS = [*SERVER_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 5_000)]

# The health name a liveness probe asks for: SERVING while the control process runs, even while
# no data-plane worker serves (a restart, a crash loop's back-off), which every other name reports.
# A kubelet restarting the pod for that would end every engine's registration, stream and holds,
# which the back-off exists to keep; the daemon exits by itself if a worker cannot start at all.
LIVENESS_SERVICE = "kvd.liveness"
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
    metrics_server: _MetricsHttpServer | None
    health_server: grpc.aio.Server | None = None
    health_address: str = ""
    # The engine stream without gRPC on <unix_socket>.stream (engine_stream_socket), or None.
    engine_frames: EngineFrames | None = None
    # The peer stream without gRPC on its own TCP port (peer_stream_port), or None.
    peer_frames: PeerFrames | None = None
    # The TCP listener's first call, made by the daemon itself (kvd.server.warmup); cancelled at stop.
    warmup: asyncio.Task[bool] | None = None
    # Sets health from whether a data-plane worker serves (_follow_dataplane); cancelled at stop.
    health_follower: asyncio.Task[None] | None = None


def _add_port(
    server: grpc.aio.Server, what: str, flag: str, host: str, port: int, creds: grpc.ServerCredentials | None
) -> int:
    """Bind ``server``; gRPC's bare "Failed to bind" becomes a StartupError (probed again for the reason)."""
    bind = f"{host}:{port}"
    try:
        bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
    except RuntimeError:
        bound = 0
    if bound == 0:
        startup.check_port(what, flag, host, port)  # raises with the cause when it can tell
        raise StartupError(f"cannot listen on {what} address {bind}", f"check --{flag}host and --{flag}port")
    return bound


async def start(config: KvdConfig, notifier: Notifier | None = None) -> Running:
    """Start the daemon and its servers; returns once everything listens.

    Raises :class:`StartupError` (after undoing whatever was created) when it cannot.
    """
    undo = Undo()
    try:
        running = await _start(config, undo, notifier or Notifier(""))
    except BaseException as exc:
        await undo.run()
        if isinstance(exc, StartupError | asyncio.CancelledError | KeyboardInterrupt):
            raise
        logger.debug("start-up failed", exc_info=True)
        raise StartupError(
            f"start-up failed: {type(exc).__name__}: {exc}", "run with --log-level DEBUG for the traceback"
        ) from exc
    undo.forget()
    return running


async def _start(config: KvdConfig, undo: Undo, notifier: Notifier) -> Running:
    server_creds, channel_creds = credentials.grpc_credentials(config)
    gid = startup.resolve_group(config.engine_group)
    startup.check_ports(config)
    startup.check_tcp_security(config)
    policy = credentials.policy(config)
    startup.apply_nixl_env(config)
    startup.prepare_socket_dir(config.unix_socket, gid, undo)

    notifier.status("starting: creating the NIXL agent")
    metrics = Metrics()
    metrics.build_info.labels(__version__).set(1)
    holder: list[Daemon] = []
    frames_server_tls, frames_client_tls = credentials.frames_tls(config)
    transport = GrpcPeerTransport(
        lambda: holder[0].advertise_address,
        lambda: holder[0].incarnation,
        channel_creds,
        calls_on_stream=config.peer_calls_on_stream,
        frames_tls=frames_client_tls,
        use_frames=config.peer_stream_port >= 0,
    )
    daemon = Daemon(config, transport, metrics)
    holder.append(daemon)
    undo.push("daemon", lambda: daemon.shutdown(0.0))
    await daemon.start()

    health = HealthServicer()
    engine, peer, router = (
        EngineServicer(daemon),
        PeerServicer(daemon),
        RouterServicer(daemon, transport.last_contact, transport.framed),
    )

    def denied(method: str, code: str) -> None:
        metrics.errors.labels(method.rsplit("/", 1)[-1], code).inc()

    versions = ClientVersionInterceptor()  # one for both listeners: each old version is logged once
    unix_server = grpc.aio.server(
        options=SERVER_CHANNEL_OPTIONS, interceptors=[versions, AuthInterceptor(policy, UNIX, denied)]
    )
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, unix_server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, unix_server)
    health_pb2_grpc.add_HealthServicer_to_server(health, unix_server)
    undo.push("engine socket", lambda: startup.remove_socket(config.unix_socket))
    try:
        unix_server.add_insecure_port(f"unix:{config.unix_socket}")
    except RuntimeError as exc:
        raise StartupError(
            f"cannot create the engine socket {config.unix_socket}",
            "check the directory's permissions and --unix-socket",
        ) from exc
    undo.push("engine server", lambda: unix_server.stop(None))
    frames = None
    if config.engine_stream_socket:  # the engine stream without gRPC, beside the gRPC socket
        frames = EngineFrames(startup.stream_socket(config.unix_socket), engine, metrics, versions.log)
        startup.clear_socket(frames.path)
        undo.push("engine stream socket", frames.stop)

    tcp_server = grpc.aio.server(
        options=SERVER_CHANNEL_OPTIONS, interceptors=[versions, AuthInterceptor(policy, TCP, denied)]
    )
    peer_pb2_grpc.add_PeerServiceServicer_to_server(peer, tcp_server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, tcp_server)
    health_pb2_grpc.add_HealthServicer_to_server(health, tcp_server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        tcp_server,
    )
    port = _add_port(tcp_server, "TCP", "", config.host, config.port, server_creds)
    policy.tcp_port = port
    undo.push("TCP server", lambda: tcp_server.stop(None))
    peer_frames = None
    if config.peer_stream_port >= 0 and config.peer_calls_on_stream:  # the peer stream without gRPC
        peer_frames = PeerFrames(
            config.host, config.peer_stream_port, policy, lambda: peer.handlers, metrics, frames_server_tls, denied
        )
        try:
            peer.peer_stream_port = await peer_frames.start()
        except OSError as exc:
            raise startup.bind_error("peer stream", "peer-stream-", config.host, config.peer_stream_port, exc) from exc
        undo.push("peer stream port", peer_frames.stop)
    tcp_address = f"{config.host}:{port}"
    daemon.advertise_address = config.advertise_address or tcp_address

    health_server = None
    health_address = ""
    if config.health_port >= 0:
        health_server = grpc.aio.server(options=SERVER_CHANNEL_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        health_port = _add_port(health_server, "health", "health-", config.health_host, config.health_port, None)
        undo.push("health server", lambda: health_server.stop(None))
        health_address = f"{config.health_host}:{health_port}"

    if frames is not None:
        await frames.start()
        startup.share_socket(frames.path, gid)
    await unix_server.start()
    startup.share_socket(config.unix_socket, gid)
    await tcp_server.start()
    if health_server is not None:
        await health_server.start()

    metrics_server = None
    metrics_address = ""
    if config.metrics_port >= 0:
        try:
            metrics_server = _start_metrics_server(config.metrics_host, config.metrics_port, metrics.registry)
        except OSError as exc:
            raise startup.bind_error("metrics", "metrics-", config.metrics_host, config.metrics_port, exc) from exc
        undo.push("metrics server", lambda: _stop_metrics_server(metrics_server))
        metrics_address = f"{config.metrics_host}:{metrics_server.server_port}"
    router.metrics_address = metrics_address

    for name in ("", *SERVICE_NAMES, LIVENESS_SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    metrics.serving.set(1)
    running = Running(
        daemon,
        unix_server,
        tcp_server,
        health,
        tcp_address,
        config.unix_socket,
        metrics_address,
        metrics_server,
        health_server,
        health_address,
        frames,
        peer_frames,
    )
    running.warmup = warmup.start(daemon.advertise_address, channel_creds)
    running.health_follower = _follow_dataplane(daemon, health, metrics)
    if config.ready_file:
        _write_ready_file(config.ready_file, running)
    logger.info(
        "kvd %s serving: engines on unix:%s, peers/routers on %s (advertised %s), metrics on %s, health on %s",
        __version__,
        config.unix_socket,
        tcp_address,
        daemon.advertise_address,
        metrics_address or "off",
        health_address or "off",
    )
    return running


def _follow_dataplane(daemon: Daemon, health: HealthServicer, metrics: Metrics) -> asyncio.Task[None]:
    """Health (every service) and ``kvd_serving`` follow whether a data-plane worker serves:
    NOT_SERVING from a worker's loss until its replacement serves (kvd.core.restarts), so that
    routers and probes see a daemon that cannot pull now. One task sets them, in order, to the
    daemon's state at the time (a quick loss and recovery may show only its end)."""
    changed = asyncio.Event()
    changed.set()  # a loss between the daemon's start and this call
    daemon.restarts.on_serving = changed.set

    async def follow() -> None:
        while True:
            await changed.wait()
            changed.clear()
            serving = daemon.restarts.serving
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", *SERVICE_NAMES):
                await health.set(name, status)
            metrics.serving.set(int(serving))

    return asyncio.get_running_loop().create_task(follow(), name="kvd-health")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not news: no access log on stderr."""


class _MetricsHttpServer(ThreadingWSGIServer):
    """prometheus_client's scrape server, woken by a stop at once instead of polling for it:
    socketserver's ``serve_forever`` polls every ``poll_interval`` (its 500 ms default made every
    daemon's exit half a second slower; 50 ms cost an idle daemon 20 wake-ups a second, a sixth of
    its CPU). Its thread sleeps in ``select`` on the listening socket and a wake-up socket until a
    scrape or :meth:`stop`."""

    timeout = 0.0  # handle_request's own wait: it is called once the listening socket is ready

    def serve_until_stopped(self) -> None:
        """Serve scrapes until :meth:`stop` (the metrics thread)."""
        with selectors.DefaultSelector() as selector, self._wake_r:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_r in ready:
                    return
                self.handle_request()  # ready: accepts now (timeout 0: never waits for another)

    def start(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self.serve_until_stopped, name="kvd-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake_w:
            self._wake_w.send(b"x")
        self._thread.join()
        self.server_close()


def _start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> _MetricsHttpServer:
    """prometheus_client's start_http_server, stopped without polling (see _MetricsHttpServer)."""

    class Server(_MetricsHttpServer):
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    httpd = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
    httpd.start()
    return httpd


def _stop_metrics_server(httpd: _MetricsHttpServer) -> None:
    httpd.stop()


def status_line(running: Running) -> str:
    """The one-line summary systemd shows as the unit's Status."""
    s = running.daemon.status()
    return (
        f"serving on {running.tcp_address}: {len(s.engines)} engine ranks, {len(s.peers)} peers, "
        f"{s.transfers_in_flight} transfers in flight, {s.leases_held} leases"
    )


def _write_ready_file(path: str, running: Running) -> None:
    payload = {
        "pid": os.getpid(),
        "incarnation": running.daemon.incarnation,
        "agent_name": running.daemon.agent_name,
        "tcp": running.tcp_address,
        "peer_stream_port": running.peer_frames.port if running.peer_frames is not None else 0,
        "advertise": running.daemon.advertise_address,
        "unix": running.unix_socket,
        "engine_stream": running.engine_frames.path if running.engine_frames is not None else "",
        "metrics": running.metrics_address,
        "health": running.health_address,
        "dataplane_pid": running.daemon.status().dataplane_pid,  # the worker at start (it may be replaced)
    }
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(payload) + "\n")
    tmp.replace(path)


async def stop(running: Running, grace_s: float) -> None:
    """Graceful shutdown (see module docstring)."""
    if running.warmup is not None:
        running.warmup.cancel()
    if running.health_follower is not None:
        running.health_follower.cancel()
        await asyncio.gather(running.health_follower, return_exceptions=True)
    await running.health.enter_graceful_shutdown()
    running.daemon.metrics.serving.set(0)  # scraped until the metrics server stops, at the end
    await running.daemon.shutdown(grace_s)
    servers = [running.tcp_server, running.unix_server]
    if running.health_server is not None:
        servers.append(running.health_server)
    await asyncio.gather(*(server.stop(1.0) for server in servers))
    for frames in (running.engine_frames, running.peer_frames):
        if frames is not None:
            await frames.stop()
    if running.metrics_server is not None:
        _stop_metrics_server(running.metrics_server)
    startup.remove_socket(running.unix_socket)


EXIT_DATAPLANE_CANNOT_START = 70  # EX_SOFTWARE: a new data-plane worker could not start (kvd.core.restarts)


async def serve(config: KvdConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code. Start-up failures raise StartupError
    (`kvd serve` prints it and sends it to systemd as STATUS=)."""
    sys.setswitchinterval(config.gil_switch_interval_s)  # a pull's thread hops wait for the GIL (config help)
    notifier = Notifier(config.notify_socket)
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a SIGTERM while starting stops cleanly after it
        loop.add_signal_handler(sig, stop_event.set)
    try:
        running = await start(config, notifier)
    finally:
        notifier.close()  # reopened on the next send; a failure's STATUS= is sent by the CLI
    # Everything start-up created (torch, gRPC, the tables) lives as long as the daemon: frozen,
    # the collector never walks it again (a full collection over it cost ~10 ms of CPU, landing
    # on whichever pull allocated at that moment).
    gc.freeze()
    notifier.ready(status_line(running))
    pinger = None
    if config.watchdog_s > 0:
        pinger = loop.create_task(
            watchdog(notifier, config.watchdog_s, lambda: status_line(running)), name="kvd-watchdog"
        )
    elif notifier.enabled:
        pinger = loop.create_task(_status_updates(notifier, running), name="kvd-status")
    fatal = running.daemon.restarts.fatal
    assert fatal is not None
    stop_wait: asyncio.Future[Any] = loop.create_task(stop_event.wait())
    await asyncio.wait([stop_wait, fatal], return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    exit_code = 0
    if fatal.done():
        # A lost data-plane worker's replacement cannot start (a crash loop only backs off):
        # NOT_SERVING, everything released, a non-zero exit so that systemd (Restart=on-failure)
        # or Kubernetes restarts the whole daemon with back-off.
        logger.critical("exiting with status %d: %s", EXIT_DATAPLANE_CANNOT_START, fatal.result())
        notifier.stopping(f"exiting: {fatal.result()}")
        exit_code = EXIT_DATAPLANE_CANNOT_START
    else:
        logger.info("signal received: shutting down (grace %.1fs)", config.shutdown_grace_s)
        notifier.stopping(f"stopping: {running.daemon.status().transfers_in_flight} transfers finishing")
    await stop(running, config.shutdown_grace_s if not exit_code else 0.0)
    if pinger is not None:
        pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pinger
    notifier.close()
    return exit_code


async def _status_updates(notifier: Notifier, running: Running, every_s: float = 10.0) -> None:
    """STATUS= lines without a watchdog (Type=notify with WatchdogSec unset)."""
    while True:
        await asyncio.sleep(every_s)
        notifier.status(status_line(running))
