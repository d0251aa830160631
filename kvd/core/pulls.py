"""The reader side of a pull: handshake, plan, holder's consent, NIXL reads, conversion.

One :class:`Puller` per daemon runs every pull as an asyncio task through the transfer state
machine (planned -> reading -> postprocessing -> done | failed | aborted) under its deadline.
A failed pull never reports blocks loaded: the engine is told LoadFailed with the blocks to
recompute.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvd.config import KvdConfig
from kvd.core.dataplane import LOCAL, DataPlane, XferState
from kvd.core.events import FinishedRecving, LoadFailed
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import Peers, PeerSession, PeerTransport, PrepareResult, RemoteEngine
from kvd.core.registry import EngineRank
from kvd.core.staging import StagingChunk, StagingPool
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.plan import PullPlan, Target, plan_pull
from kvd_client.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    KvdError,
    PeerUnavailable,
    UnknownEngine,
)

logger = logging.getLogger(__name__)

INLINE_PLAN_BLOCKS = 512  # pulls this small are planned on the event loop (well under 1 ms)
SPIN_S = 0.002  # poll without sleeping this long (plus the bytes' time at SPIN_BYTES_PER_S), then every ms
SPIN_BYTES_PER_S = 2e9


class Puller:
    """Executes pulls into this daemon's engines."""

    def __init__(
        self,
        config: KvdConfig,
        metrics: Metrics,
        dataplane: DataPlane,
        peers: Peers,
        transport: PeerTransport,
        executor: concurrent.futures.Executor,
        is_registered: Callable[[EngineRank], bool],
        serving: Callable[[], bool],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self._dataplane = dataplane
        self._transport = transport
        self._executor = executor
        self._is_registered = is_registered
        self._serving = serving
        self._staging: dict[str, StagingPool] = {}
        self._cuda_streams: dict[int, Any] = {}  # device index -> the daemon's conversion stream

    def close(self) -> None:
        for pool in self._staging.values():
            pool.close()
        self._staging.clear()

    async def run(self, transfer: Transfer, rank: EngineRank, remote: TransferParams) -> None:
        error: KvdError | None = None
        try:
            async with asyncio.timeout(transfer.deadline_s):
                await self._pull(transfer, rank, remote)
        except TimeoutError:
            error = DeadlineExceeded(
                f"pull of request {transfer.request_id!r} from {remote.daemon_address} did not finish within "
                f"{transfer.deadline_s}s (state {transfer.state.value})"
            )
        except asyncio.CancelledError as exc:
            why = str(exc.args[0]) if exc.args else ("daemon shutting down" if not self._serving() else "cancelled")
            error = Aborted(f"pull of request {transfer.request_id!r} from {remote.daemon_address} aborted: {why}")
        except KvdError as exc:
            error = exc
        except Exception:  # a bug: the engine must still learn its blocks are not loaded
            logger.exception("pull %s failed unexpectedly", transfer.transfer_id)
            error = Internal("the pull failed on an internal error; see the daemon's log")
        finally:
            self.metrics.in_flight.dec()
        direction = "pull"
        if error is None and self._is_registered(rank):
            transfer.advance(TransferState.DONE)
            rank.post(FinishedRecving(transfer.request_id, transfer.transfer_id))
            self.metrics.transfers.labels(remote.daemon_address, direction, "done").inc()
            self.metrics.transfer_bytes.labels(remote.daemon_address, direction).inc(transfer.nbytes)
            self.metrics.transfer_seconds.labels(direction).observe(transfer.elapsed_s)
            logger.debug(
                "pull %s done: %d bytes, %d descriptors, %.2f ms, phases %s",
                transfer.transfer_id,
                transfer.nbytes,
                transfer.descriptors,
                transfer.elapsed_s * 1e3,
                {k: round(v * 1e3, 3) for k, v in transfer.phases.items()},
            )
            return
        if error is None:
            error = Aborted(f"engine {rank.engine_id} rank {rank.tp_rank} unregistered during the pull")
        state = TransferState.ABORTED if isinstance(error, Aborted) else TransferState.FAILED
        transfer.advance(state, error)
        self.metrics.transfers.labels(remote.daemon_address, direction, state.value.lower()).inc()
        self.metrics.errors.labels("pull", error.code.name).inc()
        rank.post(
            LoadFailed(transfer.request_id, transfer.transfer_id, error.code.name, error.message, transfer.local_block_ids)
        )
        logger.warning("pull %s of %s failed: %s", transfer.transfer_id, transfer.request_id, error.message)
        if self.peers is not None and self.peers.cached(remote.daemon_address) is not None:
            asyncio.get_running_loop().create_task(self._abandon(remote, rank.tp_rank, error.message))

    async def _abandon(self, remote: TransferParams, reader_rank: int, reason: str) -> None:
        try:
            await self._transport.abandon_pull(
                remote.daemon_address, remote.lease_id, reader_rank, reason, self.config.handshake_timeout_s
            )
        except KvdError as exc:  # best effort: the lease expires on its own
            logger.debug("abandon of lease %s at %s: %s", remote.lease_id, remote.daemon_address, exc.message)

    async def _plan(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PeerSession, PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Handshake (cached), plan, and have the holder validate the lease; re-handshake once if stale."""
        address = remote.daemon_address
        asked_at = time.monotonic()
        session = await self.peers.session(address, remote.daemon_incarnation)
        if remote.daemon_incarnation and session.incarnation != remote.daemon_incarnation:
            raise FailedPrecondition(
                f"the holder daemon at {address} restarted (incarnation {session.incarnation[:8]}, the lease came "
                f"from {remote.daemon_incarnation[:8]}): its blocks are gone, recompute"
            )
        while True:
            fresh = session.handshaken_at >= asked_at
            try:
                return session, *await self._plan_with(session, transfer, rank, remote)
            except _StaleHandshake as exc:
                # A cached handshake may describe an engine that has since re-registered (other
                # blocks, other memory): handshake again once before believing the error.
                if fresh:
                    raise exc.error from None
                reason = exc.reason
                asked_at = time.monotonic()
                session = await self.peers.refresh(address, reason)

    async def _plan_with(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Plan against one handshake and have the holder validate the lease for it."""
        remote_ranks = session.engine_ranks(remote.engine_id)
        try:
            if not remote_ranks:
                raise UnknownEngine(f"the daemon at {remote.daemon_address} serves no engine {remote.engine_id!r}")

            def plan() -> PullPlan:
                return plan_pull(
                    {r: e.view for r, e in remote_ranks.items()},
                    rank.view,
                    remote.block_ids,
                    transfer.local_block_ids,
                    remote.num_tokens,
                    max_run_blocks=self.config.max_run_blocks,
                    direct_read_min_bytes=self.config.direct_read_min_bytes,
                )

            # Planning is vectorised numpy: small pulls plan inline, large ones off the event loop.
            if len(transfer.local_block_ids) <= INLINE_PLAN_BLOCKS:
                pull_plan = plan()
            else:
                pull_plan = await asyncio.get_running_loop().run_in_executor(self._executor, plan)
        except KvdError as exc:
            raise _StaleHandshake("cached layout refused", exc) from exc
        transfer.mark("planned")
        holder_spec = remote_ranks[pull_plan.remote_ranks[0]].view.spec
        prepared = await self._transport.prepare_pull(
            remote.daemon_address,
            lease_id=remote.lease_id,
            engine_id=remote.engine_id,
            block_ids=tuple(remote.block_ids[: holder_spec.blocks_for(remote.num_tokens)]),
            num_tokens=remote.num_tokens,
            reader_tp_rank=rank.tp_rank,
            reader_tp_size=rank.spec.tp_size,
            remote_tp_ranks=pull_plan.remote_ranks,
            timeout_s=self.config.commit_wait_s + self.config.handshake_timeout_s,
        )
        transfer.mark("prepared")
        if prepared.registration_ids != tuple(remote_ranks[r].registration_id for r in pull_plan.remote_ranks):
            raise _StaleHandshake(
                "stale engine registration",
                FailedPrecondition(f"engine {remote.engine_id!r} at {remote.daemon_address} re-registered during the pull: retry"),
            )
        return pull_plan, remote_ranks, prepared

    async def _pull(self, transfer: Transfer, rank: EngineRank, remote: TransferParams) -> None:
        session, plan, remote_ranks, prepared = await self._plan(transfer, rank, remote)
        transfer.descriptors = plan.num_descriptors
        transfer.nbytes = plan.total_bytes
        transfer.direct = plan.direct
        self.metrics.descriptors.observe(plan.num_descriptors)
        transfer.advance(TransferState.READING)
        dataplane = self._dataplane
        loop = asyncio.get_running_loop()
        staging: StagingChunk | None = None
        handles: list[Any] = []
        one_off: list[Any] = []
        try:
            if plan.staging_bytes:
                staging = await self._staging_pool(rank).acquire(plan.staging_bytes, self.config.staging_wait_s)
                self.metrics.staging_bytes_in_use.inc(staging.size)
            parts = len(plan.reads)
            for index, group in enumerate(plan.reads):
                holder = remote_ranks[group.remote_rank]
                remote_table = await self._table(
                    ("remote", session.agent_name, holder.registration_id),
                    session.agent_name,
                    group.remote_geometry,
                    holder.region_addresses,
                    holder.device_index,
                    holder.mem_type,
                )
                if group.local_target is Target.ENGINE:
                    local_table = await self._table(
                        ("local", rank.registration_id),
                        LOCAL,
                        group.local_geometry,
                        rank.region_addresses,
                        rank.device_index,
                        rank.mem_type,
                    )
                    local_indices = group.local_indices
                else:
                    assert staging is not None
                    rows = group.local_geometry.rows_for(group.local_indices, [staging.address], staging.device_index)
                    local_table = dataplane.one_off_table(rows, staging.mem_type)
                    one_off.append(local_table)
                    local_indices = np.arange(rows.shape[0], dtype=np.int32)
                notif = f"{prepared.notif_tag}|{index}|{parts}|{group.nbytes}".encode()
                handles.append(
                    dataplane.read(local_table, local_indices, remote_table, group.remote_indices, notif, _peer_label(session))
                )
            transfer.mark("posted")
            await self._wait_reads(handles, session, plan.total_bytes)
            transfer.mark("read")
            if plan.postprocess is not None:
                assert staging is not None
                transfer.advance(TransferState.POSTPROCESSING)
                engine_regions = [region.tensor for region in rank.regions]
                await loop.run_in_executor(self._executor, self._postprocess, plan, staging, engine_regions)
                transfer.mark("converted")
        except PeerUnavailable:
            self.peers.drop(session.address, "disconnected")
            raise
        finally:
            for handle in handles:
                dataplane.release(handle)
            for table in one_off:
                table.release()
            if staging is not None:
                self.metrics.staging_bytes_in_use.dec(staging.size)
                staging.release()

    async def _table(
        self, owner: tuple[Any, ...], agent: str, geometry: Any, addresses: Sequence[int], device: int, mem_type: str
    ) -> Any:
        """A prepared table: from the cache, or prepared in the thread pool (large tables take time)."""
        cached = self._dataplane.cached_table(owner, geometry)
        if cached is not None:
            return cached
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._dataplane.table, owner, agent, geometry, addresses, device, mem_type
        )

    async def _wait_reads(self, handles: list[Any], session: PeerSession, nbytes: int) -> None:
        """Wait for every read, polling NIXL (which is what moves the bytes: with no busy progress
        thread, UCX copies inside these polls), without oversleeping small reads.

        asyncio cannot sleep less than a millisecond (epoll), so: yield-and-poll (``sleep(0)``)
        for about as long as the bytes should take, then poll every millisecond.
        """
        dataplane = self._dataplane
        pending = list(handles)
        spin_until = time.monotonic() + SPIN_S + nbytes / SPIN_BYTES_PER_S
        while pending:
            still = []
            for handle in pending:
                state = dataplane.state(handle, _peer_label(session))
                if state is XferState.ERROR:
                    raise PeerUnavailable(
                        f"NIXL read from peer {session.address} (agent {session.agent_name}) failed: peer gone?"
                    )
                if state is XferState.IN_PROGRESS:
                    still.append(handle)
            pending = still
            if pending:
                await asyncio.sleep(0 if time.monotonic() < spin_until else 0.001)

    def _postprocess(self, plan: PullPlan, staging: StagingChunk, engine_regions: list[Any]) -> None:
        """Run the plan's conversion (worker thread). On a GPU: on a daemon-owned stream, waited for
        before the blocks are reported loaded, so the engine's own streams are never blocked."""
        import torch  # noqa: PLC0415

        assert plan.postprocess is not None
        device = staging.tensor.device
        if device.type != "cuda":
            plan.postprocess.run(staging.tensor, engine_regions)
            return
        stream = self._cuda_streams.get(device.index or 0)
        if stream is None:
            stream = self._cuda_streams.setdefault(device.index or 0, torch.cuda.Stream(device=device))
        with torch.cuda.stream(stream):
            plan.postprocess.run(staging.tensor, engine_regions)
        stream.synchronize()

    def _staging_pool(self, rank: EngineRank) -> StagingPool:
        import torch  # noqa: PLC0415

        device = rank.regions[0].tensor.device
        key = str(device)
        pool = self._staging.get(key)
        if pool is None:
            if self.config.staging_pool_bytes <= 0:
                raise FailedPrecondition("this pull needs a layout conversion but staging_pool_bytes is 0")
            pool = StagingPool(self._dataplane, self.config.staging_pool_bytes, torch.device(device))
            self._staging[key] = pool
        return pool


class _StaleHandshake(Exception):
    """Planning against a cached handshake failed; a fresh handshake may succeed."""

    def __init__(self, reason: str, error: KvdError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def _peer_label(session: PeerSession) -> str:
    return f"{session.address} (agent {session.agent_name})"
