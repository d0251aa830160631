"""When each lease and admitted read comes due: the deadline heap of
:class:`~kvd.core.leases.LeaseTable`.

The daemon's sweeper asks for the next deadline and sweeps on every round; a pass over every
lease and admission each time cost milliseconds of the holder's event loop with thousands of
leases out. So deadlines live in a min-heap of ``(when, seq, lease or admission)`` entries, and
:meth:`DeadlineHeap.next` and :meth:`DeadlineHeap.pop_due` cost O(log n) per change and per thing
ended. Every change of a deadline pushes a new entry; the old one is not searched for but left
*stale*: an entry counts only while what it names is still open (a lease in the table and not
draining, an admission in its lease's open ones) and still due exactly then. Stale entries are
dropped as they reach the top, and the heap is rebuilt from the table when they outnumber the
live ones (see HEAP_SLACK).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Mapping

from kvd.core.lease_records import Admission, Lease

logger = logging.getLogger(__name__)

# The deadline heap is rebuilt once it holds more than 3 entries per lease and open admission plus
# this many: stale entries (renewed, ended, draining) then outnumber the live ones more than 2 to
# 1. The slack keeps a table of a few leases from rebuilding on every renewal.
HEAP_SLACK = 64

# A deadline heap entry: when, a sequence number (ties are never compared further), and what is
# due then: a live lease's expiry or an open admission's end (its deadline plus the margin).
Entry = tuple[float, int, "Lease | Admission"]


class DeadlineHeap:
    """The deadlines of a table's ``leases`` (the table's own dict, read, never changed here):
    each live lease's expiry and each open admission's end, its deadline plus ``margin_s``."""

    def __init__(self, leases: Mapping[str, Lease], open_admissions: Callable[[], int], margin_s: float) -> None:
        self._leases = leases
        self._open_admissions = open_admissions  # how many admissions are open (O(1))
        self._margin_s = margin_s
        self._heap: list[Entry] = []  # the deadlines, with stale entries (see the module docstring)
        self._seq = itertools.count()  # ties between equal deadlines: first pushed first

    @property
    def margin_s(self) -> float:
        return self._margin_s

    @margin_s.setter
    def margin_s(self, value: float) -> None:
        # The heap holds each admission's deadline plus the margin: a new margin moves them all.
        self._margin_s = value
        self.rebuild()

    @property
    def entries(self) -> list[Entry]:
        """The heap as it stands, stale entries included (tests check its bounds)."""
        return self._heap

    def next(self) -> float:
        """The earliest live deadline; ``inf`` when there is none.

        The top of the heap, once the stale entries above it are dropped: O(1) when nothing
        changed, O(log n) per stale entry dropped (each is dropped once)."""
        self.compact_if_sparse()
        heap = self._heap
        while heap and self.live_lease(heap[0]) is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else float("inf")

    def push(self, when: float, item: Lease | Admission) -> None:
        """Schedule ``item`` (a lease's expiry, or an admission's end at deadline + margin) at
        ``when``, after setting the field it follows: a lease's ``expires_at`` or an admission's
        ``deadline``. Any entry it had goes stale. A NaN deadline (a NaN ttl or hold passes the
        checks) is never due, as no comparison with it is true: it gets no entry."""
        if when != when:
            return
        heapq.heappush(self._heap, (when, next(self._seq), item))
        self.compact_if_sparse()

    def pop_due(self, now: float) -> tuple[list[Entry], dict[int, Lease]]:
        """Pop the live entries due by ``now``: them, and the leases they concern by
        ``Lease.created_seq`` (the caller ends what is due, then :meth:`push_back`)."""
        heap = self._heap
        popped: list[Entry] = []
        due: dict[int, Lease] = {}  # Lease.created_seq -> a lease with something due
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            lease = self.live_lease(entry)
            if lease is not None:
                popped.append(entry)
                due[lease.created_seq] = lease
        return popped, due

    def push_back(self, popped: list[Entry]) -> None:
        """After a sweep: the entries it popped that are still live (a callback undid their end)
        stay due for the next sweep."""
        for entry in popped:
            if self.live_lease(entry) is not None:
                heapq.heappush(self._heap, entry)
        self.compact_if_sparse()

    def live_lease(self, entry: Entry) -> Lease | None:
        """The lease a heap entry concerns, if the entry is live: its lease (or admission) is still
        open, not draining (a draining lease does not expire; it ends with its last admission),
        and due exactly at the entry's time. None if the entry is stale."""
        when, _, item = entry
        if isinstance(item, Lease):
            live = self._leases.get(item.lease_id) is item and item.ending is None and item.expires_at == when
            return item if live else None
        lease = self._leases.get(item.lease_id)
        if lease is None or lease.admissions.get(item.admission_id) is not item:
            return None
        return lease if item.deadline + self._margin_s == when else None

    def compact_if_sparse(self) -> None:
        """Rebuild the heap when stale entries outnumber live ones more than 2 to 1: each lease
        and open admission has one live entry (or two equal ones, should a renewal bring a deadline
        back to the very value it had: harmless, they are popped together), so beyond 3 per such
        (plus HEAP_SLACK) about twice as many are stale. A rebuild is O(n) and needs as many pushes
        or ends first, so it costs O(1) per push or end: the heap stays O(leases + admissions)."""
        if len(self._heap) > 3 * (len(self._leases) + self._open_admissions()) + HEAP_SLACK:
            self.rebuild()

    def rebuild(self) -> None:
        """One live entry per live lease's expiry and per open admission's end, in table order."""
        before = len(self._heap)
        heap: list[Entry] = []
        seq = self._seq
        margin = self._margin_s
        for lease in self._leases.values():
            if lease.ending is None and lease.expires_at == lease.expires_at:
                heap.append((lease.expires_at, next(seq), lease))
            for admission in lease.admissions.values():
                when = admission.deadline + margin
                if when == when:
                    heap.append((when, next(seq), admission))
        heapq.heapify(heap)
        self._heap = heap
        logger.debug("lease deadline heap rebuilt: %d entries, %d live", before, len(heap))
