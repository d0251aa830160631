"""The daemon's one configuration object, :class:`KvdConfig`: every field, its default and its
``--help`` text, validated on construction.

Frozen: built once (by :mod:`kvd.config` from defaults, a TOML file, ``KVD_*`` variables and
flags) and handed to everything else, which never reads the environment. Which values it refuses,
and why: :mod:`kvd.config_checks`.
"""

from __future__ import annotations

import dataclasses
import os

from kvd.config_checks import problems
from kvd.dataplane_protocol import DEFAULT_MAX_POST_BYTES, DEFAULT_PARALLEL_READ_MIN_BYTES
from kvd_client.paths import default_engine_socket

AUTO_COPY_THREADS_MAX = 4  # dataplane_copy_threads = 0: one per usable CPU, at most this many


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
    engine_stream_socket: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Also serve the engine stream, without gRPC, on <unix_socket>.stream (same owner, group and "
            "mode): engines use it where it is served, gRPC's EngineStream otherwise. On its hop a message costs "
            "a fraction of a gRPC stream message's time, and a pull crosses it twice. False: gRPC only."
        },
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
    step_reads: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Post the READs of an engine step's pulls from one holder engine rank into one local rank as "
            "one NIXL transfer per send to the worker (a step sends in up to four, growing), blocks adjacent "
            "across pulls merged into one descriptor per layer, with one "
            "notification naming every pull (where the holder decodes it); each pull keeps its own admission, "
            "fence and report, and shares the transfer's outcome. false: a NIXL transfer per pull."
        },
    )
    read_notifications: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "End each admitted read with the NIXL notification its READs carry (every holder takes it) "
            "instead of posting them without one and sending the holder a FinishRead on the peer stream once they "
            "are final, where the holder says it takes that (EngineDescriptor.finish_read_ends_reads). UCX reports "
            "a READ that notifies done only once the holder's worker has acknowledged the notification: a wait on "
            "each pull's path (docs/lifetimes.md, \"A read's end\")."
        },
    )
    early_read_window_s: float = dataclasses.field(
        default=120.0,
        metadata={
            "help": "How long after asking for this daemon's handshake a peer may post READs beside their admission "
            "against the memory it names; memory this daemon lets go stays mapped (throw-away pages: a late READ reads "
            "zeros, never unmapped memory) that long plus read_admission_margin_s, and a peer whose handshake is older "
            "handshakes again first. 0: peers read only after their admission."
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
    dataplane_orders_socket: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "Send READ orders to the data-plane worker on a socket of their own, read by its NIXL thread "
            "itself, instead of on its channel, where its event loop reads them and hands them to that thread: "
            "a READ then reaches NIXL with no event-loop turn and no thread hand-off (docs/performance.md)."
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
    peer_stream_port: int = dataclasses.field(
        default=0,
        metadata={
            "help": "TCP port (on host) of the peer stream without gRPC: the same calls, TLS and roles as PeerStream, "
            "named to readers in every handshake; readers call on it once connected (a message there costs a "
            "fraction of a gRPC one, and every pull's admission crosses it). 0: any free port; -1: neither "
            "serve it nor use peers' (the peer stream over gRPC only)."
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
        found = problems(self)
        if found:
            raise ValueError("invalid kvd configuration: " + "; ".join(found))

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
