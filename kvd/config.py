"""The daemon's one configuration object.

Precedence, lowest first: field defaults < TOML file (``--config``) < ``KVD_*`` environment
variables < command-line flags. :func:`load_config` is the only place that reads the
environment; everything else receives a :class:`KvdConfig`. That includes what systemd hands
the daemon through its environment (``NOTIFY_SOCKET``, ``WATCHDOG_USEC``): they become the
``notify_socket`` and ``watchdog_s`` fields, so the server never reads the process environment.

:func:`resolve_config` also says where each value came from (``kvd serve --print-config``) and
which ``KVD_*`` variables it did not recognise (a typo is warned about, not silently ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from kvd.dataplane_protocol import DEFAULT_MAX_POST_BYTES, DEFAULT_PARALLEL_READ_MIN_BYTES
from kvd_client.paths import default_engine_socket

ENV_PREFIX = "KVD_"
MAX_COPY_THREADS = 64
AUTO_COPY_THREADS_MAX = 4  # dataplane_copy_threads = 0: one per usable CPU, at most this many

NOT_CONFIG_ENV = frozenset({"KVD_SETUP_VLLM"})
"""``KVD_*`` variables that belong to other tools (scripts/setup.sh): never warned about."""

SYSTEMD_ENV = {"notify_socket": "NOTIFY_SOCKET", "watchdog_s": "WATCHDOG_USEC"}
"""Fields systemd sets through its own variables (see :func:`_systemd_values`)."""

_GROUP_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]*\$?|[0-9]+)$")


def _default_unix_socket() -> str:
    """Owner-private default path, so a fresh machine needs no config at all.

    The engine connector defaults to the same path (both use :mod:`kvd_client.paths`)."""
    return default_engine_socket()


@dataclasses.dataclass(frozen=True)
class KvdConfig:
    """Everything an operator can set. Each field's docstring-comment is its --help text."""

    unix_socket: str = dataclasses.field(
        default_factory=_default_unix_socket,
        metadata={"help": "Unix socket engines connect to (0600 in a 0700 directory unless engine_group is set)."},
    )
    engine_group: str = dataclasses.field(
        default="",
        metadata={
            "help": "Group (name or gid) whose members may use the engine socket: the socket becomes 0660 and "
            "the directory kvd creates for it 0750, both of that group. Empty: owner-only."
        },
    )
    host: str = dataclasses.field(
        default="127.0.0.1",
        metadata={"help": "TCP address for peers and routers; loopback unless you mean otherwise."},
    )
    port: int = dataclasses.field(
        default=50151, metadata={"help": "TCP port for peers and routers (0: any free port)."}
    )
    advertise_address: str = dataclasses.field(
        default="",
        metadata={"help": "host:port peers should use to reach this daemon (default: host and bound port)."},
    )
    metrics_host: str = dataclasses.field(default="127.0.0.1", metadata={"help": "Prometheus /metrics address."})
    metrics_port: int = dataclasses.field(
        default=9464, metadata={"help": "Prometheus /metrics port (0: any free port; -1: disabled)."}
    )
    health_host: str = dataclasses.field(
        default="127.0.0.1",
        metadata={"help": "Address of the plaintext health-only gRPC listener (for kubelet probes when TCP has mTLS)."},
    )
    health_port: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "Port of the health-only listener: grpc.health.v1 and nothing else, never TLS "
            "(0: any free port; -1: disabled)."
        },
    )
    lease_ttl_s: float = dataclasses.field(
        default=30.0, metadata={"help": "Default lifetime of a hold on blocks for a remote reader."}
    )
    max_lease_ttl_s: float = dataclasses.field(default=600.0, metadata={"help": "Longest lease a caller may ask for."})
    transfer_deadline_s: float = dataclasses.field(
        default=30.0, metadata={"help": "Default deadline of one pull, handshake included."}
    )
    handshake_timeout_s: float = dataclasses.field(default=5.0, metadata={"help": "Deadline of one peer RPC."})
    commit_wait_s: float = dataclasses.field(
        default=5.0,
        metadata={"help": "How long a pull waits for the holder's tokens to be committed before failing."},
    )
    hold_check_timeout_s: float = dataclasses.field(
        default=2.0,
        metadata={
            "help": "How long a read of a soft hold waits for the holder engine's scheduler to verify (and pin, "
            "or unpin) its blocks; it answers between engine steps. No answer: the read is refused or fails."
        },
    )
    fence_timeout_s: float = dataclasses.field(
        default=2.0,
        metadata={
            "help": "How long a failed pull waits (within its deadline) for NIXL to finish its reads before "
            "re-mapping the engine's memory, so no late byte can land in blocks the engine recomputes."
        },
    )
    read_beside_admission: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Post a pull's NIXL READ at the same time as the holder's admission (PreparePull) instead of "
            "after its answer, where the holder allows it (its engine commits nothing after leasing, and it is a "
            "kvd that counts early notifications) and the pull needs no staging; the pull is reported only once "
            "both are back, and an admission refused or stale discards the READ's bytes (docs/lifetimes.md)."
        },
    )
    read_admission_margin_s: float = dataclasses.field(
        default=5.0,
        metadata={
            "help": "After an admitted read's deadline, how long the holder still treats the blocks as being read "
            "(a draining lease ends, and unregistered memory is retired, only after it)."
        },
    )
    peer_idle_s: float = dataclasses.field(
        default=600.0, metadata={"help": "Forget a peer (its handshake, NIXL agent and channel) unused this long."}
    )
    shutdown_grace_s: float = dataclasses.field(
        default=10.0, metadata={"help": "On SIGTERM, how long in-flight transfers may finish before they are aborted."}
    )
    max_run_blocks: int = dataclasses.field(
        default=64,
        metadata={"help": "Longest run of adjacent blocks merged into one NIXL descriptor (a power of two)."},
    )
    direct_read_min_bytes: int = dataclasses.field(
        default=4096,
        metadata={
            "help": "Smallest contiguous piece worth reading straight into an engine's blocks; "
            "conversions with smaller pieces read whole blocks into staging and convert."
        },
    )
    read_descriptor_cost_s: float = dataclasses.field(
        default=10e-6,
        metadata={
            "help": "Planner cost model: time one posted NIXL descriptor costs. With convert_bytes_per_s it picks "
            "direct reads (many small descriptors) or staging + conversion (few long reads, one copy)."
        },
    )
    convert_bytes_per_s: float = dataclasses.field(
        default=1e9, metadata={"help": "Planner cost model: speed of a layout conversion out of staging."}
    )
    staging_pool_bytes: int = dataclasses.field(
        default=256 << 20, metadata={"help": "Bytes of NIXL-registered staging memory for layout conversion."}
    )
    staging_wait_s: float = dataclasses.field(
        default=2.0, metadata={"help": "How long a pull waits for staging memory before RESOURCE_EXHAUSTED."}
    )
    nixl_backends: tuple[str, ...] = dataclasses.field(
        default=("UCX",), metadata={"help": "NIXL backends to create (comma-separated)."}
    )
    nixl_progress_thread: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Run NIXL's own progress thread, waiting on UCX's event fd between rounds (it wakes when a "
            "peer's request or a notification arrives): admitted readers' READs progress as they arrive, and "
            "kvd's NIXL thread no longer polls fast for them. Off: kvd's NIXL thread drives all progress."
        },
    )
    prefault_host_memory: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Fill the page tables of the daemon's mappings of engines' shared memory in the background "
            "after each registration (MADV_POPULATE_WRITE, Linux 5.14; lowest CPU priority), so a pull's copy "
            "does not take a page fault on every page it writes first. Only pages already resident are "
            "mapped: no byte is touched and nothing is allocated."
        },
    )
    dataplane_spare_worker: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Keep one spare data-plane worker (torch and NIXL imported, its agent created) so that a lost "
            "worker is replaced in milliseconds; it starts once the serving worker is ready and costs one more "
            "process's memory (~250 MiB). Off: a lost worker is replaced by a cold start (seconds). kvd selftest "
            "and kvd demo run their short-lived daemons without one."
        },
    )
    dataplane_heartbeat_timeout_s: float = dataclasses.field(
        default=5.0,
        metadata={
            "help": "A data-plane worker whose NIXL thread does not answer a heartbeat within this many seconds "
            "is hung: it is killed and replaced (its pulls fail UNAVAILABLE)."
        },
    )
    dataplane_max_post_bytes: int = dataclasses.field(
        default=DEFAULT_MAX_POST_BYTES,
        metadata={
            "help": "A READ larger than this is posted to NIXL in pieces of about this size, one after the other "
            "(over shared memory UCX copies within the post, and meanwhile the worker's NIXL thread answers no "
            "heartbeat): bounds one NIXL call well under dataplane_heartbeat_timeout_s."
        },
    )
    dataplane_copy_threads: int = dataclasses.field(
        default=1,
        metadata={
            "help": "Threads that copy one large host-memory READ together (NIXL's UCX thread pool, as vLLM's NIXL "
            "connector uses it): over shared memory the thread that posts a READ copies it, so one thread "
            "moves about one core's memory bandwidth. 1 (the default): one thread, no pool; 0: one per CPU "
            "this process may run on, at most 4. Off by default: with NIXL 1.5.1's thread pool, a reader's "
            "worker killed mid-read over TCP crashed the holder's worker (SIGSEGV in its notification poll)."
        },
    )
    dataplane_parallel_read_min_bytes: int = dataclasses.field(
        default=DEFAULT_PARALLEL_READ_MIN_BYTES,
        metadata={
            "help": "A host-memory READ (or piece) of at least this many bytes is cut into equal descriptors "
            "for the copy threads (dataplane_copy_threads); smaller READs finish within their post on one thread."
        },
    )
    dataplane_restart_backoff_s: float = dataclasses.field(
        default=0.25,
        metadata={
            "help": "A lost data-plane worker is replaced at once, but one lost again before its predecessor served "
            "dataplane_restart_stable_s waits this long before its replacement starts, twice as long after each "
            "further loss in a row, up to dataplane_restart_backoff_max_s. The daemon never gives up on a crash "
            "loop (health is NOT_SERVING while no worker serves); it exits only when a new worker cannot start."
        },
    )
    dataplane_restart_backoff_max_s: float = dataclasses.field(
        default=4.0, metadata={"help": "The longest wait before a lost data-plane worker's replacement starts."}
    )
    dataplane_restart_stable_s: float = dataclasses.field(
        default=30.0,
        metadata={
            "help": "A data-plane worker that served this long ends a crash loop: the next loss is replaced at once "
            "again (dataplane_restart_backoff_s)."
        },
    )
    peer_calls_on_stream: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Call peer daemons (PreparePull, FinishRead, AbandonPull, lease renewals and releases) as "
            "messages on one long-lived stream per peer, batched when they queue up; false: one unary RPC each "
            "(what kvd did before; kept to measure the two side by side). Handshakes are unary either way."
        },
    )
    gil_switch_interval_s: float = dataclasses.field(
        default=0.0002,
        metadata={
            "help": "Python's thread switch interval in the daemon (sys.setswitchinterval). A pull hops between "
            "the event loop and the NIXL thread; at Python's default (5 ms) each hop may wait that long for the GIL."
        },
    )
    agent_name_prefix: str = dataclasses.field(
        default="kvd", metadata={"help": "Agent names are <prefix>-<host>-<uuid4>: a restart is visible."}
    )
    tls_cert: str = dataclasses.field(default="", metadata={"help": "PEM certificate for TCP (mTLS with tls_ca)."})
    tls_key: str = dataclasses.field(default="", metadata={"help": "PEM private key for TCP."})
    tls_ca: str = dataclasses.field(default="", metadata={"help": "PEM CA that peer certificates must chain to."})
    allow_insecure_tcp: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Allow plaintext TCP on a non-loopback host (refused otherwise): every caller that reaches the "
            "port is then trusted as peer, router and operator, i.e. may read and write all registered KV "
            "memory. Logged as a warning at every start. Only for isolated test networks."
        },
    )
    tls_peer_names: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={
            "help": "Client-certificate SANs (DNS names or URIs such as SPIFFE IDs; shell wildcards allowed) "
            "that hold the peer role: Handshake, PreparePull, AbandonPull, i.e. NIXL access to all "
            "registered memory. When none of tls_*_names is set, every certificate tls_ca signed holds "
            "every TCP role."
        },
    )
    tls_router_names: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={"help": "Client-certificate SANs that hold the router role (pulls, leases, lookups, status)."},
    )
    tls_operator_names: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={"help": "Client-certificate SANs that hold the operator role (status, selftest)."},
    )
    router_token_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "File of bearer tokens (one per line, '#' comments) that grant the router role to a TCP "
            "caller sending 'authorization: Bearer <token>'. Read at start-up."
        },
    )
    loopback_uids: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={
            "help": "Extra uids whose plaintext loopback TCP connections hold the peer, router and operator roles "
            "(the daemon's own uid always does; the kernel's socket table says who owns a connection)."
        },
    )
    nixl_net_devices: str = dataclasses.field(
        default="",
        metadata={
            "help": "Network devices NIXL's UCX backend may use and listen on (UCX_NET_DEVICES, e.g. "
            "'mlx5_0:1,eth1'); empty: UCX's default (every device). Set it to the peer network's devices."
        },
    )
    ready_file: str = dataclasses.field(
        default="",
        metadata={"help": "Write a JSON line with the bound addresses here once serving (for supervisors, tests)."},
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR."})
    notify_socket: str = dataclasses.field(
        default="",
        metadata={
            "help": "sd_notify socket for READY=1/STATUS=/WATCHDOG=1/STOPPING=1 (systemd sets NOTIFY_SOCKET "
            "for Type=notify units; empty: no notifications)."
        },
    )
    watchdog_s: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "Watchdog period in seconds: WATCHDOG=1 is sent from the event loop every half of it "
            "(systemd sets WATCHDOG_USEC from WatchdogSec=; 0: off)."
        },
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not self.unix_socket:
            problems.append("unix_socket must not be empty")
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is not in 0..65535")
        if not -1 <= self.metrics_port <= 65535:
            problems.append(f"metrics_port {self.metrics_port} is not in -1..65535")
        if not -1 <= self.health_port <= 65535:
            problems.append(f"health_port {self.health_port} is not in -1..65535")
        fixed = [(n, getattr(self, n)) for n in ("port", "metrics_port", "health_port") if getattr(self, n) > 0]
        for i, (name, value) in enumerate(fixed):
            for other, other_value in fixed[i + 1 :]:
                if value == other_value:
                    problems.append(f"{name} and {other} are both {value}: each listener needs its own port")
        if self.engine_group and not _GROUP_RE.match(self.engine_group):
            problems.append(f"engine_group {self.engine_group!r} is neither a group name nor a numeric gid")
        if not math.isfinite(self.watchdog_s) or self.watchdog_s < 0:
            problems.append(f"watchdog_s must be >= 0 (and finite), got {self.watchdog_s}")
        for name in (
            "lease_ttl_s",
            "max_lease_ttl_s",
            "transfer_deadline_s",
            "handshake_timeout_s",
            "commit_wait_s",
            "hold_check_timeout_s",
            "staging_wait_s",
            "fence_timeout_s",
            "peer_idle_s",
            "dataplane_heartbeat_timeout_s",
            "dataplane_restart_backoff_s",
            "dataplane_restart_stable_s",
        ):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 (and finite), got {getattr(self, name)}")
        if not math.isfinite(self.read_admission_margin_s) or self.read_admission_margin_s < 0:
            problems.append(f"read_admission_margin_s must be >= 0, got {self.read_admission_margin_s}")
        if not math.isfinite(self.shutdown_grace_s) or self.shutdown_grace_s < 0:
            problems.append(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not (math.isfinite(self.read_descriptor_cost_s) and self.read_descriptor_cost_s >= 0):
            problems.append(f"read_descriptor_cost_s must be >= 0, got {self.read_descriptor_cost_s}")
        if not (math.isfinite(self.convert_bytes_per_s) and self.convert_bytes_per_s > 0):
            problems.append(f"convert_bytes_per_s must be > 0, got {self.convert_bytes_per_s}")
        if not 1e-6 <= self.gil_switch_interval_s <= 1.0:
            problems.append(f"gil_switch_interval_s must be in 1e-6..1, got {self.gil_switch_interval_s}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            problems.append(f"lease_ttl_s {self.lease_ttl_s} exceeds max_lease_ttl_s {self.max_lease_ttl_s}")
        if self.max_run_blocks < 1 or self.max_run_blocks & (self.max_run_blocks - 1):
            problems.append(f"max_run_blocks must be a power of two >= 1, got {self.max_run_blocks}")
        if not 0 <= self.dataplane_copy_threads <= MAX_COPY_THREADS:
            problems.append(
                f"dataplane_copy_threads must be 0 (automatic) to {MAX_COPY_THREADS}, got {self.dataplane_copy_threads}"
            )
        if self.dataplane_parallel_read_min_bytes < 1 << 20:
            problems.append(
                "dataplane_parallel_read_min_bytes must be >= 1 MiB (1048576), "
                f"got {self.dataplane_parallel_read_min_bytes}"
            )
        if self.dataplane_max_post_bytes < 1 << 20:
            problems.append(f"dataplane_max_post_bytes must be >= 1 MiB (1048576), got {self.dataplane_max_post_bytes}")
        if not (
            math.isfinite(self.dataplane_restart_backoff_max_s)
            and self.dataplane_restart_backoff_max_s >= self.dataplane_restart_backoff_s
        ):
            problems.append(
                f"dataplane_restart_backoff_max_s must be >= dataplane_restart_backoff_s "
                f"({self.dataplane_restart_backoff_s}), got {self.dataplane_restart_backoff_max_s}"
            )
        if self.staging_pool_bytes < 0 or self.direct_read_min_bytes < 0:
            problems.append("staging_pool_bytes and direct_read_min_bytes must be >= 0")
        if not self.nixl_backends:
            problems.append("nixl_backends must name at least one backend")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key must be given together")
        bad_uids = [u for u in self.loopback_uids if not u.isdigit()]
        if bad_uids:
            problems.append(f"loopback_uids must be numeric uids, got {bad_uids}")
        if self.nixl_net_devices and not re.fullmatch(r"[A-Za-z0-9_.:,-]+", self.nixl_net_devices):
            problems.append(f"nixl_net_devices {self.nixl_net_devices!r} is not a comma-separated device list")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            problems.append(f"log_level {self.log_level!r} is not DEBUG, INFO, WARNING or ERROR")
        if problems:
            raise ValueError("invalid kvd configuration: " + "; ".join(problems))

    @property
    def copy_threads(self) -> int:
        """dataplane_copy_threads resolved: 0 is one per CPU this process may run on, at most
        AUTO_COPY_THREADS_MAX (more threads than cores only contend for them)."""
        if self.dataplane_copy_threads:
            return self.dataplane_copy_threads
        return max(1, min(AUTO_COPY_THREADS_MAX, len(os.sched_getaffinity(0))))

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert)


_FIELD_TYPES: dict[str, Any] = get_type_hints(KvdConfig)


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a raw value (TOML value, env or flag string) to the field's type."""
    kind = _FIELD_TYPES[name]
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                    raise ValueError(value)
                return lowered in {"1", "true", "yes", "on"}
            return bool(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            if not isinstance(value, (int, float, str)):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(value)
            return float(value)
        if kind == tuple[str, ...]:
            if isinstance(value, str):
                return tuple(part.strip() for part in value.split(",") if part.strip())
            return tuple(str(part) for part in value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {name}={value!r} is not a valid {getattr(kind, '__name__', kind)}") from exc


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(KvdConfig)]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per config field (``--lease-ttl-s``), defaulting to "not given"."""
    parser.add_argument("--config", type=Path, default=None, help="TOML file with config fields.")
    for f in dataclasses.fields(KvdConfig):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            help=f.metadata.get("help", ""),
        )


RETIRED_KEYS: dict[str, str] = {
    "dataplane_max_restarts": "a crash loop of the data-plane worker backs off instead of ending the daemon "
    "(dataplane_restart_backoff_s, dataplane_restart_backoff_max_s, dataplane_restart_stable_s)",
    "dataplane_restart_window_s": "a crash loop of the data-plane worker backs off instead of ending the daemon "
    "(dataplane_restart_backoff_s, dataplane_restart_backoff_max_s, dataplane_restart_stable_s)",
}
"""Keys an earlier release read: a config that still sets one starts, with a warning saying what
replaced it (an upgrade must not turn a node's config into a start-up failure)."""


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """A config, where each field's value came from, and what the environment got wrong."""

    config: KvdConfig
    sources: dict[str, str]
    """Field name -> "default", "file PATH", "env KVD_X", "systemd NOTIFY_SOCKET" or "flag --x"."""
    warnings: tuple[str, ...]
    """Unknown ``KVD_*`` variables, each with the nearest field name when there is one."""


def load_config(
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> KvdConfig:
    """Merge defaults < file < env < flags into a validated config.

    ``env`` defaults to the process environment; pass a dict in tests.
    """
    return resolve_config(file, env, flags).config


def resolve_config(
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> ResolvedConfig:
    """:func:`load_config`, keeping the source of every value and the environment's warnings.

    ``env`` defaults to ``os.environ``: this is the one function of kvd that reads the environment.
    """
    names = set(_field_names())
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    warnings: list[str] = []
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read config file {file}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {file} is not valid TOML: {exc}") from exc
        if "kvd" in data:
            stray = sorted(set(data) - {"kvd"})
            if stray:
                raise ValueError(f"config file {file}: keys {stray} are outside the [kvd] table")
        section = dict(data.get("kvd", data))
        for key in sorted(set(section) & set(RETIRED_KEYS)):
            del section[key]
            warnings.append(f"config file {file}: {key} no longer applies and is ignored: {RETIRED_KEYS[key]}")
        unknown = sorted(set(section) - names)
        if unknown:
            raise ValueError(f"config file {file}: unknown keys {unknown}; known: {sorted(names)}")
        for key, value in section.items():
            values[key] = _coerce(key, value, f"config file {file}")
            sources[key] = f"file {file}"
    environ: Mapping[str, str] = os.environ if env is None else env
    for name, value in _systemd_values(environ).items():
        values[name] = value
        sources[name] = f"systemd {SYSTEMD_ENV[name]}"
    for key, value in sorted(environ.items()):
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name in names:
            values[name] = _coerce(name, value, f"environment {key}")
            sources[name] = f"env {key}"
        elif name in RETIRED_KEYS:
            warnings.append(f"environment variable {key} no longer applies and is ignored: {RETIRED_KEYS[name]}")
        elif key not in NOT_CONFIG_ENV:
            near = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" (did you mean {ENV_PREFIX}{near[0].upper()}?)" if near else ""
            warnings.append(f"environment variable {key} is not a kvd setting and is ignored{hint}")
    for key, value in (flags or {}).items():
        if key in names and value is not None:
            values[key] = _coerce(key, value, f"flag --{key.replace('_', '-')}")
            sources[key] = f"flag --{key.replace('_', '-')}"
    config = KvdConfig(**values)
    return ResolvedConfig(config, {n: sources.get(n, "default") for n in _field_names()}, tuple(warnings))


def _systemd_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` as config values (``KVD_*`` and flags override them).

    ``WATCHDOG_PID``, when set, names the process the watchdog is meant for: another pid
    (a child that inherited the environment) does not ping.
    """
    out: dict[str, Any] = {}
    if environ.get("NOTIFY_SOCKET"):
        out["notify_socket"] = environ["NOTIFY_SOCKET"]
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if usec and (not pid or pid == str(os.getpid())):
        try:
            out["watchdog_s"] = int(usec) / 1e6
        except ValueError as exc:
            raise ValueError(f"environment WATCHDOG_USEC={usec!r} is not a number of microseconds") from exc
    return out


def format_config(resolved: ResolvedConfig) -> str:
    """The effective config as a TOML ``[kvd]`` table, each value commented with its source."""
    lines = ["[kvd]"]
    for f in dataclasses.fields(KvdConfig):
        value = getattr(resolved.config, f.name)
        if isinstance(value, tuple):
            text = "[" + ", ".join(_toml_string(v) for v in value) + "]"
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        else:
            text = _toml_string(value)
        lines.append(f"{f.name} = {text}".ljust(56) + f"  # {resolved.sources[f.name]}")
    return "\n".join(lines) + "\n"


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> KvdConfig:
    """Build the config from parsed CLI arguments (see :func:`add_config_flags`)."""
    return load_config(getattr(args, "config", None), env, vars(args))


def resolve_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ResolvedConfig:
    """:func:`config_from_args` with sources and warnings; ``env`` defaults to the process environment."""
    return resolve_config(getattr(args, "config", None), env, vars(args))


def flags_for(config: KvdConfig, base: KvdConfig | None = None) -> list[str]:
    """Command-line flags that reproduce ``config`` (fields differing from ``base``): to spawn daemons."""
    reference = base or KvdConfig()
    out: list[str] = []
    for f in dataclasses.fields(KvdConfig):
        value = getattr(config, f.name)
        if value == getattr(reference, f.name):
            continue
        text = ",".join(value) if isinstance(value, tuple) else str(value)
        out.append(f"--{f.name.replace('_', '-')}={text}")
    return out
