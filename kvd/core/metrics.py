"""Prometheus metrics of one daemon, on a registry of its own (tests build a fresh one)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.metrics_core import Metric

STEP_READ_BUCKETS = (2, 4, 8, 16, 32, 64)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Children:
    """A labelled metric's children by the label values as given, beside prometheus_client's own
    table (keyed by their strings): ``labels()`` there checks the values, makes a tuple of their
    strings and takes a lock on every call, and the pull path calls it several times per pull
    (in a profile of batched pulls, 7 % of the holder's CPU at one call site). A hit is one dict
    lookup; a miss, a ``remove`` or a ``clear`` takes the lock, and the last two forget every
    cached child (they are rare: an engine unregistered), so a removed child is never handed out."""

    def __init__(self) -> None:
        self.by_values: dict[tuple[Any, ...], Any] = {}
        self.lock = threading.Lock()

    def get(self, values: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        try:
            child = self.by_values.get(values)
        except TypeError:  # an unhashable value: prometheus_client's path, uncached
            return make()
        if child is None:
            with self.lock:
                child = self.by_values[values] = make()
        return child

    def forget(self, drop: Callable[[], None]) -> None:
        with self.lock:
            drop()
            self.by_values = {}


def _children_of(metric: Any) -> _Children:
    """The metric's cache of children, made on first use (prometheus_client makes a labelled
    metric's children through its constructor: no attribute of ours is set there)."""
    children: _Children | None = metric.__dict__.get("_kvd_children")
    if children is None:
        children = metric.__dict__.setdefault("_kvd_children", _Children())
    return children


class Counter(_Counter):
    """prometheus_client's Counter, its labelled children cached (:class:`_Children`)."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Counter:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        children = _children_of(self)
        return children.get(labelvalues, lambda: super(Counter, self).labels(*labelvalues))

    def remove(self, *labelvalues: Any) -> None:
        _children_of(self).forget(lambda: super(Counter, self).remove(*labelvalues))

    def clear(self) -> None:
        _children_of(self).forget(super().clear)


class Gauge(_Gauge):
    """prometheus_client's Gauge, its labelled children cached (:class:`_Children`)."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Gauge:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        children = _children_of(self)
        return children.get(labelvalues, lambda: super(Gauge, self).labels(*labelvalues))

    def remove(self, *labelvalues: Any) -> None:
        _children_of(self).forget(lambda: super(Gauge, self).remove(*labelvalues))

    def clear(self) -> None:
        _children_of(self).forget(super().clear)


class Histogram(_Histogram):
    """prometheus_client's Histogram, its labelled children cached (:class:`_Children`)."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Histogram:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        children = _children_of(self)
        return children.get(labelvalues, lambda: super(Histogram, self).labels(*labelvalues))

    def remove(self, *labelvalues: Any) -> None:
        _children_of(self).forget(lambda: super(Histogram, self).remove(*labelvalues))

    def clear(self) -> None:
        _children_of(self).forget(super().clear)


class Metrics:
    """Every metric kvd exports. ``direction`` is "pull" (bytes in) or "serve" (bytes out)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._before_collect = _BeforeCollect()
        r.register(self._before_collect)  # first: the registry collects in registration order
        # Set by kvd.server.app: what runs (dashboards show it per node) and whether it serves.
        self.build_info = Gauge("kvd_build_info", "Always 1; the running daemon's version", ["version"], registry=r)
        self.serving = Gauge(
            "kvd_serving",
            "1 while health is SERVING; 0 while no data-plane worker serves (kvd_dataplane_serving) and once "
            "shutdown began (health NOT_SERVING)",
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvd_transfer_bytes", "KV bytes moved through NIXL", ["peer", "direction"], registry=r
        )
        self.transfers = Counter(
            "kvd_transfers",
            "Transfers by outcome (done, failed, aborted)",
            ["peer", "direction", "outcome"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "kvd_transfer_duration_seconds",
            "Pull latency from request to blocks loaded",
            ["direction"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.descriptors = Histogram(
            "kvd_transfer_descriptors", "NIXL descriptors posted per transfer", buckets=DESCRIPTOR_BUCKETS, registry=r
        )
        self.step_read_reads = Histogram(
            "kvd_step_read_reads",
            "READs of several pulls posted as one NIXL transfer (a step READ), per step READ",
            buckets=STEP_READ_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("kvd_transfers_in_flight", "Pulls not yet finished", registry=r)
        self.leases_held = Gauge("kvd_leases_held", "Leases currently held for remote readers", registry=r)
        self.leases_ended = Counter(
            "kvd_leases_ended",
            "Leases (holds) ended, by how (read, released, aborted, expired, evicted, engine_gone, shutdown)",
            ["reason"],
            registry=r,
        )
        self.held_bytes = Gauge(
            "kvd_held_bytes",
            "KV bytes of an engine rank under leases, by state (hard: pinned; soft: verified on demand, "
            "nothing pinned; draining: ended, waiting for admitted reads)",
            ["engine_id", "tp_rank", "state"],
            registry=r,
        )
        self.handshakes = Counter("kvd_handshakes", "Peer handshakes by outcome", ["peer", "outcome"], registry=r)
        self.peer_drops = Counter("kvd_peer_drops", "Cached peer handshakes dropped", ["peer", "reason"], registry=r)
        self.dataplane_restarts = Counter(
            "kvd_dataplane_restarts",
            "Data-plane workers lost and replaced, by how the lost one ended (SIGSEGV, SIGKILL, hung, exit N)",
            ["reason"],
            registry=r,
        )
        self.dataplane_serving = Gauge(
            "kvd_dataplane_serving",
            "1 while a data-plane worker serves; 0 from a worker's loss until its replacement has mapped every "
            "engine again (a restart, and its back-off while workers keep dying)",
            registry=r,
        )
        self.agent_reloads = Counter(
            "kvd_agent_reloads",
            "Peer NIXL agents removed and loaded afresh because the peer replaced memory they named",
            registry=r,
        )
        self.errors = Counter("kvd_errors", "Errors returned, by gRPC status", ["operation", "code"], registry=r)
        self.registered_bytes = Gauge(
            "kvd_registered_bytes", "Engine memory registered with NIXL", ["engine_id", "tp_rank"], registry=r
        )
        self.engines = Gauge("kvd_engines_registered", "Engine ranks registered", registry=r)
        self.commits = Counter("kvd_commits", "Commit watermarks received from engines", registry=r)
        self.post_forward = Counter("kvd_post_forward_signals", "Post-forward signals received", registry=r)
        self.staging_bytes_in_use = Gauge("kvd_staging_bytes_in_use", "Staging memory held by pulls", registry=r)
        # Resource lifetimes (docs/lifetimes.md).
        self.quarantined_bytes = Gauge(
            "kvd_quarantined_bytes",
            "Engine memory kept mapped (retired or VRAM) because a read into or out of it was not proven over",
            registry=r,
        )
        self.leases_draining = Gauge(
            "kvd_leases_draining", "Leases that were ended but still wait for admitted reads to finish", registry=r
        )
        self.admitted_reads = Gauge(
            "kvd_admitted_reads", "Reads of this daemon's leases admitted and not over", registry=r
        )
        self.admissions_ended = Counter(
            "kvd_admissions_ended",
            "Admitted reads ended, by how (read, abandoned, timed_out, replaced)",
            ["reason"],
            registry=r,
        )
        self.pull_fences = Counter(
            "kvd_pull_fences",
            "Failed pulls by how their reads were fenced before the failure was reported "
            "(final: NIXL finished them; remapped: the engine memory was re-mapped; quarantined: kept mapped)",
            ["outcome"],
            registry=r,
        )
        self.nixl_reads_in_flight = Gauge(
            "kvd_nixl_reads_in_flight",
            "NIXL READs posted and not final (a given-up read stays until NIXL ends it)",
            registry=r,
        )
        self.peers = Gauge("kvd_peers", "Peer daemons with a live handshake", registry=r)
        self.remote_agents = Gauge(
            "kvd_remote_agents",
            "Peer NIXL agents loaded (live or still in use; this daemon's own once its engines pull from each other)",
            registry=r,
        )

    def before_collect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` before every collection (a scrape, ``generate_latest``): gauges computed
        from the daemon's tables are set there rather than on every event that changes them."""
        self._before_collect.hook = hook


class _BeforeCollect:
    """A collector of no metric of its own, registered before every other: collecting it runs a
    hook that refreshes the gauges collected after it (kvd.core.holds: the lease gauges, which
    cost a pass over every lease and were recomputed on every admission and READ notification)."""

    def __init__(self) -> None:
        self.hook: Callable[[], None] = lambda: None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.hook()
        return iter(())
