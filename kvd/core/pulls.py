"""The reader side's pipeline: a pull from StartPulls to the engine's completion.

One :class:`Puller` per daemon (:class:`kvd.core.daemon.Daemon` composes it and forwards
StartPull(s) and CancelTransfer to it). A pull takes these hops, each a method named here or of
the parts it uses, in this order:

1. :meth:`Puller.start_pulls` / :meth:`~Puller.start_order` / :meth:`~Puller.start_pull`:
   check the order, answer a repeat with the pull it repeats (:meth:`~Puller._repeated_pull`),
   create the :class:`~kvd.core.transfers.Transfer` and its task;
2. :meth:`Puller.run` (the task): pin the engine's mapping (:class:`PullResources`), run
   :meth:`~Puller._pull` under the pull's deadline;
3. :meth:`Puller._pull`: the READs beside the admission (:meth:`PullReads.beside_admission`),
   else the sequential way: :meth:`PullPlanner.plan` (handshake, the planner
   :func:`kvd.layout.groups.plan_groups_pull`, PreparePull), pin the peer's agent,
   :meth:`PullReads.begin_reading`, :meth:`~PullReads.stage`, :meth:`~PullReads.post_reads`,
   :meth:`~PullReads.reads_done` (the soft hold's FinishRead), :meth:`~PullReads.convert`;
4. :meth:`Puller._finish`: wait for every post and conversion, fence a failed pull's reads
   (:meth:`PullEnding.fence`), then :meth:`~Puller._report`: the transfer's final state and the
   engine's event (``FinishedRecving`` or ``LoadFailed``, on its engine stream), exactly once;
5. :meth:`PullEnding.hand_back`, and for a failed pull whose read the holder admitted,
   AbandonPull once its READs are final (:meth:`PullEnding.abandon_when_final`).

The transfer's state machine: planned -> reading -> postprocessing -> done | fencing -> failed |
aborted (:mod:`kvd.core.transfers`). What a pull pins and when it lets go: docs/lifetimes.md and
:mod:`kvd.core.pull_resources`. Event-loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

from kvd.core.context import CoreContext
from kvd.core.dataplane import DataPlane
from kvd.core.events import FinishedRecving, LoadFailed
from kvd.core.local_memory import Memories, MemoryState
from kvd.core.params import TransferParams
from kvd.core.peers import Peers, PeerSession, PeerTransport, StaleView
from kvd.core.pull_checks import check_order
from kvd.core.pull_plans import PullPlanner
from kvd.core.pull_reads import PullReads, StartedReads
from kvd.core.pull_resources import PullEnding, PullResources
from kvd.core.registry import EngineRank
from kvd.core.start_posts import StartPosts, step_flush_points
from kvd.core.transfers import RequestKey, Transfer, TransferState
from kvd.layout.plan import block_geometry
from kvd_client.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    KvdError,
    PeerUnavailable,
    Unavailable,
)

logger = logging.getLogger(__name__)

PLAN_ATTEMPTS = 3  # plans of one pull when the peer's agent is reloaded between planning and pinning
MAX_PULLS_PER_CALL = 1024
"""Most pulls one StartPulls may start: an engine step loads at most a few hundred requests, and a
bound keeps one call's work (and its answer) small next to the event loop's other callers."""


@dataclasses.dataclass(frozen=True)
class PullOrder:
    """One pull of a batch (StartPulls): the arguments of :meth:`Puller.start_pull`."""

    engine_id: str
    tp_rank: int
    request_id: str
    local_block_ids: Sequence[int]
    remote: TransferParams
    deadline_s: float = 0.0
    local_group_block_ids: Sequence[Sequence[int]] = ()


class Puller:
    """Executes pulls into this daemon's engines (module docstring)."""

    def __init__(
        self,
        ctx: CoreContext,
        dataplane: DataPlane,
        peers: Peers,
        transport: PeerTransport,
        memories: Memories,
        *,
        next_registration_id: Callable[[], int],
        serving: Callable[[], bool],
        wake_sweeper: Callable[[], None],
    ) -> None:
        self.config = config = ctx.config
        self.metrics = metrics = ctx.metrics
        self.peers = peers
        self._transport = transport  # its flush sends a step's admissions (kvd.core.start_posts)
        self.registry = registry = ctx.registry
        self.transfers = ctx.transfers
        self._dataplane = dataplane  # the worker new pulls run through (rebind replaces it)
        self._memories = memories
        self._executor = executor = ctx.executor
        self._serving = serving
        self._require_serving = ctx.require_serving
        self._wake_sweeper = wake_sweeper  # sweeps every SWEEP_S while pulls are in flight (stale reads)
        self.ending = PullEnding(config, metrics, peers, transport, memories, registry.current, next_registration_id)
        self.planner = PullPlanner(config, peers, transport, executor, self._abandon_later)
        self.reads = PullReads(config, metrics, dataplane, peers, transport, executor, self.planner)
        self.start_posts = StartPosts(config, peers, self.planner, self.reads, memories)

    # --- 1. StartPulls: a pull starts ------------------------------------------------------------

    def start_pulls(self, orders: Sequence[PullOrder | KvdError]) -> list[Transfer | KvdError]:
        """Start each pull of a batch on its own, as :meth:`start_pull` would: one result per order,
        in order, a Transfer or the error that pull failed with (it then changed nothing).

        An order may already be an error (the edge could not read that item): it is its own result,
        so results keep the caller's indices. Only a batch over :data:`MAX_PULLS_PER_CALL` or a
        daemon not serving fails the whole call (nothing starts).
        """
        if len(orders) > MAX_PULLS_PER_CALL:
            raise InvalidArgument(
                f"at most {MAX_PULLS_PER_CALL} pulls start together (one StartPulls, or one stream message), "
                f"got {len(orders)}: split the batch"
            )
        self._require_serving()
        results: list[Transfer | KvdError] = []
        flush_points = step_flush_points(len(orders))
        try:
            for index, order in enumerate(orders):
                if index in flush_points:  # the READs queued so far leave now (kvd.core.start_posts)
                    self._dataplane.flush_reads()
                if isinstance(order, KvdError):
                    results.append(order)
                    continue
                try:
                    results.append(self.start_order(order))
                except KvdError as exc:
                    results.append(exc)
                except Exception:  # a bug in one item must not fail its neighbours
                    logger.exception("internal error starting pull %r of a batch", order.request_id)
                    results.append(Internal(f"internal error starting pull {order.request_id!r}; see the daemon's log"))
        finally:
            # The rest of the step's READs (those queued since its last send) go to the worker
            # now, then its admissions to their holders, one message each, before any of its
            # tasks runs (kvd.core.start_posts).
            self._dataplane.flush_reads()
            self._transport.flush()
        return results

    def start_order(self, order: PullOrder) -> Transfer:
        """:meth:`start_pull` with its arguments in one PullOrder (how the server edge reads them)."""
        return self.start_pull(
            order.engine_id,
            order.tp_rank,
            order.request_id,
            order.local_block_ids,
            order.remote,
            order.deadline_s,
            order.local_group_block_ids,
        )

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
        """Start pulling ``remote`` into the local rank's blocks; returns at once (see watch).

        ``local_group_block_ids``: a hybrid model's local block ids of the groups after group 0.
        """
        self._require_serving()
        rank = self.registry.get(engine_id, tp_rank)
        check_order(rank, remote, local_block_ids, local_group_block_ids, deadline_s)
        request_id = request_id or remote.request_id
        blocks = tuple(local_block_ids)
        group_blocks = tuple(tuple(int(b) for b in ids) for ids in local_group_block_ids)
        held = dataclasses.replace(remote, lease_expires_unix_ms=0)  # a renewal between retries changes it
        repeated = self._repeated_pull((engine_id, tp_rank, request_id), blocks, group_blocks, held)
        if repeated is not None:
            return repeated
        self._wake_sweeper()
        transfer = self.transfers.new(
            request_id=request_id,
            engine_id=engine_id,
            tp_rank=tp_rank,
            peer_address=remote.daemon_address,
            local_block_ids=blocks,
            deadline_s=deadline_s or self.config.transfer_deadline_s,
            local_group_block_ids=group_blocks,
            remote=held,
        )
        self.metrics.in_flight.inc()
        started = self.start_posts.post(transfer, rank, remote, self._dataplane)
        transfer.task = task = asyncio.get_running_loop().create_task(self.run(transfer, rank, remote, started))
        task.add_done_callback(functools.partial(self._never_ran, transfer, rank, remote, started))
        return transfer

    def _never_ran(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        started: StartedReads | None,
        task: asyncio.Task[None],
    ) -> None:
        """A pull whose task was cancelled before its first step (a cancel in the very turn it
        started): asyncio drops a coroutine that never began, so the pull's end is run here, as
        its own cancel would have run it (its READs may already be queued: kvd.core.start_posts)."""
        if transfer.began or not task.cancelled():
            return
        error = Aborted(f"pull of request {transfer.request_id!r} from {remote.daemon_address} aborted before it began")
        if started is not None and started.asked is not None:
            started.asked.withdraw()  # the holder may admit it all the same: the pull's end tells it
        if started is None:
            self._report(transfer, rank, remote, error)
            return
        fence_s = min(self.config.fence_timeout_s, transfer.deadline_s / 4)
        # The pull's task from now on: what shutdown and an unregistration wait for, or cancel.
        transfer.task = asyncio.get_running_loop().create_task(
            self._finish_whole(transfer, rank, remote, started.held, error, fence_s)
        )

    def _repeated_pull(
        self,
        key: RequestKey,
        local_block_ids: tuple[int, ...],
        local_group_block_ids: tuple[tuple[int, ...], ...],
        remote: TransferParams,
    ) -> Transfer | None:
        """The pull a StartPull repeats, if it repeats one; AlreadyExists if it collides with one.

        A caller whose StartPull(s) failed without an answer (a deadline, a dropped connection, a
        cancel while the daemon answered) cannot know whether its pull started, and retries. A
        second pull of the same request would have the holder refuse it (one reader per lease
        and rank) or find the lease ended by the first read, and the engine would then hear of
        one request both that its load failed and that it finished. So a pull asked again, the
        same (local blocks, remote lease) for the same engine, rank and request, is answered with
        the transfer already started, running or DONE. A different pull of a request whose pull
        is still running fails ALREADY_EXISTS and changes nothing; once that pull has ended, or
        if it FAILED or was ABORTED, a new pull starts (the retry of a failure).
        """
        if not key[2]:
            return None
        previous = self.transfers.latest_pull(key)
        if previous is None or previous.state in (TransferState.FAILED, TransferState.ABORTED):
            return None
        asked = (local_block_ids, local_group_block_ids, remote)
        if (previous.local_block_ids, previous.local_group_block_ids, previous.remote) == asked:
            logger.info(
                "StartPull of request %r into %r rank %d repeats transfer %s (%s): answered with it",
                key[2], key[0], key[1], previous.transfer_id, previous.state.value,
            )  # fmt: skip
            return previous
        if previous.state.final:
            return None
        raise AlreadyExists(
            f"a pull of request {key[2]!r} into engine {key[0]!r} rank {key[1]} is already in flight (transfer "
            f"{previous.transfer_id}) with other local blocks or another lease: wait for it to end, or "
            "CancelTransfer it, before starting another"
        )

    def cancel_transfer(self, transfer_id: str) -> Transfer:
        """CancelTransfer: the pull's task is cancelled; it ends ABORTED once fenced (:meth:`run`)."""
        transfer = self.transfers.get(transfer_id)
        if transfer.task is not None and not transfer.state.final:
            transfer.task.cancel("cancelled by a caller")
        return transfer

    # --- 2-5. a pull runs, ends, is reported -----------------------------------------------------

    async def run(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams, started: StartedReads | None = None
    ) -> None:
        """The pull task: never raises; ends the transfer and tells the engine exactly once.
        ``started``: its READs were queued as it started (kvd.core.start_posts)."""
        transfer.began = True
        if started is not None:
            held = started.held
        else:
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
            held = PullResources(memory, plane=self._dataplane, posts=transfer.posts)
        fence_s = min(self.config.fence_timeout_s, transfer.deadline_s / 4)
        error: KvdError | None = None
        try:
            async with asyncio.timeout(transfer.deadline_s - fence_s):
                await self._pull(transfer, rank, remote, held, started)
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
        await self._finish_whole(transfer, rank, remote, held, error, fence_s)

    async def _finish_whole(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        error: KvdError | None,
        fence_s: float,
    ) -> None:
        """From here on the pull only finishes: a second cancel (an unregister) does not stop it,
        and the task ends only once the pull has (its waiters see it final). At shutdown a cancel
        ends the wait (the finish goes on, bounded by the worker's stop)."""
        finishing = asyncio.ensure_future(self._finish(transfer, rank, remote, held, error, fence_s))
        while not finishing.done():
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not self._serving() or current is None:
                    raise
                current.uncancel()
        if not finishing.cancelled() and finishing.exception() is not None:
            logger.error("pull %s did not finish cleanly", transfer.transfer_id, exc_info=finishing.exception())

    async def _pull(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        started: StartedReads | None,
    ) -> None:
        if (started is not None or self.config.read_beside_admission) and await self.reads.beside_admission(
            transfer, rank, remote, held, started
        ):
            return
        for _ in range(PLAN_ATTEMPTS):
            session, plan, remote_ranks, prepared = await self.planner.plan(transfer, rank, remote)
            try:
                held.agent = self.peers.pin(session)
                break
            except StaleView:  # the peer's agent is being reloaded: plan again against the fresh one
                continue
            except KvdError as exc:
                # The peer was dropped (our worker replaced, say) after the holder admitted the read:
                # nothing was posted, so the holder is told at once. Untold, it waited out the
                # admission and retired its memory as never proven over (the fleet's quarantine leak).
                self._abandon_later(remote, rank.tp_rank, transfer.transfer_id, exc.message)
                raise
        else:
            raise PeerUnavailable(
                f"the NIXL agent of {remote.daemon_address} was reloaded {PLAN_ATTEMPTS} times during the pull: retry"
            )
        held.session = session
        self.reads.begin_reading(transfer, plan)
        await self.reads.stage(plan, held)
        try:
            await self.reads.post_reads(plan, remote_ranks, held, session, prepared.notif_tag)
        except PeerUnavailable:
            await self.peers.drop_if(session, "disconnected")
            raise
        await self.reads.reads_done(transfer, rank, remote, held, session, prepared)
        if plan.postprocess is not None:
            await self.reads.convert(transfer, plan, held)

    async def _finish(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        held: PullResources,
        error: KvdError | None,
        fence_s: float,
    ) -> None:
        # A post under way completes on the data plane's thread (it does not wait for bytes):
        # wait for it, so every READ the pull asked for is known before anything is decided.
        if not all(post.done() for post in held.posts):  # (gathering done ones costs loop turns)
            await asyncio.gather(*(asyncio.shield(p) for p in held.posts), return_exceptions=True)
        if held.conversion is not None and not held.conversion.done():
            await asyncio.wait([held.conversion])
        if error is None and held.memory.retired:
            error = Aborted(
                f"engine {rank.engine_id} rank {rank.tp_rank} memory was re-mapped during the pull: recompute"
            )
        if error is None and self.registry.current(rank) is not rank:
            error = Aborted(f"engine {rank.engine_id} rank {rank.tp_rank} unregistered during the pull")
        if error is not None and not held.reads_final:
            transfer.advance(TransferState.FENCING)
            try:
                await self.ending.fence(transfer, rank, held, fence_s)
            except Exception:  # a fence that failed must still end the pull: wait the reads out
                logger.exception("pull %s: fencing failed; waiting for its reads to finish", transfer.transfer_id)
                await held.reads_over()
        self._report(transfer, rank, remote, error)
        if error is None and held.owes_finish_read:  # after the report: its message must not delay it
            self.ending.finish_read_later(remote, rank.tp_rank, transfer.transfer_id, transfer.nbytes)
        await self.ending.hand_back(held)
        if error is not None and held.session is not None:  # the holder admitted the read
            # The holder may stop counting this read once nothing of it can touch its blocks: at
            # once when the reads are final, else when they become final (a pull cut off from
            # its memory still has reads in flight; the holder would otherwise wait them out to
            # the admission's deadline and retire its memory as tainted). Also when the peer was
            # dropped meanwhile (unreachable, its READs failed): a holder that comes back, or was
            # only cut off, still keeps the admission or its taint until it hears it.
            self.ending.in_background(
                self.ending.abandon_when_final(held, remote, rank.tp_rank, transfer.transfer_id, error.message)
            )

    def _report(self, transfer: Transfer, rank: EngineRank, remote: TransferParams, error: KvdError | None) -> None:
        self.metrics.in_flight.dec()
        direction = "pull"
        if error is None:
            transfer.advance(TransferState.DONE)
            rank.post(FinishedRecving(transfer.request_id, transfer.transfer_id))
            self.metrics.transfers.labels(remote.daemon_address, direction, "done").inc()
            self.metrics.transfer_bytes.labels(remote.daemon_address, direction).inc(transfer.nbytes)
            self.metrics.transfer_seconds.labels(direction).observe(transfer.elapsed_s)
            if logger.isEnabledFor(logging.DEBUG):  # the phases' dict is built only for a reader of it
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

    # --- the part's life: warm peers, sweep, a new worker, shutdown -------------------------------

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
        self.ending.close()  # shutting down: the holders end those admissions at their deadlines
        await self.reads.close()

    def rebind(self, dataplane: DataPlane) -> None:
        """A new worker replaced a lost one: new pulls run through it, its staging buffers are new."""
        self._dataplane = dataplane
        self.reads.rebind(dataplane)

    async def sweep(self) -> None:
        """Hand back what stale pulls held once NIXL finished their reads (the daemon's sweeper)."""
        await self.ending.sweep()

    @property
    def stale_pulls(self) -> int:
        return self.ending.stale_pulls

    def _abandon_later(self, remote: TransferParams, reader_rank: int, transfer_id: str, reason: str) -> None:
        """AbandonPull in the background (an admission that was asked and never answered)."""
        self.ending.in_background(self.ending.abandon(remote, reader_rank, transfer_id, reason))
