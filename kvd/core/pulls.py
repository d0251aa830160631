"""The reader side of a pull: handshake, plan, holder's consent, NIXL reads, conversion, fence.

One :class:`Puller` per daemon runs every pull as an asyncio task through the transfer state
machine (planned -> reading -> postprocessing -> done | fencing -> failed | aborted) under its
deadline.

**Fence before failing.** A failed pull's blocks are recomputed by the engine, so the failure
is reported only once no byte of the pull can still land in them (docs/lifetimes.md):

1. every READ the pull posted is final (NIXL said DONE or ERR): reported at once;
2. otherwise, after waiting up to ``fence_timeout_s`` (within the pull's deadline), host memory
   is *re-mapped*: the engine's pages get new addresses in the daemon (new NIXL registration),
   and the old addresses are retired once no admitted remote read uses them, so a late copy
   lands in throw-away pages. Other pulls that were reading into the old mapping then fail too
   (their blocks are recomputed), never DONE;
3. VRAM cannot be re-mapped: the failure waits until NIXL finishes the reads.

The pull pins the engine's mapping and the peer's NIXL agent from first use until its reads
are final or fenced. It tells the holder AbandonPull only when its READs are final: that is the
holder's proof that nothing reads its blocks any more. The proof is delivered: asked again while
the holder cannot be reached (a stopped or cut-off holder, a peer dropped meanwhile), until it
answers or ``peer_idle_s`` passed; a holder that timed the read out meanwhile then lifts the taint
it left on its memory (docs/lifetimes.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from kvd.config import KvdConfig
from kvd.core import notif
from kvd.core.dataplane import DataPlane, Xfer
from kvd.core.events import FinishedRecving, LoadFailed
from kvd.core.local_memory import LocalMemory, Memories, MemoryState
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import (
    Peers,
    PeerSession,
    PeerTransport,
    PrepareRequest,
    PrepareResult,
    RemoteAgent,
    RemoteEngine,
    StaleView,
    unreachable,
)
from kvd.core.registry import EngineRank
from kvd.core.staging import StagingChunk, StagingPool
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.convert_plan import CostModel
from kvd.layout.groups import plan_groups_pull
from kvd.layout.plan import PullPlan, Target, block_geometry
from kvd_client.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    KvdError,
    PeerUnavailable,
    StaleRegistration,
    Unavailable,
    UnknownEngine,
)
from kvd_client.group_blocks import split_groups

logger = logging.getLogger(__name__)

INLINE_PLAN_BLOCKS = 512  # pulls this small are planned on the event loop (well under 1 ms)
HOLDER_PIN_POLL_S = 0.01
PLAN_ATTEMPTS = 3  # plans of one pull when the peer's agent is reloaded between planning and pinning
# An AbandonPull the holder did not answer (unreachable) is asked again after this, then twice as
# long each time up to ABANDON_RETRY_MAX_S, for peer_idle_s at most (Puller._abandon).
ABANDON_RETRY_S = 0.5
ABANDON_RETRY_MAX_S = 30.0


@dataclasses.dataclass(eq=False)
class _PullResources:
    """What one pull holds and must hand back, at the latest, when its reads are final."""

    memory: LocalMemory
    plane: DataPlane  # the worker the pull runs through: its lists and READs are that worker's
    agent: RemoteAgent | None = None
    session: PeerSession | None = None
    # Every READ the pull asked the data plane to post, from the moment it asked: a post runs on
    # the data plane's thread and completes even if the pull is cancelled while waiting for it,
    # so a READ the pull never saw returned is still one whose bytes may land (never "final").
    posts: list[asyncio.Future[Xfer]] = dataclasses.field(default_factory=list)
    staging: StagingChunk | None = None
    # One-off lists (staging), each from the moment its preparation was asked for (see ``posts``).
    one_off_tables: list[asyncio.Future[Any]] = dataclasses.field(default_factory=list)
    conversion: asyncio.Future[None] | None = None  # a conversion writing the engine's blocks

    @property
    def xfers(self) -> list[Xfer]:
        """The READs posted so far (a post that failed before posting anything holds none)."""
        return [p.result() for p in self.posts if p.done() and not p.cancelled() and p.exception() is None]

    @property
    def reads_final(self) -> bool:
        return all(p.done() for p in self.posts) and all(x.final for x in self.xfers)

    async def reads_over(self) -> None:
        """Wait until every read is posted and final (a cancel of this wait leaves them running)."""
        await asyncio.gather(*(asyncio.shield(p) for p in self.posts), return_exceptions=True)
        await asyncio.gather(*(asyncio.shield(x.settled) for x in self.xfers))


class Puller:
    """Executes pulls into this daemon's engines."""

    def __init__(
        self,
        config: KvdConfig,
        metrics: Metrics,
        dataplane: DataPlane,
        peers: Peers,
        transport: PeerTransport,
        memories: Memories,
        executor: concurrent.futures.Executor,
        current_rank: Callable[[EngineRank], EngineRank | None],
        next_registration_id: Callable[[], int],
        serving: Callable[[], bool],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self._dataplane = dataplane
        self._transport = transport
        self._memories = memories
        self._executor = executor
        self._current_rank = current_rank
        self._next_registration_id = next_registration_id
        self._serving = serving
        self._costs = CostModel(config.read_descriptor_cost_s, config.convert_bytes_per_s, config.staging_pool_bytes)
        self._staging: dict[str, StagingPool] = {}
        self._staging_lock = asyncio.Lock()
        # Pull resources whose reads were given up before NIXL finished them: handed back by
        # sweep() once final (a staging chunk or a one-off list must not be reused before).
        self._stale: list[_PullResources] = []
        self._abandons: set[asyncio.Task[None]] = set()  # AbandonPulls waiting for their reads to be final

    async def warm(self, session: PeerSession) -> None:
        """After a handshake, off any pull's path: prepare the whole-block lists of the peer's
        engines (what every same-layout pull reads through). Holds no pin: if the agent is removed
        meanwhile its table cache is closed, and a list finished after that is released at once.
        (The UCX connection was started when the agent's metadata was loaded: NixlAgent.add_remote.)"""
        agent = session.agent
        try:
            for engine in list(session.engines.values()):
                if agent.removed:
                    return
                await agent.table(engine, block_geometry(engine.view, self.config.max_run_blocks), self._executor)
        except Exception as exc:  # noqa: BLE001 - an optimisation only: the first pull prepares what it needs
            logger.debug("warming peer %s: %s", session.address, exc)

    async def close(self) -> None:
        for task in list(self._abandons):  # shutting down: the holders end those admissions at their deadlines
            task.cancel()
        for pool in self._staging.values():
            await pool.close()
        self._staging.clear()

    # --- one pull ---------------------------------------------------------------------------------

    async def run(self, transfer: Transfer, rank: EngineRank, remote: TransferParams) -> None:
        """The pull task: never raises; ends the transfer and tells the engine exactly once."""
        memory = rank.memory
        if not memory.usable:
            lost = memory.state is MemoryState.LOST
            self._report(
                transfer,
                rank,
                remote,
                Unavailable("this daemon's data plane is restarting (its worker was lost): retry")
                if lost
                else Aborted(f"engine {rank.engine_id} rank {rank.tp_rank} is unregistering"),
            )
            return
        self._memories.pin(memory)
        held = _PullResources(memory, plane=self._dataplane)
        fence_s = min(self.config.fence_timeout_s, transfer.deadline_s / 4)
        error: KvdError | None = None
        try:
            async with asyncio.timeout(transfer.deadline_s - fence_s):
                await self._pull(transfer, rank, remote, held)
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
        # From here on the pull only finishes: shield it from a second cancel (shutdown).
        await asyncio.shield(self._finish(transfer, rank, remote, held, error, fence_s))

    async def _finish(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: _PullResources,
        error: KvdError | None,
        fence_s: float,
    ) -> None:
        # A post under way completes on the data plane's thread (it does not wait for bytes):
        # wait for it, so every READ the pull asked for is known before anything is decided.
        await asyncio.gather(*(asyncio.shield(p) for p in held.posts), return_exceptions=True)
        if held.conversion is not None and not held.conversion.done():
            await asyncio.wait([held.conversion])
        if error is None and held.memory.retired:
            error = Aborted(
                f"engine {rank.engine_id} rank {rank.tp_rank} memory was re-mapped during the pull: recompute"
            )
        if error is None and self._current_rank(rank) is not rank:
            error = Aborted(f"engine {rank.engine_id} rank {rank.tp_rank} unregistered during the pull")
        if error is not None and not held.reads_final:
            transfer.advance(TransferState.FENCING)
            try:
                await self._fence(transfer, rank, held, fence_s)
            except Exception:  # a fence that failed must still end the pull: wait the reads out
                logger.exception("pull %s: fencing failed; waiting for its reads to finish", transfer.transfer_id)
                await held.reads_over()
        self._report(transfer, rank, remote, error)
        await self._hand_back(held)
        if error is not None and held.session is not None:  # the holder admitted the read
            # The holder may stop counting this read once nothing of it can touch its blocks: at
            # once when the reads are final, else when they become final (a pull cut off from
            # its memory still has reads in flight; the holder would otherwise wait them out to
            # the admission's deadline and retire its memory as tainted). Also when the peer was
            # dropped meanwhile (unreachable, its READs failed): a holder that comes back, or was
            # only cut off, still keeps the admission or its taint until it hears it.
            self._in_background(
                self._abandon_when_final(held, remote, rank.tp_rank, transfer.transfer_id, error.message)
            )

    async def _fence(self, transfer: Transfer, rank: EngineRank, held: _PullResources, fence_s: float) -> None:
        """Make sure no byte of the pull can still land in the engine's blocks (module docstring)."""
        remaining = max(0.0, transfer.started + transfer.deadline_s - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(fence_s, remaining), 0.001)):
                await held.reads_over()
        if held.reads_final:
            self.metrics.pull_fences.labels("final").inc()
            return
        outcome = await self._cut_off(rank, held.memory)
        if outcome:
            self.metrics.pull_fences.labels(outcome).inc()
            return
        logger.warning(
            "pull %s: %d NIXL reads into %s memory are not finished; the failure waits for them",
            transfer.transfer_id,
            sum(not x.final for x in held.xfers),
            held.memory.mem_type,
        )
        await held.reads_over()
        self.metrics.pull_fences.labels("final").inc()

    async def _cut_off(self, rank: EngineRank, memory: LocalMemory) -> str:
        """Retire ``memory`` so a late copy into it cannot reach the engine; "" if it cannot be.

        A rank still mapped through ``memory`` first gets a new mapping of its pages ("remapped");
        a rank already gone just loses the old one ("quarantined"). Either way the old addresses
        are retired only once no peer reads out of them (their reads would see zeros). One pull
        cuts a mapping off; others fencing on it wait for that one.
        """
        if memory.retired:
            return "remapped"
        if memory.cut_off is not None:
            await asyncio.shield(memory.cut_off)
            return "remapped" if memory.retired else ""
        if not memory.host:
            return ""
        current = self._current_rank(rank)
        mapped = current is not None and current.memory is memory
        if mapped and not self._memories.can_remap(memory):
            return ""
        memory.cut_off = asyncio.get_running_loop().create_future()
        try:
            if mapped:
                fresh = await self._memories.remap(memory, self._next_registration_id())
                if self._current_rank(rank) is rank and rank.memory is memory:
                    rank.memory = fresh
                    logger.warning(
                        "engine %s rank %d: re-mapped its memory (registration %d -> %d) to fence a read "
                        "NIXL did not finish",
                        rank.engine_id,
                        rank.tp_rank,
                        memory.registration_id,
                        fresh.registration_id,
                    )
                else:  # the rank unregistered while the new mapping was registered
                    await self._memories.fence(fresh)
                await self._memories.fence(memory)
            while memory.holder_pins:  # peers admitted to read out of the old mapping: let them finish
                await asyncio.sleep(HOLDER_PIN_POLL_S)
            await self._memories.retire(memory)
        finally:
            memory.cut_off.set_result(None)
        return "remapped" if mapped else "quarantined"

    def _report(self, transfer: Transfer, rank: EngineRank, remote: TransferParams, error: KvdError | None) -> None:
        self.metrics.in_flight.dec()
        direction = "pull"
        if error is None:
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
        state = TransferState.ABORTED if isinstance(error, Aborted) else TransferState.FAILED
        transfer.advance(state, error)
        self.metrics.transfers.labels(remote.daemon_address, direction, state.value.lower()).inc()
        self.metrics.errors.labels("pull", error.code.name).inc()
        rank.post(
            LoadFailed(
                transfer.request_id,
                transfer.transfer_id,
                error.code.name,
                error.message,
                transfer.local_block_ids,
                type(error).__name__,
            )
        )
        logger.warning("pull %s of %s failed: %s", transfer.transfer_id, transfer.request_id, error.message)

    async def _hand_back(self, held: _PullResources) -> None:
        final = held.reads_final
        await self._memories.unpin(held.memory, stale=held.xfers)
        if held.agent is not None and final:
            await self.peers.unpin(held.agent)
            held.agent = None
        if final:
            await self._release_buffers(held)
        else:
            self._stale.append(held)

    async def _release_buffers(self, held: _PullResources) -> None:
        """Hand back the pull's staging chunk and one-off lists (its reads are final).

        The chunk goes back first and whatever the lists' release does: that call waits on the
        worker, which may hang and be declared lost meanwhile (the lists then die with it), and a
        chunk left out of its pool would stay counted in use for good."""
        if held.staging is not None:
            self.metrics.staging_bytes_in_use.dec(held.staging.size)
            held.staging.release()
            held.staging = None
        lists = await asyncio.gather(*(asyncio.shield(f) for f in held.one_off_tables), return_exceptions=True)
        held.one_off_tables.clear()
        try:
            # Through the worker that prepared them: after a restart, ids mean nothing to the new one.
            await held.plane.release_tables([t for t in lists if not isinstance(t, BaseException)])
        except KvdError as error:
            if held.plane.alive:
                raise
            logger.debug("one-off lists went with their lost worker: %s", error.message)

    async def sweep(self) -> None:
        """Hand back what stale pulls held once NIXL finished their reads."""
        for held in list(self._stale):
            if held.reads_final:
                self._stale.remove(held)
                if held.agent is not None:
                    await self.peers.unpin(held.agent)
                    held.agent = None
                await self._release_buffers(held)

    @property
    def stale_pulls(self) -> int:
        return len(self._stale)

    async def _abandon_when_final(
        self,
        held: _PullResources,
        remote: TransferParams,
        reader_rank: int,
        transfer_id: str,
        reason: str,
    ) -> None:
        """AbandonPull once the pull's reads are final, to the holder it read from."""
        if not held.reads_final:
            await held.reads_over()
        await self._abandon(remote, reader_rank, transfer_id, reason)

    def _in_background(self, abandon: Coroutine[Any, Any, None]) -> None:
        """Run an AbandonPull after the pull has ended, kept in ``_abandons`` until it is done."""
        task = asyncio.get_running_loop().create_task(abandon)
        self._abandons.add(task)
        task.add_done_callback(self._abandons.discard)

    async def _abandon(self, remote: TransferParams, reader_rank: int, transfer_id: str, reason: str) -> None:
        """Tell the holder this read is over (nothing of it can still read its blocks).

        Asked again while the holder cannot be reached (stopped, cut off, its stream broken):
        an admission that timed out meanwhile keeps the holder's memory retired until this proof
        arrives. Any answer ends it (an unknown lease too: a restarted holder, or a read that
        ended otherwise); so do ``peer_idle_s`` without one, and shutdown (Puller.close)."""
        give_up = time.monotonic() + self.config.peer_idle_s
        wait = ABANDON_RETRY_S
        while True:
            try:
                await self._transport.abandon_pull(
                    remote.daemon_address,
                    remote.lease_id,
                    reader_rank,
                    transfer_id,
                    reason,
                    self.config.handshake_timeout_s,
                )
                return
            except KvdError as exc:
                if not unreachable(exc) or time.monotonic() + wait > give_up:
                    logger.debug("abandon of lease %s at %s: %s", remote.lease_id, remote.daemon_address, exc.message)
                    return
            await asyncio.sleep(wait)
            wait = min(2 * wait, ABANDON_RETRY_MAX_S)

    # --- planning -----------------------------------------------------------------------------

    async def _plan(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PeerSession, PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Handshake (cached), plan, and have the holder admit the read; re-handshake once if stale."""
        address = remote.daemon_address
        asked_at = time.monotonic()
        session = await self._session(remote)
        while True:
            fresh = session.handshaken_at >= asked_at
            try:
                return session, *await self._plan_with(session, transfer, rank, remote)
            except _StaleHandshake as exc:
                # A cached handshake may describe an engine that has since re-registered (other
                # ranks, other blocks, other memory): handshake again once before believing it.
                if fresh:
                    raise exc.error from None
                asked_at = time.monotonic()
                session = await self.peers.refresh(address, exc.reason)

    async def _session(self, remote: TransferParams) -> PeerSession:
        """The holder's session (handshaking if none is cached), refused if the holder restarted
        since it granted the lease."""
        session = await self.peers.session(remote.daemon_address, remote.daemon_incarnation)
        if remote.daemon_incarnation and session.incarnation != remote.daemon_incarnation:
            raise FailedPrecondition(
                f"the holder daemon at {remote.daemon_address} restarted (incarnation {session.incarnation[:8]}, "
                f"the lease came from {remote.daemon_incarnation[:8]}): its blocks are gone, recompute"
            )
        return session

    async def _plan_with(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Plan against one handshake and have the holder admit the read for it."""
        pull_plan, remote_ranks = await self._plan_layout(session, transfer, rank, remote)
        return pull_plan, remote_ranks, await self._admit(session, transfer, rank, remote, pull_plan, remote_ranks)

    async def _plan_layout(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine]]:
        """Plan the pull against one handshake (_StaleHandshake where that handshake cannot serve it)."""
        remote_ranks = session.engine_ranks(remote.engine_id)
        try:
            if not remote_ranks:
                raise UnknownEngine(f"the daemon at {remote.daemon_address} serves no engine {remote.engine_id!r}")

            remote_groups = split_groups(remote.group_block_ids, remote.group_block_counts, "kv_transfer_params")

            def plan() -> PullPlan:
                return plan_groups_pull(
                    {r: e.groups for r, e in remote_ranks.items()},
                    rank.groups,
                    (remote.block_ids, *remote_groups),
                    (transfer.local_block_ids, *transfer.local_group_block_ids),
                    remote.num_tokens,
                    max_run_blocks=self.config.max_run_blocks,
                    direct_read_min_bytes=self.config.direct_read_min_bytes,
                    costs=self._costs,
                )

            # Planning is vectorised numpy: small pulls plan inline, large ones off the event loop.
            if len(transfer.local_block_ids) <= INLINE_PLAN_BLOCKS:
                pull_plan = plan()
            else:
                pull_plan = await asyncio.get_running_loop().run_in_executor(self._executor, plan)
        except KvdError as exc:
            raise _StaleHandshake("cached layout refused", exc) from exc
        transfer.mark("planned")
        unnamed = [r for r in pull_plan.remote_ranks if not session.agent.names(remote_ranks[r])]
        if unnamed:  # never prepare a list over memory the loaded metadata does not name
            raise _StaleHandshake(
                "metadata does not name the engine's memory",
                PeerUnavailable(
                    f"the NIXL metadata of {remote.daemon_address} does not name the memory of engine "
                    f"{remote.engine_id!r} ranks {unnamed}: retry"
                ),
            )
        return pull_plan, remote_ranks

    async def _admit(
        self,
        session: PeerSession,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        pull_plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        read_id: str = "",
    ) -> PrepareResult:
        """Have the holder admit the read (PreparePull). With ``read_id`` the pull's READs are
        posted beside this call (_pull_beside_admission): the holder checks the registrations
        planned against, and an AbandonPull is left to the pull's end, once its READs are final."""
        holder_spec = remote_ranks[pull_plan.remote_ranks[0]].view.spec
        planned = self._planned_registrations(pull_plan, remote_ranks)
        try:
            request = PrepareRequest(
                lease_id=remote.lease_id,
                engine_id=remote.engine_id,
                block_ids=tuple(remote.block_ids[: holder_spec.blocks_for(remote.num_tokens)]),
                num_tokens=remote.num_tokens,
                reader_tp_rank=rank.tp_rank,
                reader_tp_size=rank.spec.tp_size,
                remote_tp_ranks=tuple(pull_plan.remote_ranks),
                reader_transfer_id=transfer.transfer_id,
                read_timeout_s=max(0.001, transfer.started + transfer.deadline_s - time.monotonic()),
                group_block_ids=self._remote_groups(remote),
                read_id=read_id,
                registration_ids=planned if read_id else (),
            )
            timeout_s = self.config.commit_wait_s + self.config.handshake_timeout_s
            prepared = await self._transport.prepare_pull(remote.daemon_address, request, timeout_s)
        except (UnknownEngine, StaleRegistration) as exc:  # the holder's ranks changed (registered again)
            raise _StaleHandshake("holder ranks changed", exc) from exc
        except KvdError as exc:
            if unreachable(exc):
                await self.peers.drop_if(session, "prepare failed")
            if unreachable(exc) and not read_id:
                # Unanswered: the holder may have run the call (a stopped holder runs it when it
                # resumes) and admitted the read. Tell it the read is over (nothing was posted).
                self._in_background(
                    self._abandon(remote, rank.tp_rank, transfer.transfer_id, "its admission was never answered")
                )
            raise
        except asyncio.CancelledError:
            # The pull was cancelled (or ran out of time) while the holder admitted it. The call is
            # withdrawn, but the holder may have admitted the read just before and its answer is
            # lost: tell it the read is over (this pull posted nothing), so the admission does not
            # wait for its deadline and retire the holder's memory as never proven over. (A pull
            # whose READs were posted beside it tells it at its end, once they are final.)
            if not read_id:
                why = "the pull ended while its admission was asked"
                self._in_background(self._abandon(remote, rank.tp_rank, transfer.transfer_id, why))
            raise
        transfer.mark("prepared")
        if prepared.registration_ids != planned:
            raise _StaleHandshake(
                "stale engine registration",
                FailedPrecondition(
                    f"engine {remote.engine_id!r} at {remote.daemon_address} re-registered during the pull: retry"
                ),
            )
        return prepared

    @staticmethod
    def _remote_groups(remote: TransferParams) -> tuple[tuple[int, ...], ...]:
        return tuple(split_groups(remote.group_block_ids, remote.group_block_counts, "kv_transfer_params"))

    @staticmethod
    def _planned_registrations(pull_plan: PullPlan, remote_ranks: dict[int, RemoteEngine]) -> tuple[int, ...]:
        return tuple(remote_ranks[r].registration_id for r in pull_plan.remote_ranks)

    # --- reading ------------------------------------------------------------------------------

    async def _pull(self, transfer: Transfer, rank: EngineRank, remote: TransferParams, held: _PullResources) -> None:
        if self.config.read_beside_admission and await self._pull_beside_admission(transfer, rank, remote, held):
            return
        for _ in range(PLAN_ATTEMPTS):
            session, plan, remote_ranks, prepared = await self._plan(transfer, rank, remote)
            try:
                held.agent = self.peers.pin(session)
                break
            except StaleView:  # the peer's agent is being reloaded: plan again against the fresh one
                continue
        else:
            raise PeerUnavailable(
                f"the NIXL agent of {remote.daemon_address} was reloaded {PLAN_ATTEMPTS} times during the pull: retry"
            )
        held.session = session
        self._begin_reading(transfer, plan)
        if plan.staging_bytes:
            held.staging = await (await self._staging_pool(held.memory)).acquire(
                plan.staging_bytes, self.config.staging_wait_s
            )
            self.metrics.staging_bytes_in_use.inc(held.staging.size)
        try:
            await self._post_reads(plan, remote_ranks, held, session, prepared.notif_tag)
        except PeerUnavailable:
            await self.peers.drop_if(session, "disconnected")
            raise
        await self._reads_done(transfer, rank, remote, held, session, prepared)
        if plan.postprocess is not None:
            await self._convert(transfer, plan, held)

    async def _pull_beside_admission(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams, held: _PullResources
    ) -> bool:
        """The pull with its READs posted beside the holder's admission, not after it: True once
        its reads are done (and verified); False, having posted nothing or with what it posted
        final and forgotten, where the pull must go the sequential way (_pull).

        Sound because a lease never comes back once ended: the READ reads blocks the lease named
        when the pull began, so an admission granted after the READ was posted proves the blocks
        were the lease's throughout, and any other answer discards the READ's bytes (the pull
        fails, its blocks recomputed, never reported loaded). Only where every holder rank says
        its leased blocks are final when leased (no commit to wait for) and it counts early
        notifications (RemoteEngine.early_reads), and the pull needs no staging. docs/lifetimes.md.
        """
        if not _lease_unexpired(remote):
            return False
        asked_at = time.monotonic()
        session = await self._session(remote)
        if not _names_the_leased_registrations(session, remote):
            # The holder's engine registered again since this handshake: a READ planned on it
            # would read memory the holder may have let go (on RDMA an error that breaks the
            # connection for every pull from it). Handshake again first.
            why = "the lease names registrations the cached handshake does not"
            session = await self.peers.refresh(remote.daemon_address, why, unless_since=asked_at)
            if not _names_the_leased_registrations(session, remote):
                return False
        try:
            plan, remote_ranks = await self._plan_layout(session, transfer, rank, remote)
        except _StaleHandshake:
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
        read_id = transfer.transfer_id
        admission = asyncio.ensure_future(
            self._admit(session, transfer, rank, remote, plan, remote_ranks, read_id=read_id)
        )
        admission.add_done_callback(_retrieved)  # a pull cancelled while posting never awaits it
        posting: KvdError | None = None
        try:
            self._begin_reading(transfer, plan)
            await self._post_reads(plan, remote_ranks, held, session, notif.tag(remote.lease_id, read_id))
        except KvdError as exc:  # the admission's answer decides: a stale view is retried, not failed
            posting = exc
        except BaseException:
            admission.cancel()
            raise
        try:
            prepared = await admission
        except _StaleHandshake as exc:
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
        await self._reads_done(transfer, rank, remote, held, session, prepared)
        return True

    def _begin_reading(self, transfer: Transfer, plan: PullPlan) -> None:
        transfer.descriptors = plan.num_descriptors
        transfer.nbytes = plan.total_bytes
        transfer.direct = plan.direct
        self.metrics.descriptors.observe(plan.num_descriptors)
        if transfer.state is not TransferState.READING:  # a pull that fell back to the sequential way
            transfer.advance(TransferState.READING)

    async def _post_reads(
        self,
        plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        held: _PullResources,
        session: PeerSession,
        notif_tag: str,
    ) -> None:
        """Post the plan's READs (each notifying the holder under ``notif_tag``), every one
        recorded in ``held.posts`` before it is awaited."""
        dataplane = held.plane
        memory = held.memory
        label = f"{session.address} (agent {session.agent_name})"
        parts = len(plan.reads)
        assert held.agent is not None
        for index, group in enumerate(plan.reads):
            holder = remote_ranks[group.remote_rank]
            remote_table = await held.agent.table(holder, group.remote_geometry, self._executor)
            if group.local_target is Target.ENGINE:
                local_table = await memory.table(group.local_geometry, self._executor)
                local_indices = group.local_indices
            else:
                staging = held.staging
                assert staging is not None
                rows = group.local_geometry.rows_for(
                    group.local_indices, [staging.address + group.staging_offset], staging.device_index
                )
                one_off = asyncio.get_running_loop().run_in_executor(
                    self._executor, dataplane.prepare_table, "NIXL_INIT_AGENT", rows, staging.mem_type
                )
                held.one_off_tables.append(one_off)  # released with the pull's buffers, even if cancelled now
                local_table = await asyncio.shield(one_off)
                local_indices = np.arange(rows.shape[0], dtype=np.int32)
            message = notif.encode(notif_tag, index, parts, group.nbytes)
            post = asyncio.ensure_future(
                dataplane.read(
                    local_table, local_indices, remote_table, group.remote_indices, message, label, group.nbytes
                )
            )
            held.posts.append(post)  # before awaiting it: a cancel here must not lose the READ
            xfer = await asyncio.shield(post)
            if xfer.error is not None:  # NIXL refused part of it: the rest is polled to its end
                raise xfer.error

    async def _reads_done(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: _PullResources,
        session: PeerSession,
        prepared: PrepareResult,
    ) -> None:
        """Wait for the posted READs; a soft hold's holder then verifies its blocks again."""
        transfer.mark("posted")
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
                )
                transfer.mark("verified")
        except PeerUnavailable:
            await self.peers.drop_if(session, "disconnected")
            raise

    async def _convert(self, transfer: Transfer, plan: PullPlan, held: _PullResources) -> None:
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
        # _finish waits for it before anything is reported or handed back.
        await asyncio.shield(held.conversion)
        transfer.mark("converted")

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


def _lease_unexpired(remote: TransferParams) -> bool:
    """Whether the lease's expiry (as its params name it, wall clock) is still ahead: past it, the
    holder no longer keeps a gone engine's memory for an early READ (Daemon._keep_for_early_reads)."""
    return not remote.lease_expires_unix_ms or remote.lease_expires_unix_ms > time.time() * 1000


def _names_the_leased_registrations(session: PeerSession, remote: TransferParams) -> bool:
    """Whether the handshake names the registrations the lease was granted on (a lease from an
    older holder names none: the admission alone checks them)."""
    if not remote.registration_ids:
        return True
    ranks = session.engine_ranks(remote.engine_id)
    return tuple(ranks[r].registration_id for r in sorted(ranks)) == tuple(remote.registration_ids)


class _StaleHandshake(Exception):
    """Planning against a cached handshake failed; a fresh handshake may succeed."""

    def __init__(self, reason: str, error: KvdError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
