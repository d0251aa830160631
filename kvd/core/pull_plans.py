"""A pull's planning and the holder's admission, on the reader side (one part of
:class:`kvd.core.pulls.Puller`, the reader's pipeline).

The hops, in the order a pull takes them: :meth:`PullPlanner.session` (the holder's cached
handshake, :class:`~kvd.core.peers.Peers`), :meth:`PullPlanner.plan_layout` (the planner,
:func:`kvd.layout.groups.plan_groups_pull`: small pulls inline, large ones in the thread pool),
:meth:`PullPlanner.admit` (PreparePull through the peer transport). :meth:`PullPlanner.plan`
chains the three for the sequential way, handshaking again once when a cached handshake proves
stale (:class:`StaleHandshake`). Event-loop only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable

from kvd.config import KvdConfig
from kvd.core.params import TransferParams
from kvd.core.peers import (
    AskedAdmission,
    Peers,
    PeerSession,
    PeerTransport,
    PrepareRequest,
    PrepareResult,
    RemoteEngine,
    unreachable,
)
from kvd.core.registry import EngineRank
from kvd.core.transfers import Transfer
from kvd.layout.convert_plan import CostModel
from kvd.layout.groups import plan_groups_pull
from kvd.layout.plan import PullPlan
from kvd_client.errors import FailedPrecondition, KvdError, PeerUnavailable, StaleRegistration, UnknownEngine
from kvd_client.group_blocks import split_groups

INLINE_PLAN_BLOCKS = 512  # pulls this small are planned on the event loop (well under 1 ms)


class PullPlanner:
    """Handshake, plan and admission of the reader's pulls (module docstring)."""

    def __init__(
        self,
        config: KvdConfig,
        peers: Peers,
        transport: PeerTransport,
        executor: concurrent.futures.Executor,
        abandon_later: Callable[[TransferParams, int, str, str], None],
    ) -> None:
        self.config = config
        self.peers = peers
        self._transport = transport
        self._executor = executor
        # AbandonPull in the background (PullEnding): an admission asked but never answered
        self._abandon_later = abandon_later
        self._costs = CostModel(config.read_descriptor_cost_s, config.convert_bytes_per_s, config.staging_pool_bytes)

    async def session(self, remote: TransferParams) -> PeerSession:
        """The holder's session (handshaking if none is cached), refused if the holder restarted
        since it granted the lease."""
        session = await self.peers.session(remote.daemon_address, remote.daemon_incarnation)
        if remote.daemon_incarnation and session.incarnation != remote.daemon_incarnation:
            raise FailedPrecondition(
                f"the holder daemon at {remote.daemon_address} restarted (incarnation {session.incarnation[:8]}, "
                f"the lease came from {remote.daemon_incarnation[:8]}): its blocks are gone, recompute"
            )
        return session

    async def plan(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PeerSession, PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Handshake (cached), plan, and have the holder admit the read; re-handshake once if stale."""
        address = remote.daemon_address
        asked_at = time.monotonic()
        session = await self.session(remote)
        while True:
            fresh = session.handshaken_at >= asked_at
            try:
                return session, *await self._plan_with(session, transfer, rank, remote)
            except StaleHandshake as exc:
                # A cached handshake may describe an engine that has since re-registered (other
                # ranks, other blocks, other memory): handshake again once before believing it.
                if fresh:
                    raise exc.error from None
                asked_at = time.monotonic()
                session = await self.peers.refresh(address, exc.reason)

    async def _plan_with(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine], PrepareResult]:
        """Plan against one handshake and have the holder admit the read for it."""
        pull_plan, remote_ranks = await self.plan_layout(session, transfer, rank, remote)
        return pull_plan, remote_ranks, await self.admit(session, transfer, rank, remote, pull_plan, remote_ranks)

    async def plan_layout(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine]]:
        """Plan the pull against one handshake (StaleHandshake where that handshake cannot serve it).
        Planning is vectorised numpy: small pulls plan inline, large ones off the event loop."""
        if len(transfer.local_block_ids) <= INLINE_PLAN_BLOCKS:
            return self.plan_layout_now(session, transfer, rank, remote)
        remote_ranks, plan = self._planner_of(session, transfer, rank, remote)
        try:
            pull_plan = await asyncio.get_running_loop().run_in_executor(self._executor, plan)
        except KvdError as exc:
            raise StaleHandshake("cached layout refused", exc) from exc
        return self._planned(session, transfer, remote, pull_plan, remote_ranks)

    def plan_layout_now(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[PullPlan, dict[int, RemoteEngine]]:
        """:meth:`plan_layout` on the caller's thread, whatever the pull's size (a pull that starts
        its READs within StartPulls itself plans only small pulls so: kvd.core.start_posts)."""
        remote_ranks, plan = self._planner_of(session, transfer, rank, remote)
        try:
            pull_plan = plan()
        except KvdError as exc:
            raise StaleHandshake("cached layout refused", exc) from exc
        return self._planned(session, transfer, remote, pull_plan, remote_ranks)

    def _planner_of(
        self, session: PeerSession, transfer: Transfer, rank: EngineRank, remote: TransferParams
    ) -> tuple[dict[int, RemoteEngine], Callable[[], PullPlan]]:
        remote_ranks = session.engine_ranks(remote.engine_id)
        try:
            if not remote_ranks:
                raise UnknownEngine(f"the daemon at {remote.daemon_address} serves no engine {remote.engine_id!r}")
            remote_groups = split_groups(remote.group_block_ids, remote.group_block_counts, "kv_transfer_params")
        except KvdError as exc:
            raise StaleHandshake("cached layout refused", exc) from exc

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

        return remote_ranks, plan

    @staticmethod
    def _planned(
        session: PeerSession,
        transfer: Transfer,
        remote: TransferParams,
        pull_plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
    ) -> tuple[PullPlan, dict[int, RemoteEngine]]:
        transfer.mark("planned")
        unnamed = [r for r in pull_plan.remote_ranks if not session.agent.names(remote_ranks[r])]
        if unnamed:  # never prepare a list over memory the loaded metadata does not name
            raise StaleHandshake(
                "metadata does not name the engine's memory",
                PeerUnavailable(
                    f"the NIXL metadata of {remote.daemon_address} does not name the memory of engine "
                    f"{remote.engine_id!r} ranks {unnamed}: retry"
                ),
            )
        return pull_plan, remote_ranks

    def _admission_request(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        pull_plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        read_id: str,
    ) -> PrepareRequest:
        holder_spec = remote_ranks[pull_plan.remote_ranks[0]].view.spec
        return PrepareRequest(
            lease_id=remote.lease_id,
            engine_id=remote.engine_id,
            block_ids=tuple(remote.block_ids[: holder_spec.blocks_for(remote.num_tokens)]),
            num_tokens=remote.num_tokens,
            reader_tp_rank=rank.tp_rank,
            reader_tp_size=rank.spec.tp_size,
            remote_tp_ranks=tuple(pull_plan.remote_ranks),
            reader_transfer_id=transfer.transfer_id,
            read_timeout_s=max(0.001, transfer.started + transfer.deadline_s - time.monotonic()),
            group_block_ids=self.remote_groups(remote),
            read_id=read_id,
            registration_ids=self._planned_registrations(pull_plan, remote_ranks) if read_id else (),
        )

    @property
    def _admission_timeout_s(self) -> float:
        return self.config.commit_wait_s + self.config.handshake_timeout_s

    def ask_admission(
        self,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        pull_plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
    ) -> AskedAdmission | None:
        """Queue the admission of a pull whose READs are queued already (kvd.core.start_posts),
        without awaiting anything: it leaves when StartPulls flushes the transport, right after
        the step's last READs go to the worker. :meth:`admit` with ``asked`` reads its answer. None
        where the transport cannot queue it (``admit`` then asks as usual)."""
        request = self._admission_request(transfer, rank, remote, pull_plan, remote_ranks, transfer.transfer_id)
        return self._transport.ask_prepare_pull(remote.daemon_address, request, self._admission_timeout_s)

    async def admit(
        self,
        session: PeerSession,
        transfer: Transfer,
        rank: EngineRank,
        remote: TransferParams,
        pull_plan: PullPlan,
        remote_ranks: dict[int, RemoteEngine],
        read_id: str = "",
        asked: AskedAdmission | None = None,
    ) -> PrepareResult:
        """Have the holder admit the read (PreparePull). With ``read_id`` the pull's READs are
        posted beside this call (PullReads.beside_admission): the holder checks the registrations
        planned against, and an AbandonPull is left to the pull's end, once its READs are final.
        ``asked``: the call is on its way already (:meth:`ask_admission`, asked with the pull's
        transfer id as ``read_id``); only its answer is read here."""
        planned = self._planned_registrations(pull_plan, remote_ranks)
        try:
            if asked is not None:
                prepared = await asked.answer()
            else:
                request = self._admission_request(transfer, rank, remote, pull_plan, remote_ranks, read_id)
                prepared = await self._transport.prepare_pull(remote.daemon_address, request, self._admission_timeout_s)
        except (UnknownEngine, StaleRegistration) as exc:  # the holder's ranks changed (registered again)
            raise StaleHandshake("holder ranks changed", exc) from exc
        except KvdError as exc:
            if unreachable(exc):
                await self.peers.drop_if(session, "prepare failed")
            if unreachable(exc) and not read_id:
                # Unanswered: the holder may have run the call (a stopped holder runs it when it
                # resumes) and admitted the read. Tell it the read is over (nothing was posted).
                self._abandon_later(remote, rank.tp_rank, transfer.transfer_id, "its admission was never answered")
            raise
        except asyncio.CancelledError:
            # The pull was cancelled (or ran out of time) while the holder admitted it. The call is
            # withdrawn, but the holder may have admitted the read just before and its answer is
            # lost: tell it the read is over (this pull posted nothing), so the admission does not
            # wait for its deadline and retire the holder's memory as never proven over. (A pull
            # whose READs were posted beside it tells it at its end, once they are final.)
            if not read_id:
                why = "the pull ended while its admission was asked"
                self._abandon_later(remote, rank.tp_rank, transfer.transfer_id, why)
            raise
        transfer.mark("prepared")
        if prepared.registration_ids != planned:
            raise StaleHandshake(
                "stale engine registration",
                FailedPrecondition(
                    f"engine {remote.engine_id!r} at {remote.daemon_address} re-registered during the pull: retry"
                ),
            )
        return prepared

    @staticmethod
    def remote_groups(remote: TransferParams) -> tuple[tuple[int, ...], ...]:
        return tuple(split_groups(remote.group_block_ids, remote.group_block_counts, "kv_transfer_params"))

    @staticmethod
    def _planned_registrations(pull_plan: PullPlan, remote_ranks: dict[int, RemoteEngine]) -> tuple[int, ...]:
        return tuple(remote_ranks[r].registration_id for r in pull_plan.remote_ranks)


def lease_unexpired(remote: TransferParams) -> bool:
    """Whether the lease's expiry (as its params name it, wall clock) is still ahead: past it, the
    admission can only be refused, so a READ beside it would be wasted (what keeps an early READ
    off unmapped memory is the holder's early-read window: PeerSession.may_read_early)."""
    return not remote.lease_expires_unix_ms or remote.lease_expires_unix_ms > time.time() * 1000


def names_the_leased_registrations(session: PeerSession, remote: TransferParams) -> bool:
    """Whether the handshake names the registrations the lease was granted on (a lease from an
    older holder names none: the admission alone checks them)."""
    if not remote.registration_ids:
        return True
    ranks = session.engine_ranks(remote.engine_id)
    return tuple(ranks[r].registration_id for r in sorted(ranks)) == tuple(remote.registration_ids)


class StaleHandshake(Exception):
    """Planning against a cached handshake failed; a fresh handshake may succeed."""

    def __init__(self, reason: str, error: KvdError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error
