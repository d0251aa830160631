"""A pull's READs on the reader side (one part of :class:`kvd.core.pulls.Puller`, the reader's
pipeline): posting them, waiting for them, the soft hold's verification, the conversion out of
staging, and the way that posts them beside the holder's admission.

:meth:`PullReads.beside_admission` is the default way (``read_beside_admission``): session,
plan, pin the peer's agent, then the admission (:meth:`PullPlanner.admit`, asked with the READ's
id) and :meth:`PullReads.post_reads` run side by side, and :meth:`PullReads.reads_done` waits for
both. Where it does not apply it posts nothing (or forgets what it posted, final) and the
pipeline goes the sequential way, whose steps are the same methods in order:
:meth:`~PullReads.begin_reading`, :meth:`~PullReads.stage`, :meth:`~PullReads.post_reads`,
:meth:`~PullReads.reads_done`, :meth:`~PullReads.convert`. Every READ is recorded in the pull's
:class:`~kvd.core.pull_resources.PullResources` before it is awaited. Event-loop only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np

from kvd.config import KvdConfig
from kvd.core import notif
from kvd.core.dataplane import DataPlane, Xfer
from kvd.core.local_memory import LocalMemory
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import AskedAdmission, Peers, PeerSession, PeerTransport, PrepareResult, RemoteEngine, StaleView
from kvd.core.pull_plans import PullPlanner, StaleHandshake, lease_unexpired, names_the_leased_registrations
from kvd.core.pull_resources import PullResources
from kvd.core.registry import EngineRank
from kvd.core.staging import StagingPool
from kvd.core.step_reads import StepPart
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.plan import PullPlan, Target
from kvd_client.errors import FailedPrecondition, KvdError, PeerUnavailable


@dataclasses.dataclass(eq=False)
class StartedReads:
    """A pull whose READs were queued as it started (kvd.core.start_posts): what its task goes on
    with. Its engine's mapping and the peer's agent are pinned (``held``), its READs recorded in
    ``held.posts``."""

    held: PullResources
    session: PeerSession
    plan: PullPlan
    remote_ranks: dict[int, RemoteEngine]
    # Its admission, queued as it started too (PullPlanner.ask_admission), or None: asked by its task.
    asked: AskedAdmission | None = None


class PullReads:
    """The READs of the reader's pulls, and the staging pools they convert through (module docstring)."""

    def __init__(
        self,
        config: KvdConfig,
        metrics: Metrics,
        dataplane: DataPlane,
        peers: Peers,
        transport: PeerTransport,
        executor: concurrent.futures.Executor,
        planner: PullPlanner,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self._dataplane = dataplane  # the worker staging pools are opened in (rebind replaces it)
        self._transport = transport
        self._executor = executor
        self._planner = planner
        self._staging: dict[str, StagingPool] = {}
        self._staging_lock = asyncio.Lock()

    async def close(self) -> None:
        for pool in self._staging.values():
            await pool.close()
        self._staging.clear()

    async def beside_admission(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        started: StartedReads | None = None,
    ) -> bool:
        """The pull with its READs posted beside the holder's admission, not after it: True once
        its reads are done (and verified); False, having posted nothing or with what it posted
        final and forgotten, where the pull must go the sequential way (Puller._pull).

        Sound because a lease never comes back once ended: the READ reads blocks the lease named
        when the pull began, so an admission granted after the READ was posted proves the blocks
        were the lease's throughout, and any other answer discards the READ's bytes (the pull
        fails, its blocks recomputed, never reported loaded). Only where every holder rank says
        its leased blocks are final when leased (no commit to wait for) and it counts early
        notifications (RemoteEngine.early_reads), and the pull needs no staging. docs/lifetimes.md.

        ``started``: the READs were queued as the pull started (kvd.core.start_posts), planned
        and pinned as below; only the admission is left to ask.
        """
        if started is not None:
            return await self._admitted(
                transfer,
                rank,
                remote,
                held,
                started.session,
                started.plan,
                started.remote_ranks,
                posted=True,
                asked=started.asked,
            )
        if not lease_unexpired(remote):
            return False
        asked_at = time.monotonic()
        session = await self._planner.session(remote)
        if session.early_read_window_s <= 0:
            return False  # the holder keeps nothing it lets go readable for a READ not admitted yet
        names_them = names_the_leased_registrations(session, remote)
        if not names_them or not session.may_read_early(asked_at):
            # The holder's engine registered again since this handshake, or the handshake is older
            # than the holder keeps memory it lets go readable: a READ planned on it could read
            # unmapped memory (an error on the serving side that breaks the connection for every
            # pull from that holder). Handshake again first.
            why = (
                "the lease names registrations the cached handshake does not"
                if not names_them
                else "the cached handshake is older than the holder's early-read window"
            )
            session = await self.peers.refresh(remote.daemon_address, why, unless_since=asked_at)
            if not names_the_leased_registrations(session, remote) or not session.may_read_early(time.monotonic()):
                return False
        try:
            plan, remote_ranks = await self._planner.plan_layout(session, transfer, rank, remote)
        except StaleHandshake:
            return False  # the sequential way handshakes again
        if plan.staging_bytes or plan.postprocess is not None:
            return False
        if not all(remote_ranks[r].early_reads for r in plan.remote_ranks):
            return False
        try:
            held.agent = self.peers.pin(session)
        except StaleView:
            return False
        held.session = session  # from here a failed pull tells the holder, once its READs are final
        return await self._admitted(transfer, rank, remote, held, session, plan, remote_ranks, posted=False)

    async def _admitted(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        session: PeerSession,
        plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        *,
        posted: bool,
        asked: AskedAdmission | None = None,
    ) -> bool:
        """The admission asked beside the pull's READs (posted here, or already as it started:
        ``posted``; ``asked``: the admission too, only its answer is left to read)."""
        admission = asyncio.ensure_future(
            self._planner.admit(
                session, transfer, rank, remote, plan, remote_ranks, read_id=transfer.transfer_id, asked=asked
            )
        )
        admission.add_done_callback(_retrieved)  # a pull cancelled while posting never awaits it
        posting: KvdError | None = None
        try:
            if posted:  # queued as the pull started
                await self._posted(held)
            else:
                self.begin_reading(transfer, plan)
                await self.post_reads(plan, remote_ranks, held, session, self.notif_tag(remote, transfer))
        except KvdError as exc:  # the admission's answer decides: a stale view is retried, not failed
            posting = exc
        except BaseException:
            admission.cancel()
            if asked is not None:  # a task cancelled before its first step never reads (nor withdraws) it
                asked.withdraw()
            raise
        try:
            prepared = await admission
        except StaleHandshake as exc:
            # The holder admitted nothing (its engine registered again, or its ranks changed):
            # wait out what was posted, forget it, and go the sequential way on a new handshake.
            await held.reads_over()
            held.posts.clear()
            if held.agent is not None:
                await self.peers.unpin(held.agent)
                held.agent = None
            held.session = None
            await self.peers.refresh(remote.daemon_address, exc.reason)
            return False
        if isinstance(posting, PeerUnavailable):
            await self.peers.drop_if(session, "disconnected")
        if posting is not None:
            raise posting
        await self.reads_done(transfer, rank, remote, held, session, prepared)
        return True

    def begin_reading(self, transfer: Transfer, plan: PullPlan) -> None:
        transfer.descriptors = plan.num_descriptors
        transfer.nbytes = plan.total_bytes
        transfer.direct = plan.direct
        self.metrics.descriptors.observe(plan.num_descriptors)
        if transfer.state is not TransferState.READING:  # a pull that fell back to the sequential way
            transfer.advance(TransferState.READING)

    async def post_reads(
        self,
        plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        held: PullResources,
        session: PeerSession,
        notif_tag: str,
    ) -> None:
        """Post the plan's READs, every one recorded in ``held.posts`` before it is awaited.

        Quiet (``held.quiet_reads``) where every holder rank ends reads on a FinishRead and
        ``read_notifications`` is off: no READ carries a notification, so UCX reports it done
        without waiting for the holder's worker, and the read ends with a FinishRead instead (the
        pull's end sends it: Puller._finish). Otherwise each notifies the holder under ``notif_tag``."""
        memory = held.memory
        held.quiet_reads = quiet = self.quiet(plan, remote_ranks)
        assert held.agent is not None
        for index, group in enumerate(plan.reads):
            holder = remote_ranks[group.remote_rank]
            remote_table = await held.agent.table(holder, group.remote_geometry, self._executor)
            if group.local_target is Target.ENGINE:
                local_table = await memory.table(group.local_geometry, self._executor)
                local_indices = None
            else:
                staging = held.staging
                assert staging is not None
                rows = group.local_geometry.rows_for(
                    group.local_indices, [staging.address + group.staging_offset], staging.device_index
                )
                one_off = asyncio.get_running_loop().run_in_executor(
                    self._executor, held.plane.prepare_table, "NIXL_INIT_AGENT", rows, staging.mem_type
                )
                held.one_off_tables.append(one_off)  # released with the pull's buffers, even if cancelled now
                local_table = await asyncio.shield(one_off)
                local_indices = np.arange(rows.shape[0], dtype=np.int32)
            post = self.queue_read(
                held, session, plan, index, holder, local_table, remote_table, notif_tag, quiet, local_indices
            )
            xfer = await asyncio.shield(post)
            if xfer.error is not None:  # NIXL refused part of it: the rest is polled to its end
                raise xfer.error

    def quiet(self, plan: PullPlan, remote_ranks: dict[int, RemoteEngine]) -> bool:
        """Whether the plan's READs carry no notification (every holder rank ends reads on a
        FinishRead, and ``read_notifications`` is off)."""
        return not self.config.read_notifications and all(
            remote_ranks[group.remote_rank].finish_read_ends_reads for group in plan.reads
        )

    @staticmethod
    def notif_tag(remote: TransferParams, transfer: Transfer) -> str:
        """What a notifying READ of the pull names: the lease and the read's id (its transfer's)."""
        return notif.tag(remote.lease_id, transfer.transfer_id)

    def queue_read(
        self,
        held: PullResources,
        session: PeerSession,
        plan: PullPlan,
        index: int,
        holder: RemoteEngine,
        local_table: Any,
        remote_table: Any,
        notif_tag: str,
        quiet: bool,
        local_indices: np.ndarray | None = None,
    ) -> asyncio.Future[Xfer]:
        """Queue the plan's READ ``index`` on the pull's data plane, recorded in ``held.posts``
        before anything can cancel its waiter (its bytes may land whatever happens to the pull).
        ``local_indices``: into a staging chunk's one-off list (None: the engine's own)."""
        group = plan.reads[index]
        parts = len(plan.reads)
        message = b"" if quiet else notif.encode(notif_tag, index, parts, group.nbytes)
        step = None
        if local_indices is None and self.config.step_reads and (quiet or holder.step_notifications):
            # May share one NIXL transfer with the READs of this step's other pulls from the
            # same lists (kvd.core.step_reads); the holder decodes the step's notification.
            notification = None if quiet else notif.read_of(notif_tag, index, parts, group.nbytes)
            assert quiet or notification is not None  # a tag the holder gave or the reader built
            step = StepPart(group.local_geometry, group.remote_geometry, notification)
        post = asyncio.ensure_future(
            held.plane.read(
                local_table,
                group.local_indices if local_indices is None else local_indices,
                remote_table,
                group.remote_indices,
                message,
                f"{session.address} (agent {session.agent_name})",
                group.nbytes,
                step,
            )
        )
        held.posts.append(post)
        return post

    @staticmethod
    async def _posted(held: PullResources) -> None:
        """Wait until the worker answered every READ queued as the pull started; raise the first
        one NIXL refused (the rest is polled to its end)."""
        for post in list(held.posts):
            xfer = await asyncio.shield(post)
            if xfer.error is not None:
                raise xfer.error

    async def reads_done(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        session: PeerSession,
        prepared: PrepareResult,
    ) -> None:
        """Wait for the posted READs; a soft hold's holder then verifies its blocks again. A hard
        hold's quiet read then owes the holder a FinishRead, sent once the pull is reported
        (Puller._finish): the pull does not wait for the holder to hear it, as it did not for a
        notification's delivery, and its message must not delay the report."""
        transfer.mark("posted")
        nbytes = transfer.nbytes if held.quiet_reads else 0  # the holder counts a notified read's bytes itself
        try:
            await held.plane.wait(held.xfers)
            transfer.mark("read")
            if prepared.verify_after_read:
                # A soft hold: the holder's engine checks its blocks still hold the request's KV
                # (they were pinned for the read); until it says so the bytes are not ours.
                await self._transport.finish_read(
                    remote.daemon_address,
                    remote.lease_id,
                    rank.tp_rank,
                    transfer.transfer_id,
                    self.config.hold_check_timeout_s + self.config.handshake_timeout_s,
                    nbytes,
                )
                transfer.mark("verified")
            elif held.quiet_reads:
                held.owes_finish_read = True
        except PeerUnavailable:
            await self.peers.drop_if(session, "disconnected")
            raise

    async def convert(self, transfer: Transfer, plan: PullPlan, held: PullResources) -> None:
        """The layout conversion from staging into the engine's blocks, in the data-plane worker."""
        staging = held.staging
        assert staging is not None and plan.postprocess is not None
        transfer.advance(TransferState.POSTPROCESSING)
        held.conversion = asyncio.ensure_future(
            held.plane.convert(
                plan.postprocess,
                staging.region_id,
                staging.offset,
                staging.size,
                [region.region_id for region in held.memory.regions],
            )
        )
        # A cancel must not stop the wait while the worker still writes the engine's blocks:
        # Puller._finish waits for it before anything is reported or handed back.
        await asyncio.shield(held.conversion)
        transfer.mark("converted")

    async def stage(self, plan: PullPlan, held: PullResources) -> None:
        """A staging chunk for a plan that converts (its READs land there, not in the engine's blocks)."""
        if plan.staging_bytes:
            held.staging = await (await self._staging_pool(held.memory)).acquire(
                plan.staging_bytes, self.config.staging_wait_s
            )
            self.metrics.staging_bytes_in_use.inc(held.staging.size)

    async def _staging_pool(self, memory: LocalMemory) -> StagingPool:
        device = memory.regions[0].device
        async with self._staging_lock:
            pool = self._staging.get(device)
            if pool is None or pool.lost:
                if self.config.staging_pool_bytes <= 0:
                    raise FailedPrecondition("this pull needs a layout conversion but staging_pool_bytes is 0")
                pool = await StagingPool.open(self._dataplane, self.config.staging_pool_bytes, device)
                self._staging[device] = pool
        return pool

    def rebind(self, dataplane: DataPlane) -> None:
        """A new worker replaced a lost one: its staging buffers are gone with it."""
        self._dataplane = dataplane
        for pool in self._staging.values():
            pool.lost = True
        self._staging.clear()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
