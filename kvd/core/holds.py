"""Holds: this daemon's leases on its engines' blocks, as engines, routers and readers ask for
them, and the reader's renewals and releases of the leases its own engines will read elsewhere.

Two parts of the daemon (:class:`kvd.core.daemon.Daemon` composes both and forwards the calls):

* :class:`Holds`: HoldBlocks (:meth:`Holds.hold`, hard or soft), the params a reader pulls with
  (:meth:`Holds.params_of`), renewals, releases, lookups, the scheduler stream that verifies
  soft holds (:class:`~kvd.core.holdchecks.HoldChecks`), and the end of a lease
  (:meth:`Holds.lease_over`, the lease table's callback: the engine hears ``finished_sending``).
  Also the lease gauges a metrics scrape reads (computed on the event loop).
* :class:`HolderCalls`: a local engine's requests will read leases held elsewhere later (renew)
  or never (release): each holder is told, batched, in the background.

The lease table itself (deadlines, admissions, drains) is :mod:`kvd.core.leases`; a read of a
lease is the holder's pipeline, :mod:`kvd.core.holder`. Event-loop only, except
:meth:`Holds.gauges_for_scrape`, which a scrape calls on the metrics server's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from kvd.config import KvdConfig
from kvd.core.context import CoreContext
from kvd.core.events import FinishedSending
from kvd.core.holdchecks import SchedulerChannel
from kvd.core.leases import Lease, LeaseEnd
from kvd.core.params import TransferParams
from kvd.core.peers import PeerTransport
from kvd.layout import groups as kv_groups
from kvd_client.errors import FailedPrecondition, InvalidArgument, KvdError
from kvd_client.group_blocks import flatten_groups

logger = logging.getLogger(__name__)

SCRAPE_WAIT_S = 1.0  # how long a scrape waits for the event loop to compute the lease gauges


class Holds:
    """This daemon's leases, as its callers see them (module docstring)."""

    def __init__(self, ctx: CoreContext, *, advertise_address: Callable[[], str]) -> None:
        self.config = ctx.config
        self.metrics = ctx.metrics
        self.registry = ctx.registry
        self.leases = ctx.leases
        self.commits = ctx.commits
        self.holdchecks = ctx.holdchecks
        self.incarnation = ctx.incarnation
        self._advertise_address = advertise_address  # the server may set it once it listens
        self._require_serving = ctx.require_serving
        self._loop = ctx.loop
        self.ended: dict[str, int] = {}  # LeaseEnd value -> count since start

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
        self._require_serving()
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
            daemon_address=self._advertise_address(),
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

    def lookup_held(self, engine_id: str = "", request_id: str = "") -> list[TransferParams]:
        return [
            self.params_of(lease)
            for lease in self.leases.all()
            if (not engine_id or lease.engine_id == engine_id)
            and (not request_id or lease.request_id == request_id)
            and self.leases.remaining_s(lease) > 0
        ]

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

    def lease_over(self, lease: Lease, how: LeaseEnd) -> None:
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
        self.ended[how.value] = self.ended.get(how.value, 0) + 1
        logger.debug("lease %s on %s/%s ended: %s", lease.lease_id, lease.engine_id, lease.request_id, how.value)

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

    def gauges_for_scrape(self) -> None:
        """Metrics hook, run before every collection: set the lease gauges from the tables.

        A scrape comes on the metrics server's thread: the tables are the event loop's, so the
        gauges are computed there (at most SCRAPE_WAIT_S; a loop that does not answer in time
        leaves the previous values). A collection on the loop itself (tests) computes them at once."""
        loop = self._loop()
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or on_loop or loop.is_closed() or not loop.is_running():
            self.lease_gauges()
            return
        done = concurrent.futures.Future[None]()

        def refresh() -> None:
            try:
                self.lease_gauges()
            finally:
                done.set_result(None)

        loop.call_soon_threadsafe(refresh)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            done.result(SCRAPE_WAIT_S)

    def lease_gauges(self) -> None:
        for (engine_id, tp_rank), values in self.held_bytes().items():
            for state, value in zip(("hard", "soft", "draining"), values, strict=True):
                self.metrics.held_bytes.labels(engine_id, str(tp_rank), state).set(value)
        self.metrics.leases_held.set(len(self.leases))
        self.metrics.leases_draining.set(self.leases.draining)
        self.metrics.admitted_reads.set(self.leases.open_admissions)


class HolderCalls:
    """The reader's renewals and releases of leases held by other daemons (module docstring)."""

    def __init__(
        self, config: KvdConfig, transport: PeerTransport, local: Holds, advertise_address: Callable[[], str]
    ) -> None:
        self.config = config
        self._transport = transport
        self._local = local  # leases this daemon holds itself (both engines on this node)
        self._advertise_address = advertise_address
        self.tasks: set[asyncio.Task[None]] = set()  # heartbeats and releases sent to peers

    def tell(self, leases: Sequence[tuple[str, str]], release: bool, reason: str = "") -> None:
        """A local engine's requests will read these (address, lease id) leases later (renew), or
        never (release): tell their holders, batched per holder. Best effort, in the background."""
        by_holder: dict[str, list[str]] = {}
        for address, lease_id in leases:
            if address and lease_id:
                by_holder.setdefault(address, []).append(lease_id)
        for address, ids in by_holder.items():
            if address == self._advertise_address():
                if release:
                    self._local.release_leases(ids, reason)
                else:
                    self._local.renew_leases(ids)
                continue
            task = asyncio.get_running_loop().create_task(self._tell_holder(address, ids, release, reason))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

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
