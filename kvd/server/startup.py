"""Checks and preparations before `kvd serve` creates anything: each failure is one actionable line.

A daemon that cannot start must say why and what to do in one line, exit 2 for a config problem
(fix the file or flags) or 1 for a runtime one (the machine is not as expected), and leave
nothing behind. So the cheap checks run first (TLS files, the engine group, every TCP port, the
socket directory), each failure is a :class:`StartupError` carrying cause and fix, and
:class:`Undo` records what start-up created so a later failure can take it back.

:class:`StartupError` is not part of :mod:`kvd_client.errors` on purpose: it never travels over
gRPC, it ends the process.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import inspect
import ipaddress
import logging
import os
import socket
import stat
from collections.abc import Callable, MutableMapping
from pathlib import Path

from kvd.config import KvdConfig
from kvd_client._frames import SUFFIX

logger = logging.getLogger(__name__)

CONFIG_ERROR = 2
RUNTIME_ERROR = 1


class StartupError(Exception):
    """`kvd serve` cannot start: ``cause`` and ``fix`` make its one line, ``exit_code`` its status."""

    def __init__(self, cause: str, fix: str, exit_code: int = RUNTIME_ERROR) -> None:
        super().__init__(f"{cause}; {fix}")
        self.cause = cause
        self.fix = fix
        self.exit_code = exit_code


class Undo:
    """What start-up created, undone in reverse order if start-up fails later."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, step: Callable[[], object]) -> None:
        self._steps.append((what, step))

    async def run(self) -> None:
        while self._steps:
            what, step = self._steps.pop()
            try:
                result = step()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.debug("undoing %s failed", what, exc_info=True)

    def forget(self) -> None:
        """Start-up succeeded: the created things now belong to the running daemon."""
        self._steps.clear()


def preflight(config: KvdConfig) -> None:
    """Every check that needs no heavy import and creates nothing: `kvd serve` runs it first, so a
    port in use or a bad path is reported in a fraction of a second, before torch and NIXL load.
    :func:`kvd.server.app.start` runs the same checks again as it goes (things change)."""
    if config.tls_enabled:
        for field in ("tls_cert", "tls_key", "tls_ca"):
            if getattr(config, field):
                read_tls_file(field, getattr(config, field))
    resolve_group(config.engine_group)
    check_ports(config)
    check_tcp_security(config)
    sock_path = Path(config.unix_socket)
    existing = sock_path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise _dir_error(existing, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _dir_error(existing, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    if existing == sock_path.parent:
        check_socket_dir(existing)
        for path in (sock_path, *((Path(stream_socket(config.unix_socket)),) if config.engine_stream_socket else ())):
            if path.is_symlink() or path.exists():
                _refuse_live_or_foreign(path)


def check_ports(config: KvdConfig) -> None:
    """Probe every TCP port the daemon will listen on (see :func:`check_port`)."""
    check_port("TCP", "", config.host, config.port)
    if config.peer_stream_port > 0:
        check_port("peer stream", "peer-stream-", config.host, config.peer_stream_port)
    if config.metrics_port >= 0:
        check_port("metrics", "metrics-", config.metrics_host, config.metrics_port)
    if config.health_port >= 0:
        check_port("health", "health-", config.health_host, config.health_port)


def is_loopback_host(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (False if it does not resolve)."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_tcp_security(config: KvdConfig) -> None:
    """Refuse plaintext TCP beyond loopback unless ``allow_insecure_tcp``; then warn at every start.

    Whoever may call Handshake gets the NIXL metadata that lets it read and write every engine's
    registered memory: on a reachable address that must be a verified peer (mTLS).
    """
    if config.tls_enabled and not config.tls_ca:
        logger.warning(
            "TLS without tls_ca: TCP clients present no certificate, so none holds a role from one "
            "(only router tokens and, on loopback, trusted uids do); set tls_ca for peers (docs/security.md)"
        )
    if config.tls_enabled or is_loopback_host(config.host):
        return
    if not config.allow_insecure_tcp:
        raise StartupError(
            f"plaintext TCP on {config.host}, which is not a loopback address, would hand NIXL access to every "
            "engine's memory to anyone who reaches the port",
            "set tls_cert, tls_key and tls_ca (mTLS, see docs/security.md), bind host to 127.0.0.1, or set "
            "allow_insecure_tcp = true on an isolated test network",
            CONFIG_ERROR,
        )
    logger.warning(
        "INSECURE: plaintext TCP on %s with allow_insecure_tcp: every caller that reaches port %d may read and "
        "write all registered KV memory. Use mTLS outside isolated test networks (docs/security.md).",
        config.host,
        config.port,
    )


def apply_nixl_env(config: KvdConfig, environ: MutableMapping[str, str] | None = None) -> None:
    """Set UCX's (NIXL's backend) environment before any agent is created: its memory-type cache
    off, its native backtrace on a crash, and the devices to use and listen on.

    UCX reads its settings from the environment when NIXL creates the UCX backend; this is the one
    place kvd writes them: ``UCX_MEMTYPE_CACHE`` and ``UCX_HANDLE_ERRORS`` (each unless the
    environment sets it), and ``UCX_NET_DEVICES`` from ``nixl_net_devices`` (unset: UCX's own
    default applies, or what the service's environment says).
    """
    env = os.environ if environ is None else environ
    # UCX's memory-type cache knows the GPU memory that existed when UCX started and the
    # allocations it saw made since. The worker's NIXL agent starts first; the engines' KV arrives
    # later through CUDA IPC (cudaIpcOpenMemHandle, which UCX does not see): absent from the cache,
    # UCX took it for host memory and NIXL refused every VRAM registration (NIXL_ERR_BACKEND, "VRAM
    # memory is detected as host by UCX"; seen on an H200, docs/gpu-check.md). Without the cache
    # UCX asks CUDA what each registered pointer is. An operator's own setting wins.
    env.setdefault("UCX_MEMTYPE_CACHE", "n")
    # A worker that crashes inside UCX leaves only its Python stacks (faulthandler) without this:
    # the UCX bundled with NIXL prints no native backtrace by default, and one is what names the
    # UCX function that crashed (a holder's worker killed by UCX's purge of a dead reader's TCP
    # endpoint: docs/failure-rules.md). UCX prints it, then the worker dies of the same signal.
    env.setdefault("UCX_HANDLE_ERRORS", "bt")
    if not config.nixl_net_devices:
        return
    logger.info("NIXL/UCX limited to devices %s (nixl_net_devices)", config.nixl_net_devices)
    env["UCX_NET_DEVICES"] = config.nixl_net_devices


def read_tls_file(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError(
            f"cannot read {field} {path}: {exc.strerror}",
            f"fix {field} (a PEM file readable by uid {os.getuid()})",
            CONFIG_ERROR,
        ) from exc


def resolve_group(engine_group: str) -> int | None:
    """The gid of ``engine_group`` (a name or a number); None when it is empty."""
    if not engine_group:
        return None
    if engine_group.isdigit():
        return int(engine_group)
    try:
        return grp.getgrnam(engine_group).gr_gid
    except KeyError:
        raise StartupError(
            f"engine_group {engine_group!r} is not a group on this machine",
            "create it (groupadd) or set engine_group to an existing group name or gid",
            CONFIG_ERROR,
        ) from None


def check_port(what: str, flag: str, host: str, port: int) -> None:
    # ``flag`` is the flag prefix: "" (--host/--port), "metrics-", "health-"
    """Fail now, with the reason, if ``host:port`` cannot be bound exclusively.

    gRPC would only say "Failed to bind", and by default it sets ``SO_REUSEPORT``, which lets a
    second daemon bind the same port and silently take half the connections; kvd's servers turn
    that off, and this probe (no ``SO_REUSEPORT`` either) names the cause first.
    """
    if port < 0:
        return  # disabled; port 0 is still probed: it checks that the host is this machine's
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(
            f"{what} host {host!r} does not resolve ({exc.strerror})",
            f"fix --{flag}host or the name service",
            CONFIG_ERROR,
        ) from exc
    for family, kind, proto, _, address in infos:
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
        except OSError as exc:
            raise bind_error(what, flag, host, port, exc) from exc
        finally:
            probe.close()


def bind_error(what: str, flag: str, host: str, port: int, exc: OSError) -> StartupError:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{what} port {where} is already in use (another kvd or another program: ss -ltnp 'sport = :{port}')",
            f"stop that program or choose another --{flag}port",
        )
    if exc.errno == errno.EACCES:
        return StartupError(
            f"{what} port {where}: permission denied (ports below 1024 need CAP_NET_BIND_SERVICE)",
            f"choose --{flag}port 1024 or above, or grant the capability",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            f"{what} host {host} is not an address of this machine",
            f"set --{flag}host to one of this node's addresses (or 0.0.0.0)",
            CONFIG_ERROR,
        )
    return StartupError(f"cannot bind {what} port {where}: {exc.strerror}", f"check --{flag}host and --{flag}port")


def prepare_socket_dir(path: str, gid: int | None, undo: Undo) -> None:
    """Make the engine socket's directory (0700, or 0750 of ``gid``); refuse a live socket, clear a stale one.

    An existing directory is used as it is (it may be /run/kvd from systemd's RuntimeDirectory)
    if it belongs to the daemon's uid (or root) and nobody else may write it (see
    :func:`check_socket_dir`); a warning says when engines of ``gid`` cannot get through it.
    """
    sock_path = Path(path)
    directory = sock_path.parent
    missing: list[Path] = []
    probe = directory
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for new in reversed(missing):
        try:
            new.mkdir(mode=0o750 if gid is not None else 0o700)
        except OSError as exc:
            raise _dir_error(directory, exc) from exc
        undo.push(f"directory {new}", new.rmdir)
        if gid is not None:
            try:
                os.chown(new, -1, gid)
            except PermissionError as exc:
                raise _group_error(gid) from exc
            os.chmod(new, 0o750)  # mkdir's mode went through the umask
    if not directory.is_dir():
        raise StartupError(
            f"the socket directory {directory} is not a directory", "choose another --unix-socket", CONFIG_ERROR
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise _dir_error(directory, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    if not missing:
        check_socket_dir(directory)
    if gid is not None and not missing:
        info = directory.stat()
        if not ((info.st_gid == gid and info.st_mode & 0o010) or info.st_mode & 0o001):
            logger.warning(
                "engines of group %d may not reach %s: its directory %s is %o, group %d",
                gid,
                path,
                directory,
                stat.S_IMODE(info.st_mode),
                info.st_gid,
            )
    clear_socket(path)


def stream_socket(unix_socket: str) -> str:
    """Where the engine stream is served without gRPC, beside the gRPC socket (kvd_client._frames)."""
    return unix_socket + SUFFIX


def clear_socket(path: str) -> None:
    """Remove a stale socket at ``path`` (its daemon is gone); refuse a live or foreign one."""
    sock_path = Path(path)
    if sock_path.is_symlink() or sock_path.exists():
        _refuse_live_or_foreign(sock_path)
        sock_path.unlink()


def check_socket_dir(directory: Path) -> None:
    """Refuse an existing socket directory that lets someone else in.

    Whoever may write the directory can replace the engine socket with their own (engines would
    then hand their memory to an impostor) or race the daemon's clean-up. So the directory must
    belong to the daemon's uid or root, and nobody else may write it, unless it is sticky
    (``/tmp``: others cannot remove or rename what the daemon created).
    """
    info = directory.stat()
    mode = stat.S_IMODE(info.st_mode)
    owners = {os.getuid(), 0}
    if info.st_uid not in owners:
        raise StartupError(
            f"the socket directory {directory} belongs to uid {info.st_uid}, not to the daemon's uid {os.getuid()}",
            "remove it (the daemon creates it 0700) or choose another --unix-socket",
            CONFIG_ERROR,
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise StartupError(
            f"the socket directory {directory} is mode {mode:o}: others may write it and replace the engine socket",
            f"chmod go-w {directory} (0700, or 0750 with engine_group) or choose another --unix-socket",
            CONFIG_ERROR,
        )


def _refuse_live_or_foreign(sock_path: Path) -> None:
    """A path that is not a socket, or a socket a daemon still answers on, is not ours to remove."""
    if not stat.S_ISSOCK(sock_path.lstat().st_mode):
        raise StartupError(
            f"{sock_path} exists and is not a socket", "remove it or choose another --unix-socket", CONFIG_ERROR
        )
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(str(sock_path))
    except OSError:
        return  # stale
    finally:
        probe.close()
    raise StartupError(
        f"another daemon is serving on {sock_path}", "stop it (systemctl stop kvd) or choose another --unix-socket"
    )


def _dir_error(directory: Path, exc: OSError) -> StartupError:
    return StartupError(
        f"cannot use {directory} for the engine socket: {exc.strerror}",
        f"create it writable by uid {os.getuid()} (systemd: RuntimeDirectory=kvd) or choose another --unix-socket",
    )


def _group_error(gid: int) -> StartupError:
    return StartupError(
        f"cannot give the engine socket to group {gid}: uid {os.getuid()} is not a member",
        "add the daemon's user to that group (systemd: Group= or SupplementaryGroups=) or change engine_group",
    )


def share_socket(path: str, gid: int | None) -> None:
    """The socket's final mode: 0600, or 0660 of ``gid`` for the engines' group."""
    if gid is None:
        os.chmod(path, 0o600)
        return
    try:
        os.chown(path, -1, gid)
    except PermissionError as exc:
        raise _group_error(gid) from exc
    os.chmod(path, 0o660)


def remove_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
