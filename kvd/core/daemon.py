"""The daemon's core facade: everything the gRPC servicers call, free of gRPC.

One instance per process. All methods run on the asyncio event loop; blocking work (NIXL table
preparation, layout conversion) goes to a thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import mmap
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvd.config import KvdConfig
from kvd.core.commits import CommitTracker
from kvd.core.dataplane import DataPlane
from kvd.core.events import FinishedSending
from kvd.core.holdchecks import HoldChecks, SchedulerChannel
from kvd.core.holder import Holder
from kvd.core.leases import Lease, LeaseEnd, LeaseTable
from kvd.core.local_memory import Memories
from kvd.core.loopback import LoopbackTransport
from kvd.core.memory import RegionRequest
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import HandshakeInfo, Peers, PeerSession, PeerTransport, PrepareRequest, PrepareResult
from kvd.core.pulls import Puller, PullOrder
from kvd.core.registry import EngineRank, Registry, next_registration_id
from kvd.core.restarts import Restarts
from kvd.core.transfers import Transfer, TransferTable
from kvd.core.watches import TransferWatches
from kvd.layout import groups as kv_groups
from kvd.layout.plan import EngineView, block_geometry
from kvd.layout.spec import LayerPlacement, LayoutSpec
from kvd_client.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvdError,
    Unavailable,
)
from kvd_client.group_blocks import flatten_groups

logger = logging.getLogger(__name__)

SWEEP_S = 0.05  # leases, admissions, quarantine, stale pulls
SHUTDOWN_DRAIN_POLL_S = 0.01  # at shutdown: how often to look whether peers' admitted reads are over
# The sweeper sleeps until the next lease or admission deadline (it is woken when one comes
# nearer); it rounds every SWEEP_S only while something is polled rather than announced (pulls in
# flight, stale pulls, quarantined mappings). This bounds its sleep otherwise: an idle daemon
# wakes once a second here, not 20 times (issue 19: idle CPU).
SWEEP_IDLE_MAX_S = 1.0
SWEEP_MIN_S = 0.001  # never spin, even on a deadline the sweep could not act on
LIVENESS_S = 0.25  # how often an engine pid without a pidfd is checked (a kill is noticed within this)
IDLE_PEER_SWEEP_S = 5.0
SCRAPE_WAIT_S = 1.0  # how long a scrape waits for the event loop to compute the lease gauges


@dataclasses.dataclass(frozen=True)
class DaemonStatus:
    """What GetStatus and ``kvd status`` show (a snapshot, built on the event loop)."""

    incarnation: str
    agent_name: str
    peer_address: str
    engines: tuple[EngineRank, ...]
    peers: tuple[PeerSession, ...]
    transfers_in_flight: int
    leases_held: int
    leases_draining: int
    admitted_reads: int
    quarantined_bytes: int
    remote_agents: int
    serving: bool
    uptime_s: float
    # (engine_id, tp_rank) -> (hard-held, soft-held, draining) bytes of that rank's blocks
    held_bytes: dict[tuple[str, int], tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    holds_ended: dict[str, int] = dataclasses.field(default_factory=dict)
    dataplane_pid: int = 0
    dataplane_restarts: int = 0
    dataplane_last_restart: str = ""  # why the last worker was replaced ("" if never)


class Daemon:
    """Registry, memory, data plane, peers, commits, leases and transfers of one daemon."""

    def __init__(self, config: KvdConfig, transport: PeerTransport, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None  # the one every table belongs to (start())
        self.incarnation = uuid.uuid4().hex
        host = socket.gethostname().split(".")[0] or "host"
        self._agent_base = f"{config.agent_name_prefix}-{host}-{self.incarnation}"
        self.advertise_address = config.advertise_address
        self.registry = Registry()
        self.leases = LeaseTable(
            on_admission_over=lambda admission: self.holder.admission_over(admission),
            on_lease_over=self._lease_over,
            admission_margin_s=config.read_admission_margin_s,
            on_new_deadline=self._wake_sweeper,
        )
        self.commits = CommitTracker()
        self.holdchecks = HoldChecks()
        self.holds_ended: dict[str, int] = {}  # LeaseEnd value -> count since start
        self.transfers = TransferTable()
        self.watches = TransferWatches(self.transfers)  # WatchTransfers streams, by the ids they wait on
        self._sweep_now = asyncio.Event()  # a deadline came nearer, or something needs polling
        self._sweep_at = 0.0  # when the sweeper's next round is due (monotonic)
        self._liveness_now = asyncio.Event()  # an engine registered with a pid, or one exited
        # Calls to this daemon's own addresses (both engines on this node) stay in the process.
        self._transport = LoopbackTransport(transport, self)
        self.memories: Memories | None = None
        self.peers: Peers | None = None
        self.puller: Puller | None = None  # the reader's pulls (built at start: it needs the worker)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvd-work")
        self._background: list[asyncio.Task[None]] = []
        self._followups: set[asyncio.Task[None]] = set()  # unpins scheduled by lease callbacks
        self._remote_calls: set[asyncio.Task[None]] = set()  # heartbeats and releases sent to peers
        self._selftest_seed = -1
        self.serving = False
        self.started_at = time.monotonic()
        # The holder's side of a pull: handshakes, admissions, notifications (kvd.core.holder).
        self.holder = Holder(
            config,
            metrics,
            self.registry,
            self.leases,
            self.commits,
            self.holdchecks,
            incarnation=self.incarnation,
            agent_name=lambda: self.agent_name,
            dataplane=lambda: self.dataplane,
            memories=lambda: self._mem,
            require_serving=self.require_serving,
            require_dataplane=self.require_dataplane,
            follow_up=self._follow_up,
            loop=lambda: self._loop,
        )
        # The data-plane worker now serving, and its replacement when it is lost (kvd.core.restarts).
        self.restarts = Restarts(
            config,
            metrics,
            self.registry,
            self.leases,
            agent_base=self._agent_base,
            on_notifications=self.holder.on_notifications,
            memories=lambda: self._mem,
            rebind=self._rebind,
            prepare_tables=self._prepare_tables,
            unregister=self._unregister,
            daemon_serving=lambda: self.serving,
            stop_serving=self._stop_serving,
        )
        self.selftest_engine_id = f"kvd-selftest-{self.incarnation[:8]}"

    # --- life cycle ------------------------------------------------------------------------

    @property
    def dataplane(self) -> DataPlane | None:
        """The data-plane worker now serving (a restart replaces it: kvd.core.restarts)."""
        return self.restarts.dataplane

    @property
    def agent_name(self) -> str:
        """The NIXL agent's name: a new data-plane worker gets a new one (…-r<N>)."""
        plane = self.restarts.dataplane
        return plane.name if plane is not None else self._agent_base

    @property
    def fatal(self) -> asyncio.Future[str] | None:
        """Set with the reason when the daemon must exit (a new worker cannot start)."""
        return self.restarts.fatal

    @property
    def dataplane_serving(self) -> bool:
        return self.restarts.serving

    @property
    def on_dataplane_serving(self) -> Callable[[], None]:
        return self.restarts.on_serving

    @on_dataplane_serving.setter
    def on_dataplane_serving(self, callback: Callable[[], None]) -> None:
        self.restarts.on_serving = callback  # kvd.server.app: health follows the worker

    @property
    def dataplane_restarts(self) -> int:
        return self.restarts.restarts

    @property
    def dataplane_last_restart(self) -> str:
        return self.restarts.last_restart

    def require_dataplane(self) -> None:
        self.restarts.require_dataplane()

    def _rebind(self, plane: DataPlane) -> None:
        """A new worker replaced a lost one: the parts that reach it through their own handle."""
        self._mem.rebind(plane)
        if self.peers is not None:
            self.peers.rebind(plane)
        if self.puller is not None:
            self.puller.rebind(plane)

    def _stop_serving(self) -> None:
        self.serving = False

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.metrics.before_collect(self._gauges_for_scrape)
        dataplane = await self.restarts.start()
        self.memories = Memories(dataplane, self.metrics)
        self.memories.on_quarantined = self._wake_sweeper
        self.peers = Peers(
            self._transport,
            dataplane,
            self.metrics,
            lambda: self.incarnation,
            self.config.handshake_timeout_s,
            self.config.peer_idle_s,
            warm=lambda session: self.puller.warm(session) if self.puller is not None else asyncio.sleep(0),
            reload_wait_s=self.config.transfer_deadline_s,
        )
        self.puller = Puller(
            self.config,
            self.metrics,
            dataplane,
            self.peers,
            self._transport,
            self.memories,
            self._executor,
            self.registry,
            self.transfers,
            next_registration_id=next_registration_id,
            serving=lambda: self.serving,
            require_serving=self.require_serving,
            wake_sweeper=self._wake_sweeper,
        )
        self._background = [
            loop.create_task(self._sweeper(), name="kvd-sweeper"),
            loop.create_task(self._liveness_loop(), name="kvd-liveness"),
        ]
        self.serving = True
        self.restarts.serves(True)
        logger.info("daemon %s started (agent %s)", self.incarnation, self.agent_name)

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let in-flight pulls and peers' admitted reads of our leases finish
        within ``grace_s``, abort or end the rest, release all."""
        self.serving = False
        grace_ends = time.monotonic() + grace_s
        pending = [t.task for t in self.transfers.in_flight() if t.task is not None]
        if pending:
            logger.info("shutdown: waiting up to %.1fs for %d in-flight pulls", grace_s, len(pending))
            _, still = await asyncio.wait(pending, timeout=grace_s)
            for task in still:
                task.cancel("daemon shutting down")
            if still:  # an aborted pull fences its reads first (bounded by fence_timeout_s)
                await asyncio.wait(still, timeout=self.config.fence_timeout_s + 5.0)
        # Every pull has ended and its outcome is queued on the streams watching it: they send it,
        # then end UNAVAILABLE (a router's waiters learn how each pull ended, then that we left).
        self.watches.close(Unavailable("the daemon is shutting down: watch transfers on its replacement"))
        # Leases end now. One a peer is reading drains: its engine is told (finished_sending, and
        # reuses the blocks) only once that read is proven over, which it gets the rest of the
        # grace for (PreparePull is refused from here: no read starts). A read still admitted
        # after that cannot be proven over: it ends unproven and its memory is retired.
        self.leases.end_all(LeaseEnd.SHUTDOWN)
        while self.leases.open_admissions and time.monotonic() < grace_ends:
            await asyncio.sleep(SHUTDOWN_DRAIN_POLL_S)
        self.leases.force_end_admissions()
        for rank in list(self.registry):
            await self._unregister(rank, "daemon shutting down")
        await self._settle_followups()
        for task in [*self._background, *self._remote_calls]:
            task.cancel()
        await asyncio.gather(*self._background, *self._remote_calls, return_exceptions=True)
        if self.peers is not None:
            await self.peers.drop_all()
        await self._transport.close()
        if self.puller is not None:
            await self.puller.close()
        await self.restarts.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        logger.info("daemon %s stopped", self.incarnation)

    async def _settle_followups(self) -> None:
        while self._followups:
            await asyncio.gather(*list(self._followups), return_exceptions=True)

    def _follow_up(self, coro: Any) -> None:
        """Run an async consequence of a synchronous callback (an unpin) as its own task."""
        task = asyncio.get_running_loop().create_task(coro)
        self._followups.add(task)
        task.add_done_callback(self._followups.discard)

    def require_serving(self) -> None:
        if not self.serving:
            raise Unavailable("the daemon is shutting down: retry against its replacement")

    @property
    def _mem(self) -> Memories:
        if self.memories is None:
            raise Unavailable("the daemon is still starting")
        return self.memories

    # --- engines -----------------------------------------------------------------------------

    async def register_engine(
        self,
        engine_id: str,
        spec: LayoutSpec,
        regions: Sequence[RegionRequest],
        placements: Sequence[LayerPlacement],
        require_commits: bool = False,
        engine_pid: int = 0,
        extra_groups: Sequence[EngineView] = (),
    ) -> EngineRank:
        """Map the engine's memory (zero copy) and register it with NIXL. All or nothing.

        ``extra_groups``: a hybrid model's KV cache groups after group 0 (``spec`` and
        ``placements``), each over the same regions (vLLM overlays groups on one allocation).
        """
        self.require_serving()
        if not regions:
            raise InvalidArgument("a registration needs at least one memory region")
        if len({region.kind for region in regions}) != 1:
            raise InvalidArgument("all regions of one engine rank must be of one memory kind")
        groups = (EngineView(spec, tuple(placements)), *extra_groups)
        kv_groups.validate_groups(groups)
        self.registry.check_can_add(engine_id, spec, tuple(extra_groups))
        sizes = [region.size_bytes for region in regions]
        for index, group in enumerate(groups):
            try:
                group.spec.validate_placements(group.placements, sizes)
            except InvalidArgument as exc:
                raise InvalidArgument(
                    f"{kv_groups.describe_group(index, group)}: {exc.message}" if index else exc.message
                ) from None
        plane = self.dataplane
        self.require_dataplane()
        try:
            memory = await self._mem.open(regions, next_registration_id())
        except KvdError:
            raise
        except Exception as exc:
            raise Internal(f"NIXL could not register engine {engine_id!r} memory: {exc}") from exc
        if self.dataplane is not plane:  # the worker was replaced meanwhile: that mapping is gone
            raise Unavailable(f"the data plane restarted while engine {engine_id!r} registered: register again")
        rank = EngineRank(
            engine_id=engine_id,
            spec=spec,
            placements=tuple(placements),
            memory=memory,
            require_commits=require_commits,
            engine_pid=engine_pid,
            extra_groups=tuple(extra_groups),
        )
        try:
            self.registry.add(rank)  # a racing registration of the same rank loses here
        except Exception:
            await self._mem.fence(memory)
            raise
        if engine_pid:
            self._liveness_now.set()  # watch its pid
        self.metrics.engines.set(len(self.registry))
        self.metrics.registered_bytes.labels(engine_id, str(spec.tp_rank)).set(rank.registered_bytes)
        await self._prepare_tables(rank)
        logger.info(
            "registered engine %s rank %d: %s, %d bytes in %d %s regions",
            engine_id,
            spec.tp_rank,
            " + ".join(f"{g.kind.name.lower()} {g.spec.describe()}" for g in rank.groups)
            if extra_groups
            else spec.describe(),
            rank.registered_bytes,
            len(regions),
            rank.mem_type,
        )
        return rank

    async def _prepare_tables(self, rank: EngineRank) -> None:
        """Prepare the rank's whole-block tables now, so the first pull does not pay for them."""
        memory = rank.memory
        if not memory.usable:
            return
        self._mem.pin(memory)
        try:
            for group in rank.groups:
                await memory.table(block_geometry(group, self.config.max_run_blocks), self._executor)
        finally:
            await self._mem.unpin(memory)

    async def unregister_engine(self, engine_id: str, tp_rank: int) -> None:
        await self._unregister(self.registry.get(engine_id, tp_rank), "unregistered by the engine")

    async def _unregister(self, rank: EngineRank, reason: str) -> None:
        """Fence the rank at once; its memory is released when nothing can touch it any more.

        Fenced: no new pull, hold or admitted read finds it. In-flight pulls into it are
        cancelled (each fences its own reads). Its engine's leases end once their admitted reads
        are over. The mapping and its NIXL registration go when the last pin does.
        """
        if self.registry.current(rank) is not rank:
            return
        self.registry.remove(rank.engine_id, rank.tp_rank)
        self._keep_for_early_reads(rank)
        for transfer in self.transfers.in_flight():
            if transfer.engine_id == rank.engine_id and transfer.tp_rank == rank.tp_rank and transfer.task:
                transfer.task.cancel(f"engine {rank.engine_id} rank {rank.tp_rank}: {reason}")
        if not self.registry.ranks_of(rank.engine_id):
            self.leases.end_all(LeaseEnd.ENGINE_GONE, rank.engine_id)
        self.commits.forget_engine(rank.engine_id, rank.tp_rank)
        if rank.wakeup is not None:
            rank.wakeup.set()
        self.metrics.engines.set(len(self.registry))
        self.metrics.registered_bytes.remove(rank.engine_id, str(rank.tp_rank))
        for state in ("hard", "soft", "draining"):
            with contextlib.suppress(KeyError):
                self.metrics.held_bytes.remove(rank.engine_id, str(rank.tp_rank), state)
        logger.info("unregistered engine %s rank %d: %s", rank.engine_id, rank.tp_rank, reason)
        await self._mem.fence(rank.memory)

    def _keep_for_early_reads(self, rank: EngineRank) -> None:
        """A rank that goes while its engine has leases out may still be read by a READ posted
        beside its admission (never admitted, so never pinned: docs/lifetimes.md, "A READ beside
        its admission"). Its mapping is then retired, not freed, until the last lease with a
        reader rank neither admitted nor done could still be read: its expiry plus
        ``read_admission_margin_s`` (readers post early only before the expiry their lease
        names). Unmapped memory read by a peer crashes the worker serving it (UCX over TCP
        reads it itself)."""
        if rank.require_commits:
            return  # readers of a rank that commits after leasing are admitted first
        leases = [
            lease for lease in self.leases.every() if lease.engine_id == rank.engine_id and _may_get_a_reader(lease)
        ]
        loop = self._loop
        if not leases or loop is None:
            return
        until = max(lease.expires_at for lease in leases) + self.config.read_admission_margin_s
        key = f"early-reads/{rank.registration_id}"
        memory = rank.memory
        self._mem.taint(memory, key)
        loop.call_later(max(0.0, until - time.monotonic()), self._mem.prove, memory, key)

    # --- engine stream ---------------------------------------------------------------------------

    def attach_stream(self, engine_id: str, tp_rank: int) -> tuple[EngineRank, int]:
        """Make a new stream the rank's current one; returns the rank and the stream's generation.

        A stream that is still open is superseded, not refused: an engine that reconnects after
        losing its connection must not wait for the daemon to notice the old one is dead.
        """
        rank = self.registry.get(engine_id, tp_rank)
        previous = rank.wakeup
        rank.stream_generation += 1
        rank.stream_connected = True
        rank.wakeup = asyncio.Event()
        if previous is not None:
            previous.set()  # the superseded stream wakes, sees it is no longer current, and ends
            logger.info("engine %s rank %d: a new stream supersedes the open one", engine_id, tp_rank)
        if rank.pending:
            rank.wakeup.set()
        return rank, rank.stream_generation

    def detach_stream(self, rank: EngineRank, generation: int) -> None:
        if rank.stream_generation == generation:
            rank.stream_connected = False
            rank.wakeup = None

    def commit(self, rank: EngineRank, request_id: str, committed_tokens: int) -> None:
        self.commits.commit(rank.engine_id, rank.tp_rank, request_id, committed_tokens)
        self.metrics.commits.inc()

    def post_forward(self, rank: EngineRank, step: int, finished_request_ids: Sequence[str]) -> None:
        """A step's KV is complete (sent after the draft proposer ran): nothing to serve yet."""
        self.metrics.post_forward.inc()
        logger.debug(
            "engine %s rank %d: step %d post-forward, %d finished",
            rank.engine_id,
            rank.tp_rank,
            step,
            len(finished_request_ids),
        )

    # --- leases ----------------------------------------------------------------------------------

    def hold(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ttl_s: float = 0.0,
        group_block_ids: Sequence[Sequence[int]] = (),
        soft: bool = False,
    ) -> tuple[Lease, TransferParams]:
        """Hold a finished request's blocks (every KV cache group's) for a remote reader.

        ``soft``: the engine kept nothing; each read is verified by its scheduler (kvd.core.holdchecks).
        """
        self.require_serving()
        if soft and not self.holdchecks.connected(engine_id):
            raise FailedPrecondition(
                f"engine {engine_id!r} has no scheduler stream: a soft hold could never be verified "
                "(open the stream first, or hold hard)"
            )
        ranks = self.registry.require_engine(engine_id)
        first = next(iter(ranks.values()))
        spec = first.spec
        if not request_id:
            raise InvalidArgument("request_id must not be empty")
        if num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be >= 1, got {num_tokens}")
        need = spec.blocks_for(num_tokens)
        if len(block_ids) < need:
            raise InvalidArgument(
                f"{num_tokens} tokens need {need} blocks of {spec.block_size} tokens, got {len(block_ids)} block ids"
            )
        spec.validate_block_ids(block_ids, "held block ids")
        kept = kv_groups.validate_hold_groups(first.groups, group_block_ids, num_tokens)
        if soft and kept:
            raise FailedPrecondition(
                f"engine {engine_id!r} has {len(first.groups)} KV cache groups: a soft hold is verified through "
                "one block table's hashes only, so hold a hybrid model's request hard"
            )
        ttl = ttl_s or self.config.lease_ttl_s
        if ttl > self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {ttl}s exceeds max_lease_ttl_s {self.config.max_lease_ttl_s}s")
        lease = self.leases.create(engine_id, request_id, tuple(block_ids[:need]), num_tokens, ttl, soft=soft)
        lease.group_block_ids = kept
        return lease, self.params_of(lease)

    def params_of(self, lease: Lease) -> TransferParams:
        ranks = self.registry.require_engine(lease.engine_id)
        spec = next(iter(ranks.values())).spec
        group_ids, group_counts = flatten_groups(lease.group_block_ids)
        return TransferParams(
            daemon_address=self.advertise_address,
            daemon_incarnation=self.incarnation,
            engine_id=lease.engine_id,
            tp_size=spec.tp_size,
            lease_id=lease.lease_id,
            block_ids=lease.block_ids,
            num_tokens=lease.num_tokens,
            request_id=lease.request_id,
            lease_expires_unix_ms=int((time.time() + self.leases.remaining_s(lease)) * 1000),
            registration_ids=tuple(ranks[r].registration_id for r in sorted(ranks)),
            group_block_ids=group_ids,
            group_block_counts=group_counts,
        )

    def renew_lease(self, lease_id: str, ttl_s: float = 0.0) -> Lease:
        ttl = ttl_s or self.config.lease_ttl_s
        if ttl > self.config.max_lease_ttl_s:
            raise InvalidArgument(f"lease ttl {ttl}s exceeds max_lease_ttl_s {self.config.max_lease_ttl_s}s")
        return self.leases.renew(lease_id, ttl)

    def release_lease(self, lease_id: str) -> None:
        """End the lease (it drains first if a read is admitted on it)."""
        self.leases.end(lease_id, LeaseEnd.RELEASED)

    def release_leases(self, lease_ids: Sequence[str], reason: str) -> int:
        """Nobody will read these leases (the reading request was aborted or recomputed): end
        them now (each drains first if a read is admitted). Unknown ids are skipped. How many ended."""
        ended = 0
        for lease_id in lease_ids:
            lease = self.leases.find(lease_id)
            if lease is None or lease.draining:
                continue
            self.leases.end(lease_id, LeaseEnd.ABORTED)
            ended += 1
            logger.info("lease %s on %s/%s released: %s", lease_id, lease.engine_id, lease.request_id, reason)
        return ended

    def renew_leases(self, lease_ids: Sequence[str]) -> list[str]:
        """Reader heartbeats: each live lease is renewed by its own TTL; returns the ids not live."""
        return self.leases.renew_by_own_ttl(list(lease_ids))

    def scheduler_attached(self, engine_id: str) -> SchedulerChannel:
        return self.holdchecks.attach(engine_id)

    def scheduler_detached(self, channel: SchedulerChannel) -> None:
        """The engine's scheduler is gone (or reconnected without its state): its soft holds
        cannot be verified any more; they end."""
        if not self.holdchecks.detach(channel):
            return
        for lease in self.leases.all():
            if lease.soft and lease.engine_id == channel.engine_id:
                self.leases.end(lease.lease_id, LeaseEnd.ENGINE_GONE)

    def remote_leases(self, leases: Sequence[tuple[str, str]], release: bool, reason: str = "") -> None:
        """A local engine's requests will read these (address, lease id) leases later (renew), or
        never (release): tell their holders, batched per holder. Best effort, in the background."""
        by_holder: dict[str, list[str]] = {}
        for address, lease_id in leases:
            if address and lease_id:
                by_holder.setdefault(address, []).append(lease_id)
        for address, ids in by_holder.items():
            if address == self.advertise_address:
                if release:
                    self.release_leases(ids, reason)
                else:
                    self.renew_leases(ids)
                continue
            task = asyncio.get_running_loop().create_task(self._tell_holder(address, ids, release, reason))
            self._remote_calls.add(task)
            task.add_done_callback(self._remote_calls.discard)

    async def _tell_holder(self, address: str, lease_ids: list[str], release: bool, reason: str) -> None:
        try:
            if release:
                await self._transport.release_leases(address, lease_ids, reason, self.config.handshake_timeout_s)
            else:
                unknown = await self._transport.renew_leases(address, lease_ids, self.config.handshake_timeout_s)
                if unknown:
                    logger.debug("holder %s no longer holds leases %s", address, unknown[:8])
        except KvdError as exc:  # best effort: an unrenewed lease expires, an unreleased one too
            logger.info(
                "%s %d leases at %s failed: %s", "releasing" if release else "renewing", len(lease_ids), address, exc
            )

    def lookup_held(self, engine_id: str = "", request_id: str = "") -> list[TransferParams]:
        return [
            self.params_of(lease)
            for lease in self.leases.all()
            if (not engine_id or lease.engine_id == engine_id)
            and (not request_id or lease.request_id == request_id)
            and self.leases.remaining_s(lease) > 0
        ]

    def _lease_over(self, lease: Lease, how: LeaseEnd) -> None:
        """LeaseTable callback: no reader can read the blocks any more; tell every rank, once.

        A soft lease's engine never kept the blocks: only its scheduler hears (it forgets the hold).
        """
        if lease.soft:
            self.holdchecks.tell_ended(lease.engine_id, lease.request_id, lease.lease_id, how.value)
        else:
            for rank in self.registry.ranks_of(lease.engine_id).values():
                rank.post(FinishedSending(lease.request_id, lease.lease_id, expired=how is LeaseEnd.EXPIRED))
        self.commits.forget_request(lease.engine_id, lease.request_id)
        self.metrics.leases_ended.labels(how.value).inc()
        self.holds_ended[how.value] = self.holds_ended.get(how.value, 0) + 1
        logger.debug("lease %s on %s/%s ended: %s", lease.lease_id, lease.engine_id, lease.request_id, how.value)

    def _gauges_for_scrape(self) -> None:
        """Metrics hook, run before every collection: set the lease gauges from the tables.

        A scrape comes on the metrics server's thread: the tables are the event loop's, so the
        gauges are computed there (at most SCRAPE_WAIT_S; a loop that does not answer in time
        leaves the previous values). A collection on the loop itself (tests) computes them at once."""
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or on_loop or loop.is_closed() or not loop.is_running():
            self._lease_gauges()
            return
        done = concurrent.futures.Future[None]()

        def refresh() -> None:
            try:
                self._lease_gauges()
            finally:
                done.set_result(None)

        loop.call_soon_threadsafe(refresh)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            done.result(SCRAPE_WAIT_S)

    def _lease_gauges(self) -> None:
        for (engine_id, tp_rank), values in self.held_bytes().items():
            for state, value in zip(("hard", "soft", "draining"), values, strict=True):
                self.metrics.held_bytes.labels(engine_id, str(tp_rank), state).set(value)
        self.metrics.leases_held.set(len(self.leases))
        self.metrics.leases_draining.set(self.leases.draining)
        self.metrics.admitted_reads.set(self.leases.open_admissions)

    def _wake_sweeper(self) -> None:
        """Have the sweeper recompute its sleep, if it sleeps longer than SWEEP_S (a round due
        sooner sees the news anyway: a burst of holds or pulls costs no extra rounds)."""
        if self._sweep_at - time.monotonic() > SWEEP_S:
            self._sweep_now.set()

    def _sweep_delay(self) -> float:
        """Seconds the sweeper may sleep: SWEEP_S while it polls something that announces no
        end (a stale pull's or a quarantined mapping's reads turning final, a pull in flight that
        may leave one), else until the next lease or admission deadline, at most SWEEP_IDLE_MAX_S."""
        puller = self.puller
        if (
            (self.memories is not None and self.memories.quarantine)
            or (puller is not None and puller.stale_pulls)
            or self.transfers.any_in_flight()
        ):
            return SWEEP_S
        due = self.leases.next_deadline() - time.monotonic()
        return max(SWEEP_MIN_S, min(SWEEP_IDLE_MAX_S, due))

    async def _sweeper(self) -> None:
        """Expire leases, end overdue admissions, free quarantined memory, forget idle peers.

        A deadline is acted on when it passes (not on a fixed 50 ms tick): the sweeper sleeps
        until the next one, woken early when a lease, renewal, admission, pull or quarantined
        mapping may bring one nearer (see SWEEP_IDLE_MAX_S).
        """
        last_idle_sweep = time.monotonic()
        while True:
            self._sweep_now.clear()
            try:
                delay = self._sweep_delay()
            except Exception:  # the sweeper must survive a bug: round every SWEEP_S then
                logger.exception("sweep scheduling failed")
                delay = SWEEP_S
            self._sweep_at = time.monotonic() + delay
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._sweep_now.wait()
                    # Woken: a deadline may be nearer, or there is something to poll. A round
                    # SWEEP_S from now (later wakes are no-ops meanwhile) sees it: a burst of
                    # holds or pulls costs at most a round every SWEEP_S, as a fixed tick did.
                    self._sweep_at = time.monotonic() + SWEEP_S
                    await asyncio.sleep(SWEEP_S)
            try:
                self.leases.sweep()
                await self._mem.sweep_quarantine()
                if self.puller is not None:
                    await self.puller.sweep()
                if self.peers is not None and time.monotonic() - last_idle_sweep > IDLE_PEER_SWEEP_S:
                    last_idle_sweep = time.monotonic()
                    await self.peers.forget_idle()
            except Exception:  # the sweeper must survive a bug in one round: log and go on
                logger.exception("sweep failed")

    async def _liveness_loop(self) -> None:
        """An engine process that exited without unregistering is unregistered here.

        Each engine pid is watched through a pidfd, readable once the process exits: the exit is
        noticed at once, and an idle daemon is not woken every LIVENESS_S to look (issue 19). A
        pid no pidfd can be opened for (a kernel without pidfd_open) is checked every LIVENESS_S.
        A registration wakes the loop to watch its pid.
        """
        loop = asyncio.get_running_loop()
        watched: dict[int, int] = {}  # engine pid -> its pidfd (registered with the loop)
        exited: set[int] = set()  # pids whose pidfd said so, not yet acted on

        def on_exit(pid: int) -> None:
            fd = watched.pop(pid)
            loop.remove_reader(fd)
            os.close(fd)
            exited.add(pid)
            self._liveness_now.set()

        try:
            while True:
                self._liveness_now.clear()
                pids = {rank.engine_pid for rank in self.registry if rank.engine_pid}
                for pid in watched.keys() - pids:  # its ranks are gone
                    loop.remove_reader(watched[pid])
                    os.close(watched.pop(pid))
                gone, polled = set(exited), set()
                exited.clear()  # an exit seen while this round awaits is left for the next one
                for pid in pids - watched.keys() - gone:
                    fd = _open_pidfd(pid)
                    if fd is None:
                        polled.add(pid)
                    elif fd < 0:
                        gone.add(pid)
                    else:
                        watched[pid] = fd
                        loop.add_reader(fd, on_exit, pid)
                for rank in list(self.registry):
                    pid = rank.engine_pid
                    if pid in gone or (pid in polled and not _process_alive(pid)):
                        logger.warning("engine %s rank %d (pid %d) exited", rank.engine_id, rank.tp_rank, pid)
                        await self._unregister(rank, f"engine process {pid} exited")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LIVENESS_S if polled else None):
                        await self._liveness_now.wait()
        finally:
            for fd in watched.values():
                loop.remove_reader(fd)
                os.close(fd)

    # --- PeerService: a reader daemon's calls (kvd.core.holder) --------------------------------

    def handshake_info(self) -> HandshakeInfo:
        return self.holder.handshake_info()

    async def prepare_pull(
        self, request: PrepareRequest, *, reader_address: str = "", reader_incarnation: str = ""
    ) -> PrepareResult:
        return await self.holder.prepare_pull(
            request, reader_address=reader_address, reader_incarnation=reader_incarnation
        )

    async def finish_read(
        self, lease_id: str, reader_tp_rank: int, reader_incarnation: str = "", reader_transfer_id: str = ""
    ) -> None:
        await self.holder.finish_read(lease_id, reader_tp_rank, reader_incarnation, reader_transfer_id)

    def abandon_pull(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reason: str,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
    ) -> None:
        self.holder.abandon_pull(lease_id, reader_tp_rank, reason, reader_incarnation, reader_transfer_id)

    # --- RouterService / EngineService: this daemon's engines pull (kvd.core.pulls) ---------------

    @property
    def _reader(self) -> Puller:
        if self.puller is None:
            self.require_serving()
            raise Unavailable("the daemon is still starting")
        return self.puller

    def start_pull(
        self,
        engine_id: str,
        tp_rank: int,
        request_id: str,
        local_block_ids: Sequence[int],
        remote: TransferParams,
        deadline_s: float = 0.0,
        local_group_block_ids: Sequence[Sequence[int]] = (),
    ) -> Transfer:
        return self._reader.start_pull(
            engine_id, tp_rank, request_id, local_block_ids, remote, deadline_s, local_group_block_ids
        )

    def start_order(self, order: PullOrder) -> Transfer:
        return self._reader.start_order(order)

    def start_pulls(self, orders: Sequence[PullOrder | KvdError]) -> list[Transfer | KvdError]:
        return self._reader.start_pulls(orders)

    def cancel_transfer(self, transfer_id: str) -> Transfer:
        return self._reader.cancel_transfer(transfer_id)

    # --- selftest ---------------------------------------------------------------------------------

    async def selftest_hold(self, size_bytes: int, seed: int) -> tuple[LayoutSpec, TransferParams]:
        """Hold a daemon-owned scratch engine filled with the pattern of ``seed`` (see kvd.core.scratch).

        The scratch engine is an ordinary registration (shm, NIXL) so the selftest exercises the
        real path. One scratch engine per daemon; a different size or seed replaces it.
        """
        from kvd.core import scratch  # noqa: PLC0415
        from kvd.core.memory import MemoryKind  # noqa: PLC0415
        from kvd.layout.spec import contiguous_placements  # noqa: PLC0415
        from kvd_client.shm import create_shm_file, unlink_shm  # noqa: PLC0415

        self.require_serving()
        if not 0 < size_bytes <= scratch.MAX_SCRATCH_BYTES:
            raise InvalidArgument(f"selftest size must be in 1..{scratch.MAX_SCRATCH_BYTES} bytes, got {size_bytes}")
        spec = scratch.scratch_layout(size_bytes)
        ranks = self.registry.ranks_of(self.selftest_engine_id)
        current = ranks.get(0)
        if current is not None and (current.spec != spec or self._selftest_seed != seed):
            await self._unregister(current, "selftest scratch replaced")
            current = None
        if current is None:
            name = f"{self.selftest_engine_id}-{seed}"
            path = create_shm_file(name, spec.total_bytes)
            try:
                with path.open("r+b") as file, mmap.mmap(file.fileno(), spec.total_bytes) as mapped:
                    scratch.fill_pattern(np.frombuffer(mapped, dtype=np.uint8), seed)  # numpy: no torch here
                await self.register_engine(
                    self.selftest_engine_id,
                    spec,
                    [RegionRequest(MemoryKind.SHM, spec.total_bytes, shm_name=name)],
                    contiguous_placements(spec),
                )
            finally:
                unlink_shm(name)  # the daemon's mapping keeps the memory alive
            self._selftest_seed = seed
        lease, params = self.hold(
            self.selftest_engine_id,
            f"selftest-{uuid.uuid4().hex[:8]}",
            list(range(spec.num_blocks)),
            spec.num_blocks * spec.block_size,
        )
        return spec, params

    # --- status ------------------------------------------------------------------------------------

    def status(self) -> DaemonStatus:
        return DaemonStatus(
            incarnation=self.incarnation,
            agent_name=self.agent_name,
            peer_address=self.advertise_address,
            engines=tuple(self.registry),
            peers=tuple(self.peers.sessions()) if self.peers else (),
            transfers_in_flight=len(self.transfers.in_flight()),
            leases_held=len(self.leases),
            leases_draining=self.leases.draining,
            admitted_reads=self.leases.open_admissions,
            quarantined_bytes=self.memories.quarantined_bytes if self.memories else 0,
            remote_agents=len(self.peers.agents()) if self.peers else 0,
            serving=self.serving,
            uptime_s=time.monotonic() - self.started_at,
            held_bytes=self.held_bytes(),
            holds_ended=dict(self.holds_ended),
            dataplane_pid=self.dataplane.pid if self.dataplane is not None else 0,
            dataplane_restarts=self.dataplane_restarts,
            dataplane_last_restart=self.dataplane_last_restart,
        )

    def held_bytes(self) -> dict[tuple[str, int], tuple[int, int, int]]:
        """Per registered rank: bytes of its blocks under hard leases, soft leases, and draining ones."""
        out: dict[tuple[str, int], tuple[int, int, int]] = {}
        per_engine: dict[str, list[int]] = {}
        for lease in self.leases.every():
            counts = per_engine.setdefault(lease.engine_id, [0, 0, 0])
            counts[2 if lease.draining else 1 if lease.soft else 0] += len(lease.block_ids)
        for rank in self.registry:
            counts = per_engine.get(rank.engine_id, [0, 0, 0])
            per_block = rank.spec.total_bytes // max(1, rank.spec.num_blocks)
            out[(rank.engine_id, rank.tp_rank)] = (counts[0] * per_block, counts[1] * per_block, counts[2] * per_block)
        return out


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; -1 if no such process is left; None if pidfds are not to be had."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (OSError, AttributeError):  # no pidfd_open (kernel < 5.3, not Linux): poll instead
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _may_get_a_reader(lease: Lease) -> bool:
    """Whether a reader rank of the lease is neither done nor admitted: its READ may yet come."""
    seen = lease.done_readers | {admission.reader_rank for admission in lease.admissions.values()}
    return not lease.reader_tp_size or len(seen) < lease.reader_tp_size
