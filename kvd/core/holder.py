"""The holder's side of a pull: the handshake a reader plans against, the admission of its read,
the soft-hold checks around it, and the NIXL notifications that end it.

The holder side's pipeline, one part of the daemon (:class:`kvd.core.daemon.Daemon` composes it
and forwards the peer calls to it). A read of a lease goes through it in this order:

1. :meth:`Holder.handshake_info` (Handshake): the engines a reader plans against, this worker's
   NIXL identity; the worker then polls fast while the reader connects (``CONNECT_POLL_S``);
2. :meth:`Holder.prepare_pull` (PreparePull): checks, the wait for committed tokens
   (:class:`~kvd.core.commits.CommitTracker`), the admission (:class:`~kvd.core.leases.LeaseTable`),
   the pins of the holder ranks' memory, the early notifications claimed
   (:mod:`kvd.core.early_reads`), and a soft hold's pin by the engine (:meth:`Holder._pin_soft`,
   :class:`~kvd.core.holdchecks.HoldChecks`);
3. the reader's READ; its notification arrives through the data plane:
   :meth:`Holder.on_notifications` counts its parts (``LeaseTable.record_read``);
4. a soft hold's :meth:`Holder.finish_read` (FinishRead) verifies and unpins; a reader that gave
   up sends :meth:`Holder.abandon_pull` (AbandonPull);
5. the lease table calls back :meth:`Holder.admission_over`: the memory is unpinned (tainted
   first if the read was never proven over, until :meth:`Holder._admission_proven`).

It owns the admissions' side tables (metrics labels, soft pins) and the connect polls; it gets
everything else explicitly (the tables it shares with the daemon's other parts, getters for
what a data-plane restart replaces). What an admission pins and when it is released:
docs/lifetimes.md. Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kvd.core import notif
from kvd.core.context import CoreContext
from kvd.core.finishing import Finishing
from kvd.core.leases import Admission, AdmissionEnd, Lease
from kvd.core.local_memory import LocalMemory
from kvd.core.peers import HandshakeInfo, PrepareRequest, PrepareResult, RemoteEngine
from kvd.core.registry import EngineRank
from kvd.layout import groups as kv_groups
from kvd_client.errors import (
    FailedPrecondition,
    HeldKvEvicted,
    InvalidArgument,
    StaleRegistration,
    UnknownEngine,
    UnknownLease,
    UnsupportedModelFeature,
)
from kvd_client.v1.schema import HoldCheckAction

logger = logging.getLogger(__name__)

# A fast-poll deadline long past but not 0.0: the worker keeps polling every 50 ms, not 1 s (a read
# that was never proven over may still be served; see Holder._poll_fast_while_admitted).
UNPROVEN_READS_DEADLINE = 1e-3
# After serving a Handshake, the worker polls fast this long: the reader connects its NIXL agent
# at once (NixlAgent.add_remote), and UCX sets the connection up only as both sides make progress.
# A dormant holder polls once a second, so the set-up waited for the first admission and fell on
# the first pull's READ instead of overlapping its planning and admission (a few ms). Short: fast
# polls cost CPU (each ~0.1 ms of UCX progress), and the admission that follows polls fast anyway.
CONNECT_POLL_S = 0.1


class Holder:
    """What a holder does for the readers of its leases (module docstring)."""

    def __init__(self, ctx: CoreContext, *, agent_name: Callable[[], str]) -> None:
        self.config = ctx.config
        self.metrics = ctx.metrics
        self.registry = ctx.registry
        self.leases = ctx.leases
        self.commits = ctx.commits
        self.holdchecks = ctx.holdchecks
        self.incarnation = ctx.incarnation
        self._agent_name = agent_name  # the worker's: a data-plane restart renames it
        self._dataplane = ctx.dataplane
        self._memories = ctx.memories
        self._require_serving = ctx.require_serving
        self._require_dataplane = ctx.require_dataplane
        self.followups = Finishing("holder-unpin")  # unpins scheduled by the lease table's callbacks
        self._loop = ctx.loop
        self._reader_labels: dict[str, str] = {}  # admission id -> reader's address (metrics label)
        # admission id -> (engine, request) of a soft read pinned by the engine (to unpin it when
        # the admission ends after its lease did)
        self._soft_pins: dict[str, tuple[str, str]] = {}
        self._connecting_until = 0.0  # a reader may be connecting its NIXL agent until then (handshake_info)
        self._connect_poll_end: asyncio.TimerHandle | None = None

    def admission_over(self, admission: Admission) -> None:
        """LeaseTable callback: an admitted read is over; unpin the holder memory it pinned."""
        assert admission.ended is not None
        label = self._reader_labels.pop(admission.admission_id, "")
        if admission.ended is AdmissionEnd.READ:
            self.metrics.transfers.labels(label, "serve", "done").inc()
        elif admission.ended is AdmissionEnd.TIMED_OUT:
            logger.warning(
                "read of lease %s by %s (rank %d) was not proven over by its deadline: its memory will be retired",
                admission.lease_id,
                admission.reader,
                admission.reader_rank,
            )
        self.metrics.admissions_ended.labels(admission.ended.value).inc()
        if admission.soft_pinned:  # the engine pinned the soft hold's blocks for this read
            admission.soft_pinned = False
            lease = self.leases.find(admission.lease_id)
            engine_id, request_id = self._soft_pins.pop(admission.admission_id, ("", ""))
            if lease is not None:
                engine_id, request_id = lease.engine_id, lease.request_id
            if engine_id:
                self.holdchecks.unpin(engine_id, request_id, admission.lease_id, admission.admission_id)
        else:
            self._soft_pins.pop(admission.admission_id, None)
        pinned, admission.pinned = list(admission.pinned), []
        clean = admission.ended.clean
        if not clean:  # tainted (now, before the unpins run) until a late proof: _admission_proven
            admission.tainted = pinned
            for memory in pinned:
                assert isinstance(memory, LocalMemory)
                self._memories().taint(memory, admission.admission_id)
        for memory in pinned:
            assert isinstance(memory, LocalMemory)
            self.followups.start(self._memories().unpin(memory, holder=True))
        self._poll_fast_while_admitted(unproven=bool(pinned) and not clean)

    def _admission_proven(self, admission: Admission, how: str) -> None:
        """A read that timed out (not proven over) is proven over late: lift its taints. A
        quarantined mapping nothing else keeps is then freed (docs/lifetimes.md)."""
        tainted, admission.tainted = list(admission.tainted), []
        if not tainted:
            return
        logger.info(
            "read of lease %s by %s (rank %d) is proven over after its deadline (%s): its memory is no longer "
            "kept for it",
            admission.lease_id,
            admission.reader,
            admission.reader_rank,
            how,
        )
        for memory in tainted:
            assert isinstance(memory, LocalMemory)
            self._memories().prove(memory, admission.admission_id)
        self._poll_fast_while_admitted()

    def _poll_fast_while_admitted(self, unproven: bool = False) -> None:
        """NIXL's thread polls fast until the latest open admission's deadline: a READ that
        carries a notification completes only once the holder has made progress.

        A Handshake served in the last CONNECT_POLL_S keeps it fast too (its reader is connecting).
        With none open, 0.0 lets it poll once a second only, unless a read of an engine's
        memory here ended without being proven over (tainted): its reader may still be reading
        (a stalled READ resumes when a partition heals, and over TCP UCX serves it only as the
        holder makes progress), so it keeps a past, non-zero deadline: a poll every 50 ms."""
        dataplane = self._dataplane()
        if dataplane is None:
            return
        deadline = self.leases.latest_admission_deadline()
        if not deadline and (unproven or any(rank.memory.tainted for rank in self.registry)):
            deadline = UNPROVEN_READS_DEADLINE
        if self._connecting_until > time.monotonic():
            deadline = max(deadline, self._connecting_until)
        dataplane.fast_poll_until = deadline

    def on_notifications(self, notifications: dict[str, list[bytes]]) -> None:
        """READ notifications from readers (delivered by the data plane's thread, on the loop)."""
        for agent, messages in notifications.items():
            for message in messages:
                reads = notif.decode_all(message)  # a step's READ names several reads (kvd.core.step_reads)
                if not reads:
                    logger.debug("ignoring NIXL notification from %s: %r", agent, message[:64])
                for read in reads:
                    label = self._reader_labels.get(read.admission_id, agent)
                    self.metrics.transfer_bytes.labels(label, "serve").inc(read.nbytes)
                    late = self.leases.record_read(read.lease_id, read.admission_id, read.part, read.parts)
                    if late is not None:  # the READs of a read that timed out did end: every part arrived
                        self._admission_proven(late, "every part's notification arrived")

    def handshake_info(self) -> HandshakeInfo:
        engines = tuple(
            RemoteEngine(
                engine_id=rank.engine_id,
                view=rank.view,
                extra_groups=rank.extra_groups,
                region_addresses=tuple(rank.region_addresses),
                region_sizes=tuple(region.size_bytes for region in rank.regions),
                vram=rank.mem_type == "VRAM",
                device_index=rank.device_index,
                registration_id=rank.registration_id,
                early_reads=not rank.require_commits,
                step_notifications=True,
                finish_read_ends_reads=True,
            )
            for rank in self.registry
        )
        self._require_dataplane()
        dataplane = self._dataplane()
        assert dataplane is not None
        identity = dataplane.identity()
        self._poll_fast_for_connect()
        return HandshakeInfo(
            self.incarnation,
            self._agent_name(),
            identity.metadata,
            engines,
            identity.regions,
            self.config.early_read_window_s,  # Memories keeps what it lets go readable that long (and more)
        )

    def _poll_fast_for_connect(self) -> None:
        """A reader has the metadata and is connecting: poll fast for CONNECT_POLL_S (CONNECT_POLL_S's
        comment), then as the admissions say. Handshakes are rare (one per peer and re-registration)."""
        self._connecting_until = time.monotonic() + CONNECT_POLL_S
        self._poll_fast_while_admitted()
        loop = self._loop()
        if loop is not None and not loop.is_closed():
            if self._connect_poll_end is not None:
                self._connect_poll_end.cancel()
            self._connect_poll_end = loop.call_at(loop.time() + CONNECT_POLL_S + 0.01, self._poll_fast_while_admitted)

    async def prepare_pull(
        self, request: PrepareRequest, *, reader_address: str = "", reader_incarnation: str = ""
    ) -> PrepareResult:
        """Admit a reader's read of a lease, after waiting (bounded) for committed tokens.

        The admission pins the holder ranks' memory until the read is over (see kvd.core.leases).
        ``request.read_id``: the reader named its read (its READ may have been posted beside this
        call and its notification be here already: kvd.core.early_reads).
        ``request.registration_ids``: the registrations it planned against; another one now
        refuses the read, admitting nothing (an early READ's parts are then never counted: the
        lease stays whole for a retry). ``reader_address`` labels metrics and logs.
        """
        lease_id, engine_id, block_ids = request.lease_id, request.engine_id, request.block_ids
        num_tokens, remote_tp_ranks = request.num_tokens, request.remote_tp_ranks
        reader_tp_rank, reader_tp_size = request.reader_tp_rank, request.reader_tp_size
        read_timeout_s, read_id = request.read_timeout_s, request.read_id
        reader_transfer_id, registration_ids = request.reader_transfer_id, request.registration_ids
        group_block_ids = request.group_block_ids
        self._require_serving()
        if read_id and not notif.valid_read_id(read_id):
            raise InvalidArgument(
                f"read id {read_id[:80]!r} is not 1-{notif.READ_ID_MAX} characters of letters, digits, '.', '_', '-'"
            )
        lease = self.leases.get(lease_id)
        if lease.engine_id != engine_id:
            raise InvalidArgument(f"lease {lease_id!r} holds engine {lease.engine_id!r}, not {engine_id!r}")
        if tuple(block_ids) != lease.block_ids[: len(block_ids)] or not block_ids:
            raise InvalidArgument(f"block ids {list(block_ids)[:8]} are not a prefix of lease {lease_id!r}'s blocks")
        if not 1 <= num_tokens <= lease.num_tokens:
            raise InvalidArgument(f"the read asks for {num_tokens} tokens, lease {lease_id!r} holds {lease.num_tokens}")
        self._check_group_read(lease, group_block_ids, num_tokens)
        hold_s = read_timeout_s or self.config.transfer_deadline_s
        if hold_s > self.config.max_lease_ttl_s:
            raise InvalidArgument(
                f"the read asks to be admitted for {hold_s:.1f}s, longer than max_lease_ttl_s "
                f"{self.config.max_lease_ttl_s}s: use a shorter pull deadline"
            )
        if reader_tp_size < 1 or not 0 <= reader_tp_rank < reader_tp_size:
            raise InvalidArgument(f"reader tp_rank {reader_tp_rank} / tp_size {reader_tp_size} is not a rank")
        if lease.reader_tp_size and lease.reader_tp_size != reader_tp_size:
            raise InvalidArgument(
                f"lease {lease_id!r} is being read by a TP-{lease.reader_tp_size} engine, not TP-{reader_tp_size}"
            )
        ranks = self._holder_ranks(engine_id, remote_tp_ranks)
        for r in remote_tp_ranks:
            if not ranks[r].require_commits:
                continue
            if not await self.commits.wait_for(engine_id, r, lease.request_id, num_tokens, self.config.commit_wait_s):
                have = self.commits.watermark(engine_id, r, lease.request_id)
                raise FailedPrecondition(
                    f"request {lease.request_id!r} on engine {engine_id!r} rank {r}: only {have} of {num_tokens} "
                    f"tokens committed after {self.config.commit_wait_s}s (no post-forward signal yet?)"
                )
        # The wait yielded: the lease and the ranks may have changed meanwhile. From here to the
        # return nothing awaits, so what is checked is what is pinned.
        self._require_serving()
        self._require_dataplane()
        ranks = self._holder_ranks(engine_id, remote_tp_ranks)
        current = tuple(ranks[r].registration_id for r in remote_tp_ranks)
        if registration_ids and tuple(registration_ids) != current:
            raise StaleRegistration(
                f"engine {engine_id!r} ranks {list(remote_tp_ranks)} are registrations {list(current)} here, not "
                f"{list(registration_ids)}: handshake again and retry"
            )
        reader = _reader_key(reader_incarnation, reader_transfer_id)
        admission = self.leases.admit(lease_id, reader, reader_tp_rank, reader_tp_size, hold_s, read_id)
        memories = self._memories()
        for r in remote_tp_ranks:
            memories.pin(ranks[r].memory, holder=True)
            admission.pinned.append(ranks[r].memory)
        self._poll_fast_while_admitted()
        self.leases.claim_early_parts(admission)  # its READ may be over already (a hard hold's read then ends)
        if reader_address:
            self._reader_labels[admission.admission_id] = reader_address
        if lease.soft:
            try:
                await self._pin_soft(lease, admission)
            except asyncio.CancelledError:
                # The reader withdrew the call (or its stream ended) while the engine pinned: it never
                # got the notification tag, so it posted nothing. End the admission now (its memory
                # unpinned, the lease kept for a retry) instead of at its deadline, where a read
                # never proven over would retire the holder's memory.
                self._soft_pins.pop(admission.admission_id, None)
                if admission.ended is None:
                    self.leases.abandon(lease_id, reader, reader_tp_rank)
                raise
        # The registrations admitted and pinned, as checked above: a soft pin awaits the engine, and
        # a rank re-mapped meanwhile (this daemon fencing a read of its own) now names a new one.
        # The reader compares this answer with what it planned on, and a mismatch there means
        # "admitted nothing" to it: naming the new one left this admission unended (the fleet saw
        # it time out and retire the memory, never proven over). The pinned mapping stays the
        # engine's pages until the admission ends (kvd.core.pull_resources: _cut_off waits).
        return PrepareResult(
            registration_ids=current,
            notif_tag=notif.tag(lease_id, admission.admission_id),
            verify_after_read=lease.soft,
        )

    def _check_group_read(self, lease: Lease, group_block_ids: Sequence[Sequence[int]], num_tokens: int) -> None:
        """A read of a hybrid model's lease reads the lease's own group blocks, all its tokens."""
        if tuple(tuple(ids) for ids in group_block_ids) != lease.group_block_ids:
            raise InvalidArgument(
                f"the read names {len(group_block_ids)} KV cache groups' block ids that are not lease "
                f"{lease.lease_id!r}'s ({len(lease.group_block_ids)} groups after group 0)"
            )
        if not lease.group_block_ids or num_tokens == lease.num_tokens:
            return
        ranks = self.registry.ranks_of(lease.engine_id)
        for index, group in enumerate(next(iter(ranks.values())).groups) if ranks else ():
            if group.kind is not kv_groups.KvGroupKind.FULL_ATTENTION:
                raise UnsupportedModelFeature(
                    f"{kv_groups.describe_group(index, group)}: a {group.kind.name.lower()} group holds the state "
                    f"after all {lease.num_tokens} held tokens; a read of {num_tokens} tokens cannot use it"
                )

    async def _pin_soft(self, lease: Lease, admission: Admission) -> None:
        """Have the engine verify the soft hold's blocks and pin them for this read, or refuse it.

        The admission is open meanwhile (its memory pinned like any read's); a refusal ends it
        (nothing was posted) and the lease with it: the blocks are gone for every reader.
        """
        self._soft_pins[admission.admission_id] = (lease.engine_id, lease.request_id)
        ok, why = await self.holdchecks.check(
            lease.engine_id,
            HoldCheckAction.PIN,
            lease.request_id,
            lease.lease_id,
            admission.admission_id,
            self.config.hold_check_timeout_s,
        )
        if ok and admission.ended is None:
            admission.soft_pinned = True
            return
        if ok:  # the read ended while the engine pinned (the lease was released): drop the pin
            self.holdchecks.unpin(lease.engine_id, lease.request_id, lease.lease_id, admission.admission_id)
        self._soft_pins.pop(admission.admission_id, None)
        self.leases.finish_read(lease.lease_id, admission, verified=False)
        raise HeldKvEvicted(
            f"request {lease.request_id!r} on engine {lease.engine_id!r}: its blocks no longer hold its KV "
            f"({why or 'the read ended'}); recompute"
        )

    async def finish_read(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
        nbytes: int = 0,
    ) -> None:
        """The reader's READs of its admitted read are final (FinishRead).

        A hard lease's read ends here as its READs' notifications would end it: its reader posted
        them without one (``nbytes``: what they moved, for the serve counter), and a read that
        already timed out is proven over late. A soft lease's blocks are verified again and
        unpinned: HeldKvEvicted when they no longer carry the request's KV (the reader must not
        report the pull done); the lease then ends as evicted.
        """
        reader = _reader_key(reader_incarnation, reader_transfer_id)
        admission = self.leases.admission_of(lease_id, reader, reader_tp_rank)
        lease = self.leases.find(lease_id)
        if nbytes:  # labelled as its admission's served transfer is (the reader's address)
            label = self._reader_labels.get(admission.admission_id, "") if admission is not None else ""
            self.metrics.transfer_bytes.labels(label, "serve").inc(nbytes)
        if admission is None and (lease is None or not lease.soft):
            late = self.leases.prove_abandoned(lease_id, reader, reader_tp_rank)
            if late is not None:  # it timed out while its READs moved: they are over now
                self._admission_proven(late, "its reader's FinishRead arrived")
                return
        if admission is None or lease is None:
            raise UnknownLease(f"lease {lease_id!r} has no read admitted for rank {reader_tp_rank} of that reader")
        if not lease.soft:
            self.leases.finish_read(lease_id, admission, verified=True)
            return
        ok, why = False, "the engine's pin of the blocks was lost"
        if admission.soft_pinned:
            admission.soft_pinned = False
            self._soft_pins.pop(admission.admission_id, None)
            ok, why = await self.holdchecks.check(
                lease.engine_id,
                HoldCheckAction.VERIFY_UNPIN,
                lease.request_id,
                lease_id,
                admission.admission_id,
                self.config.hold_check_timeout_s,
            )
            if not ok:  # a silent scheduler: drop the pin anyway (the verdict is "not verified")
                self.holdchecks.unpin(lease.engine_id, lease.request_id, lease_id, admission.admission_id)
        self.leases.finish_read(lease_id, admission, verified=ok)
        if not ok:
            raise HeldKvEvicted(
                f"request {lease.request_id!r} on engine {lease.engine_id!r}: its blocks changed during the read "
                f"({why}); the pulled bytes must not be used"
            )

    def _holder_ranks(self, engine_id: str, remote_tp_ranks: Sequence[int]) -> dict[int, EngineRank]:
        ranks = self.registry.ranks_of(engine_id)
        missing = [r for r in remote_tp_ranks if r not in ranks]
        if missing or not remote_tp_ranks:
            raise UnknownEngine(f"engine {engine_id!r} has no ranks {missing or '[]'} registered here")
        return ranks

    def abandon_pull(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reason: str,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
    ) -> None:
        """The reader's READs of the lease are final and it gave up: its admission ends cleanly,
        or, if it already timed out, it is proven over late (its memory's taint is lifted)."""
        reader = _reader_key(reader_incarnation, reader_transfer_id)
        if self.leases.abandon(lease_id, reader, reader_tp_rank):
            logger.info("reader rank %d abandoned its read of lease %s: %s", reader_tp_rank, lease_id, reason)
            return
        late = self.leases.prove_abandoned(lease_id, reader, reader_tp_rank)
        if late is not None:
            self._admission_proven(late, f"its reader abandoned it: {reason}")
            return
        self.leases.get(lease_id)  # NOT_FOUND / DEADLINE_EXCEEDED for a gone lease
        raise UnknownLease(f"lease {lease_id!r} has no read admitted for rank {reader_tp_rank} of that reader")


def _reader_key(reader_incarnation: str, reader_transfer_id: str) -> str:
    """Who reads under an admission: the same key where the read is admitted, finished and
    abandoned (a reader that sent no incarnation can still end its own read)."""
    return f"{reader_incarnation or 'unknown'}/{reader_transfer_id}"
