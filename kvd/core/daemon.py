"""The daemon's core facade: everything the gRPC servicers call, free of gRPC.

One instance per process. :class:`Daemon` composes the parts that own the state and forwards each
call to the one that answers it; read it top to bottom to know where an RPC goes:

* ``engines``: registrations, engine streams, liveness (:mod:`kvd.core.engines`);
* ``holds``: HoldBlocks and the leases as callers see them; ``holder_calls``: renewals and
  releases of leases held elsewhere (:mod:`kvd.core.holds`);
* ``holder``: the holder's pipeline: Handshake, PreparePull, READ notifications (:mod:`kvd.core.holder`);
* ``puller``: the reader's pipeline, StartPull(s) to the engine's completion (:mod:`kvd.core.pulls`;
  built at start: it needs the worker);
* ``restarts``: the data-plane worker now serving and its replacement (:mod:`kvd.core.restarts`);
* ``sweeper``: deadlines and polls (:mod:`kvd.core.sweeper`); ``selftest``: the scratch engine.

The tables several parts share are created here and handed to each explicitly (registry, lease
table, commits, hold checks, transfers); what a data-plane restart replaces (the worker, the
memories and peers bound to it) reaches them through getters. All methods run on the asyncio
event loop; blocking work (NIXL table preparation, layout conversion) goes to a thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import time
import uuid
from collections.abc import Sequence

from kvd.config import KvdConfig
from kvd.core.commits import CommitTracker
from kvd.core.context import CoreContext
from kvd.core.dataplane import DataPlane
from kvd.core.engines import Engines
from kvd.core.holdchecks import HoldChecks, SchedulerChannel
from kvd.core.holder import Holder
from kvd.core.holds import HolderCalls, Holds
from kvd.core.leases import Lease, LeaseEnd, LeaseTable
from kvd.core.local_memory import Memories
from kvd.core.loopback import LoopbackTransport
from kvd.core.memory import RegionRequest
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import HandshakeInfo, Peers, PeerTransport, PrepareRequest, PrepareResult
from kvd.core.pulls import Puller, PullOrder
from kvd.core.registry import EngineRank, Registry, next_registration_id
from kvd.core.restarts import Restarts
from kvd.core.selftest import SelftestScratch
from kvd.core.status import DaemonStatus, daemon_status
from kvd.core.sweeper import Sweeper
from kvd.core.transfers import Transfer, TransferTable
from kvd.core.watches import TransferWatches
from kvd.layout.plan import EngineView
from kvd.layout.spec import LayerPlacement, LayoutSpec
from kvd_client.errors import KvdError, Unavailable

__all__ = ["Daemon", "DaemonStatus", "PullOrder"]  # the last two live in kvd.core.status and kvd.core.pulls

logger = logging.getLogger(__name__)

SHUTDOWN_DRAIN_POLL_S = 0.01  # at shutdown: how often to look whether peers' admitted reads are over


class Daemon:
    """One daemon's parts, composed; the servicers' one entry point (module docstring)."""

    def __init__(self, config: KvdConfig, transport: PeerTransport, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.incarnation = uuid.uuid4().hex
        host = socket.gethostname().split(".")[0] or "host"
        self._agent_base = f"{config.agent_name_prefix}-{host}-{self.incarnation}"
        self.advertise_address = config.advertise_address  # kvd.server.app sets it once it listens
        self.serving = False
        self.started_at = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None  # the one every table belongs to (start())
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvd-work")
        self._background: list[asyncio.Task[None]] = []
        # Calls to this daemon's own addresses (both engines on this node) stay in the process.
        self._transport = LoopbackTransport(transport, self)
        # Built at start (they need the first worker); replaced or rebound by a restart.
        self.memories: Memories | None = None
        self.peers: Peers | None = None
        self.puller: Puller | None = None

        # The tables the parts share.
        self.registry = Registry()
        self.leases = LeaseTable(
            on_admission_over=lambda admission: self.holder.admission_over(admission),
            on_lease_over=lambda lease, how: self.holds.lease_over(lease, how),
            admission_margin_s=config.read_admission_margin_s,
            on_new_deadline=lambda: self.sweeper.wake(),
        )
        self.commits = CommitTracker()
        self.holdchecks = HoldChecks()
        self.transfers = TransferTable()
        self.watches = TransferWatches(self.transfers)  # WatchTransfers streams, by the ids they wait on

        # The parts, each handed the tables they share (kvd.core.context).
        ctx = self.context = CoreContext(
            config,
            metrics,
            self.incarnation,
            self.registry,
            self.leases,
            self.commits,
            self.holdchecks,
            self.transfers,
            self._executor,
            dataplane=lambda: self.dataplane,
            memories=lambda: self._mem,
            loop=lambda: self._loop,
            require_serving=self.require_serving,
            require_dataplane=self.require_dataplane,
        )
        self.sweeper = Sweeper(
            self.leases,
            self.transfers,
            memories=lambda: self.memories,
            puller=lambda: self.puller,
            peers=lambda: self.peers,
        )
        self.engines = Engines(ctx)
        self.holds = Holds(ctx, advertise_address=lambda: self.advertise_address)
        self.holds_ended = self.holds.ended  # LeaseEnd value -> count since start
        self.holder_calls = HolderCalls(config, self._transport, self.holds, lambda: self.advertise_address)
        self.holder = Holder(ctx, agent_name=lambda: self.agent_name)
        self.restarts = Restarts(
            ctx,
            agent_base=self._agent_base,
            on_notifications=self.holder.on_notifications,
            rebind=self._rebind,
            prepare_tables=self.engines.prepare_tables,
            unregister=self.engines.unregister,
            daemon_serving=lambda: self.serving,
            stop_serving=self._stop_serving,
        )
        self.selftest_engine_id = f"kvd-selftest-{self.incarnation[:8]}"
        self.selftest = SelftestScratch(
            self.selftest_engine_id, self.registry, self.engines, self.holds, self.require_serving
        )

    # --- life cycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.metrics.before_collect(self.holds.gauges_for_scrape)
        dataplane = await self.restarts.start()
        config = self.config
        keep_readable_s = (
            config.early_read_window_s + config.read_admission_margin_s if config.early_read_window_s else 0.0
        )
        self.memories = Memories(dataplane, self.metrics, keep_readable_s)
        self.memories.on_quarantined = self.sweeper.wake
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
            self.context,
            dataplane,
            self.peers,
            self._transport,
            self.memories,
            next_registration_id=next_registration_id,
            serving=lambda: self.serving,
            wake_sweeper=self.sweeper.wake,
        )
        self._background = [
            loop.create_task(self.sweeper.run(), name="kvd-sweeper"),
            loop.create_task(self.engines.watch_liveness(), name="kvd-liveness"),
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
        # Registrations under way end first (kvd.core.finishing).
        await self.selftest.finishing.settle(self.config.fence_timeout_s)
        await self.engines.finishing.settle(self.config.fence_timeout_s)
        for rank in list(self.registry):
            await self.engines.unregister(rank, "daemon shutting down")
        await self.holder.followups.settle(self.config.fence_timeout_s)  # the unpins their ends scheduled
        if self.memories is not None:
            await self.memories.finishing.settle(self.config.fence_timeout_s)
        remote_calls = list(self.holder_calls.tasks)
        for task in [*self._background, *remote_calls]:
            task.cancel()
        await asyncio.gather(*self._background, *remote_calls, return_exceptions=True)
        if self.peers is not None:
            await self.peers.drop_all()
        await self._transport.close()
        if self.puller is not None:
            await self.puller.close()
        await self.restarts.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        logger.info("daemon %s stopped", self.incarnation)

    def require_serving(self) -> None:
        if not self.serving:
            raise Unavailable("the daemon is shutting down: retry against its replacement")

    def require_dataplane(self) -> None:
        self.restarts.require_dataplane()

    @property
    def _mem(self) -> Memories:
        if self.memories is None:
            raise Unavailable("the daemon is still starting")
        return self.memories

    def _rebind(self, plane: DataPlane) -> None:
        """A new worker replaced a lost one (Restarts): the parts that hold it directly follow."""
        self._mem.rebind(plane)
        if self.peers is not None:
            self.peers.rebind(plane)
        if self.puller is not None:
            self.puller.rebind(plane)

    def _stop_serving(self) -> None:
        self.serving = False

    # --- the data-plane worker: kvd.core.restarts (health and `fatal` read daemon.restarts) -------------

    @property
    def dataplane(self) -> DataPlane | None:
        return self.restarts.dataplane

    @property
    def agent_name(self) -> str:
        """The NIXL agent's name: a new data-plane worker gets a new one (…-r<N>)."""
        plane = self.restarts.dataplane
        return plane.name if plane is not None else self._agent_base

    # --- EngineService: this node's engines (kvd.core.engines) ---------------------------------------

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
        return await self.engines.register(
            engine_id, spec, regions, placements, require_commits, engine_pid, extra_groups
        )

    async def unregister_engine(self, engine_id: str, tp_rank: int, *, until_let_go: bool = False) -> None:
        await self.engines.unregister_engine(engine_id, tp_rank, until_let_go=until_let_go)

    def attach_stream(self, engine_id: str, tp_rank: int) -> tuple[EngineRank, int]:
        return self.engines.attach_stream(engine_id, tp_rank)

    def detach_stream(self, rank: EngineRank, generation: int) -> None:
        self.engines.detach_stream(rank, generation)

    def commit(self, rank: EngineRank, request_id: str, committed_tokens: int) -> None:
        self.engines.commit(rank, request_id, committed_tokens)

    def post_forward(self, rank: EngineRank, step: int, finished_request_ids: Sequence[str]) -> None:
        self.engines.post_forward(rank, step, finished_request_ids)

    # --- holds and leases: engines, routers, the scheduler stream (kvd.core.holds) -------------------

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
        return self.holds.hold(engine_id, request_id, block_ids, num_tokens, ttl_s, group_block_ids, soft)

    def params_of(self, lease: Lease) -> TransferParams:
        return self.holds.params_of(lease)

    def lookup_held(self, engine_id: str = "", request_id: str = "") -> list[TransferParams]:
        return self.holds.lookup_held(engine_id, request_id)

    def renew_lease(self, lease_id: str, ttl_s: float = 0.0) -> Lease:
        return self.holds.renew_lease(lease_id, ttl_s)

    def release_lease(self, lease_id: str) -> None:
        self.holds.release_lease(lease_id)

    def renew_leases(self, lease_ids: Sequence[str]) -> list[str]:
        return self.holds.renew_leases(lease_ids)

    def release_leases(self, lease_ids: Sequence[str], reason: str) -> int:
        return self.holds.release_leases(lease_ids, reason)

    def scheduler_attached(self, engine_id: str) -> SchedulerChannel:
        return self.holds.scheduler_attached(engine_id)

    def scheduler_detached(self, channel: SchedulerChannel) -> None:
        self.holds.scheduler_detached(channel)

    def remote_leases(self, leases: Sequence[tuple[str, str]], release: bool, reason: str = "") -> None:
        """Leases held elsewhere that this node's engines will read later, or never (HolderCalls)."""
        self.holder_calls.tell(leases, release, reason)

    # --- PeerService: a reader daemon's calls (kvd.core.holder) --------------------------------------

    def handshake_info(self) -> HandshakeInfo:
        return self.holder.handshake_info()

    async def prepare_pull(
        self, request: PrepareRequest, *, reader_address: str = "", reader_incarnation: str = ""
    ) -> PrepareResult:
        return await self.holder.prepare_pull(
            request, reader_address=reader_address, reader_incarnation=reader_incarnation
        )

    async def finish_read(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
        nbytes: int = 0,
    ) -> None:
        await self.holder.finish_read(lease_id, reader_tp_rank, reader_incarnation, reader_transfer_id, nbytes)

    def abandon_pull(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reason: str,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
    ) -> None:
        self.holder.abandon_pull(lease_id, reader_tp_rank, reason, reader_incarnation, reader_transfer_id)

    # --- RouterService / EngineService: this node's engines pull (kvd.core.pulls) --------------------

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

    # --- OperatorService: selftest and status -------------------------------------------------------

    async def selftest_hold(self, size_bytes: int, seed: int) -> tuple[LayoutSpec, TransferParams]:
        return await self.selftest.hold(size_bytes, seed)

    def status(self) -> DaemonStatus:
        return daemon_status(self)
