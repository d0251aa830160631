"""Leases: blocks held for a remote reader, and the reads admitted on them.

A lease names blocks of a holder engine under an unguessable id and a deadline. A reader that
wants to read them asks PreparePull, which *admits* its read: an :class:`Admission` records who
reads (reader daemon incarnation and transfer), which reader rank, and until when. The holder's
memory stays pinned while an admission is open (kvd.core.local_memory).

**When a lease ends** (the engine is told ``finished_sending`` and may reuse the blocks): only
when no admitted reader can still read them:

* every reader rank has read every part (the NIXL notifications say so): ``read``;
* or it was released, expired, or its engine went away, *and* every open admission is over:
  completed, abandoned by a reader that fenced its READ, or past its deadline plus a margin.
  Until then the lease is **draining**: no new admission, visible in status and metrics.

**Proven over late.** A timed-out admission taints the holder memory it pinned, but its proof may
still come (its notifications, its reader's AbandonPull: docs/lifetimes.md). The last
:data:`MAX_UNPROVEN` are kept; :meth:`LeaseTable.record_read` and :meth:`~LeaseTable.prove_abandoned`
return the one a late proof completes. An AbandonPull that finds no read of its reader admitted
is remembered on the lease: that reader's late PreparePull is refused.

**One reader per reader rank.** While an admission of reader rank r is open, a different reader
asking for rank r gets FAILED_PRECONDITION; the same reader asking again (a re-handshake before
it posted anything) replaces its admission. A rank that has read the lease cannot read it again.
Every reader rank is counted, so a TP-2 reader ends the lease only once both ranks read it.

**Deadlines** are kept in a heap (kvd.core.lease_deadlines): the daemon's sweeper asks for the
next one and sweeps on every round, at O(log n) per change instead of a pass over every lease.

The records themselves (:class:`Lease`, :class:`Admission` and how each ends) are
kvd.core.lease_records; the timed-out reads waiting for a late proof, kvd.core.late_proofs.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections.abc import Callable

from kvd.core.early_reads import EarlyParts
from kvd.core.late_proofs import MAX_UNPROVEN, UnprovenReads
from kvd.core.lease_deadlines import HEAP_SLACK, DeadlineHeap
from kvd.core.lease_records import Admission, AdmissionEnd, Lease, LeaseEnd
from kvd_client.errors import FailedPrecondition, InvalidArgument, LeaseExpired, UnknownLease

# The records, HEAP_SLACK and MAX_UNPROVEN were defined here before their own modules: still importable from here.
__all__ = [
    "HEAP_SLACK",
    "MAX_UNPROVEN",
    "Admission",
    "AdmissionEnd",
    "AdmissionOver",
    "Lease",
    "LeaseEnd",
    "LeaseOver",
    "LeaseTable",
]

AdmissionOver = Callable[[Admission], None]
LeaseOver = Callable[[Lease, LeaseEnd], None]


class LeaseTable:
    """All leases of one daemon. Event-loop only. Ends are reported through the callbacks, each
    exactly once: ``on_admission_over`` (unpin the holder memory), then ``on_lease_over``.

    Every change of a deadline is pushed onto the table's :class:`DeadlineHeap`, which
    :meth:`next_deadline` and :meth:`sweep` read (kvd.core.lease_deadlines)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_admission_over: AdmissionOver = lambda _: None,
        on_lease_over: LeaseOver = lambda _lease, _end: None,
        admission_margin_s: float = 5.0,
        on_new_deadline: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        self.on_admission_over = on_admission_over
        self.on_lease_over = on_lease_over
        self._deadlines = DeadlineHeap(self._leases, lambda: self._open_admissions, admission_margin_s)
        self._created = itertools.count()  # Lease.created_seq
        # Kept as admissions open and end, not counted over every lease: the holder asks for them
        # on every admission and every READ notification (O(leases) each was most of its CPU
        # with thousands of leases out).
        self._open_admissions = 0
        self._draining = 0  # leases in the table with an end requested (Lease.ending set)
        self._admission_deadline_high = 0.0  # the latest deadline since none was open
        self._unproven = UnprovenReads()  # admissions that timed out: a late proof may come
        # Parts of reads whose READ was posted beside their admission and arrived before it.
        self._early = EarlyParts(clock)
        # Called whenever a deadline may have come nearer (a lease granted or renewed, a read
        # admitted): the daemon's sweeper sleeps until the next deadline and must be woken.
        self.on_new_deadline = on_new_deadline

    def now(self) -> float:
        """The clock lease and admission deadlines are on (``expires_at`` and the like)."""
        return self._clock()

    def __len__(self) -> int:
        """Leases held and not draining (O(1): scrapes and GetStatus ask)."""
        return len(self._leases) - self._draining

    @property
    def draining(self) -> int:
        return self._draining

    @property
    def open_admissions(self) -> int:
        return self._open_admissions

    @property
    def admission_margin_s(self) -> float:
        """How long past its deadline an open admission is kept before it times out."""
        return self._deadlines.margin_s

    @admission_margin_s.setter
    def admission_margin_s(self, value: float) -> None:
        self._deadlines.margin_s = value  # moves every admission's end

    def next_deadline(self) -> float:
        """When :meth:`sweep` next has something to end: the earliest expiry of a live lease or
        end (deadline + margin) of an open admission; ``inf`` when there is none."""
        return self._deadlines.next()

    def latest_admission_deadline(self) -> float:
        """At least the deadline of the open admission that ends last; 0.0 when none is open.

        While admissions stay open this is the latest deadline any of them had (an admission
        that ended early does not lower it): a bound, kept in O(1), that only over-estimates how
        long a holder's data plane polls fast, never cuts it short."""
        return self._admission_deadline_high if self._open_admissions else 0.0

    def create(
        self,
        engine_id: str,
        request_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        ttl_s: float,
        soft: bool = False,
    ) -> Lease:
        _check_seconds("lease ttl", ttl_s)
        lease = Lease(
            lease_id=secrets.token_urlsafe(18),
            engine_id=engine_id,
            request_id=request_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            expires_at=self._clock() + ttl_s,
            ttl_s=ttl_s,
            soft=soft,
            created_seq=next(self._created),
        )
        self._leases[lease.lease_id] = lease
        self._deadlines.push(lease.expires_at, lease)
        self.on_new_deadline()
        return lease

    def get(self, lease_id: str) -> Lease:
        """The live lease; LeaseExpired if its deadline passed (even before the sweeper ran)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.draining:
            raise UnknownLease(f"no lease {lease_id!r} is held here (released, expired and swept, or never granted)")
        if lease.expires_at <= self._clock():
            raise LeaseExpired(f"lease {lease_id!r} on request {lease.request_id!r} expired")
        return lease

    def renew(self, lease_id: str, ttl_s: float) -> Lease:
        _check_seconds("lease ttl", ttl_s)
        lease = self.get(lease_id)
        expires_at = self._clock() + ttl_s
        if expires_at != lease.expires_at:
            nearer = expires_at < lease.expires_at
            lease.expires_at = expires_at
            self._deadlines.push(expires_at, lease)
            if nearer:  # a later deadline only makes the sweeper's next wake-up find nothing due
                self.on_new_deadline()
        return lease

    def renew_by_own_ttl(self, lease_ids: list[str]) -> list[str]:
        """Reader heartbeats: renew each live lease by its own TTL; the ids that are not live."""
        unknown = []
        now = self._clock()
        for lease_id in lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or lease.draining or lease.expires_at <= now:
                unknown.append(lease_id)
                continue
            expires_at = now + lease.ttl_s
            if expires_at > lease.expires_at:  # only ever later (an admission may have stretched it)
                lease.expires_at = expires_at
                self._deadlines.push(expires_at, lease)
        return unknown

    def find(self, lease_id: str) -> Lease | None:
        """The lease, live or draining (None once it ended)."""
        return self._leases.get(lease_id)

    # --- admitted reads -------------------------------------------------------------------------

    def admit(
        self, lease_id: str, reader: str, reader_rank: int, reader_tp_size: int, hold_s: float, admission_id: str = ""
    ) -> Admission:
        """Admit a read of the lease (one reader per reader rank, see the module docstring), under
        ``admission_id`` when the reader named its read (its READ may already be moving: the parts
        that arrived before are counted by :meth:`claim_early_parts`), else a new id."""
        _check_seconds("an admission's hold", hold_s)
        lease = self.get(lease_id)
        if lease.reader_tp_size and lease.reader_tp_size != reader_tp_size:
            raise InvalidArgument(
                f"lease {lease_id!r} is being read by a TP-{lease.reader_tp_size} engine, not TP-{reader_tp_size}"
            )
        if reader_rank in lease.done_readers:
            raise FailedPrecondition(f"reader rank {reader_rank} has already read lease {lease_id!r}")
        if (reader, reader_rank) in lease.abandoned:
            raise FailedPrecondition(
                f"reader {reader} rank {reader_rank} abandoned its read of lease {lease_id!r} before it was admitted"
            )
        for admission in list(lease.admissions.values()):
            if admission.reader_rank != reader_rank:
                continue
            if admission.reader != reader:
                raise FailedPrecondition(
                    f"lease {lease_id!r} is being read by another reader of rank {reader_rank}: one reader per rank"
                )
            self._end_admission(lease, admission, AdmissionEnd.REPLACED)
        if admission_id and (admission_id in lease.admissions or (lease_id, admission_id) in self._unproven):
            raise FailedPrecondition(f"read id {admission_id!r} is already in use on lease {lease_id!r}")
        now = self._clock()
        admission = Admission(admission_id or secrets.token_urlsafe(9), lease_id, reader, reader_rank, now + hold_s)
        lease.admissions[admission.admission_id] = admission
        self._open_admissions += 1
        self._admission_deadline_high = max(self._admission_deadline_high, admission.deadline)
        self._deadlines.push(admission.deadline + self._deadlines.margin_s, admission)
        lease.reader_tp_size = reader_tp_size
        if admission.deadline > lease.expires_at:  # the lease lives at least as long as its read
            lease.expires_at = admission.deadline
            self._deadlines.push(lease.expires_at, lease)
        self.on_new_deadline()
        return admission

    def record_read(self, lease_id: str, admission_id: str, part: int, parts: int) -> Admission | None:
        """Part ``part`` of ``parts`` of an admitted read arrived (a NIXL notification).

        A part of a read that already timed out counts towards its late proof: the admission it
        proves over with this part (every part has now arrived) is returned, else None."""
        if not 0 <= part < parts:
            return None
        lease = self._leases.get(lease_id)
        admission = lease.admissions.get(admission_id) if lease is not None else None
        if lease is None or admission is None:
            if (lease_id, admission_id) in self._unproven:
                return self._unproven.record_part(lease_id, admission_id, part, parts)
            if lease is not None and not lease.draining:  # a READ posted beside its admission, first here
                self._early.add(lease_id, admission_id, part, parts)
            return None  # forged, stale, or of a read that ended cleanly: counts nothing
        admission.parts_seen.add(part)
        admission.parts = parts
        if len(admission.parts_seen) < parts or lease.soft:
            return None  # a soft lease's read ends with the reader's FinishRead (verified again first)
        lease.done_readers.add(admission.reader_rank)
        self._end_admission(lease, admission, AdmissionEnd.READ)
        if lease.lease_id in self._leases and len(lease.done_readers) >= lease.reader_tp_size and not lease.draining:
            self._finish(lease, LeaseEnd.READ)
        return None

    def claim_early_parts(self, admission: Admission) -> None:
        """Count the parts of ``admission``'s read that arrived before it was admitted (its READ
        was posted beside its PreparePull): the read may end here, as if they arrived now. Called
        by the holder once the admission's memory is pinned, so that its end unpins it."""
        claimed = self._early.claim(admission.lease_id, admission.admission_id)
        if claimed is None or admission.ended is not None:
            return
        parts, seen = claimed
        for part in sorted(seen):
            self.record_read(admission.lease_id, admission.admission_id, part, parts)

    @property
    def early_reads(self) -> int:
        """Reads with parts that arrived before their admission, not claimed yet."""
        return len(self._early)

    def prove_abandoned(self, lease_id: str, reader: str, reader_rank: int) -> Admission | None:
        """The reader's AbandonPull (its READs are final) for a read that already timed out:
        that read, proven over late, or None if none of that reader timed out on the lease."""
        return self._unproven.prove_abandoned(lease_id, reader, reader_rank)

    @property
    def unproven(self) -> int:
        """Timed-out admissions still waiting for a late proof."""
        return len(self._unproven)

    def admission_of(self, lease_id: str, reader: str, reader_rank: int) -> Admission | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        for admission in lease.admissions.values():
            if admission.reader == reader and admission.reader_rank == reader_rank:
                return admission
        return None

    def finish_read(self, lease_id: str, admission: Admission, verified: bool) -> None:
        """A soft lease's reader ended its read (FinishRead): counted as read when the blocks were
        verified again; otherwise the lease ends as evicted. Either way no byte still moves."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.admissions.get(admission.admission_id) is not admission:
            return
        if not verified:
            if not lease.draining:
                self._mark_draining(lease, LeaseEnd.EVICTED)
            self._end_admission(lease, admission, AdmissionEnd.ABANDONED)
            return
        lease.done_readers.add(admission.reader_rank)
        self._end_admission(lease, admission, AdmissionEnd.READ)
        if lease.lease_id in self._leases and len(lease.done_readers) >= lease.reader_tp_size and not lease.draining:
            self._finish(lease, LeaseEnd.READ)

    def abandon(self, lease_id: str, reader: str, reader_rank: int) -> bool:
        """The reader fenced its READ and gave up; False if it had no open admission.

        Then its PreparePull may still be on its way (see "Proven over late"): the lease refuses
        to admit that reader's rank from now on. (Not a reader without a transfer id, whose key
        names no one pull.)"""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        for admission in list(lease.admissions.values()):
            if admission.reader == reader and admission.reader_rank == reader_rank:
                self._end_admission(lease, admission, AdmissionEnd.ABANDONED)
                return True
        if not reader.endswith("/"):
            lease.abandoned.add((reader, reader_rank))
        return False

    def _end_admission(self, lease: Lease, admission: Admission, how: AdmissionEnd) -> None:
        if lease.admissions.pop(admission.admission_id, None) is None:
            return
        self._open_admissions -= 1
        if not self._open_admissions:
            self._admission_deadline_high = 0.0
        admission.ended = how
        if how is AdmissionEnd.TIMED_OUT:
            self._unproven.add(admission)
        self.on_admission_over(admission)
        if lease.draining and not lease.admissions and lease.ending is not None:
            self._finish(lease, lease.ending)

    # --- ending ---------------------------------------------------------------------------------

    def end(self, lease_id: str, how: LeaseEnd) -> Lease:
        """End the lease now, or once its open admissions are over (it drains meanwhile)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.draining:
            raise UnknownLease(f"no lease {lease_id!r} is held here")
        self._request_end(lease, how)
        return lease

    def _mark_draining(self, lease: Lease, how: LeaseEnd) -> None:
        if lease.ending is None:
            self._draining += 1
        lease.ending = how

    def _request_end(self, lease: Lease, how: LeaseEnd) -> None:
        self._mark_draining(lease, how)
        if not lease.admissions:
            self._finish(lease, how)

    def _finish(self, lease: Lease, how: LeaseEnd) -> None:
        if self._leases.pop(lease.lease_id, None) is None:
            return
        if lease.ending is not None:
            self._draining -= 1
        for admission in list(lease.admissions.values()):  # a completed lease: nothing else reads
            self._end_admission(lease, admission, AdmissionEnd.READ)
        self.on_lease_over(lease, how)

    def sweep(self) -> None:
        """Expire due leases and end admissions past their deadline plus the margin.

        The due entries are popped off the deadline heap, and the leases they concern are then
        taken in the table's order (creation), each exactly as a pass over every lease took it:
        its due admissions in the order they were admitted, then its own expiry. So the ends are
        reported in the same order as before the heap, at O(k log n) for k entries due."""
        now = self._clock()
        popped, due = self._deadlines.pop_due(now)
        for seq in sorted(due):
            lease = due[seq]
            for admission in list(lease.admissions.values()):
                if admission.deadline + self._deadlines.margin_s <= now:
                    # A soft lease's reader that never said FinishRead: if every part arrived,
                    # its READs are over (clean); otherwise not proven over.
                    how = AdmissionEnd.ABANDONED if admission.reads_seen else AdmissionEnd.TIMED_OUT
                    self._end_admission(lease, admission, how)
            if lease.lease_id in self._leases and not lease.draining and lease.expires_at <= now:
                self._request_end(lease, LeaseEnd.EXPIRED)
        self._deadlines.push_back(popped)  # ended above, unless a callback undid that

    def end_all(self, how: LeaseEnd, engine_id: str | None = None) -> None:
        """End every lease (of one engine): they drain while reads are admitted."""
        for lease in list(self._leases.values()):
            if not lease.draining and (engine_id is None or lease.engine_id == engine_id):
                self._request_end(lease, how)

    def end_admissions_if(self, predicate: Callable[[Admission], bool], how: AdmissionEnd) -> int:
        """End every open admission ``predicate`` accepts; how many ended."""
        ended = 0
        for lease in list(self._leases.values()):
            for admission in list(lease.admissions.values()):
                if predicate(admission):
                    self._end_admission(lease, admission, how)
                    ended += 1
        return ended

    def force_end_admissions(self) -> None:
        """Shutdown: end every open admission as not proven over (their memory is retired)."""
        for lease in list(self._leases.values()):
            for admission in list(lease.admissions.values()):
                self._end_admission(lease, admission, AdmissionEnd.TIMED_OUT)

    # --- queries --------------------------------------------------------------------------------

    def of_engine(self, engine_id: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.engine_id == engine_id and not lease.draining]

    def every(self) -> list[Lease]:
        """Leases held or draining."""
        return list(self._leases.values())

    def all(self) -> list[Lease]:
        """Leases held (not draining)."""
        return [lease for lease in self._leases.values() if not lease.draining]

    def remaining_s(self, lease: Lease) -> float:
        return lease.expires_at - self._clock()


def _check_seconds(what: str, seconds: float) -> None:
    """A duration a deadline is computed from: a NaN or infinite one would never come due (a
    lease or admission kept for ever), a non-positive one is over before it starts."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"{what} must be a finite number of seconds > 0, got {seconds}")
