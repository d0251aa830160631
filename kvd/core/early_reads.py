"""READ notifications that arrive before the read they belong to is admitted.

A reader may post its NIXL READ beside its PreparePull instead of after the answer (config
``read_beside_admission``, docs/lifetimes.md "A READ beside its admission"): the READ names the
read by the id the reader asks to be admitted under, and its notification can reach the holder
before the admission does. The holder keeps such parts here until the admission claims them
(:meth:`EarlyParts.claim`); they then count exactly as parts that arrived after it.

Bounded against stale and hostile notifications: only a notification of a **live** lease is kept
(a lease id is unguessable; the caller checks), at most :data:`MAX_EARLY_READS` reads at once
(the oldest forgotten first), each at most :data:`MAX_PARTS` parts, and for
:data:`EARLY_READ_TTL_S` at most: an admission that did not claim its parts by then was refused or
never asked for, and its reader is told its pull failed; the parts are then worth nothing.
Event-loop only, owned by :class:`kvd.core.leases.LeaseTable`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

MAX_EARLY_READS = 4096
MAX_PARTS = 1 << 16
# Longer than an admission can take to arrive after its READ's notification (the two leave the
# reader together; a PreparePull that waits on a soft hold's check still arrives first).
EARLY_READ_TTL_S = 60.0


@dataclasses.dataclass(eq=False)
class _Early:
    parts: int
    seen: set[int]
    arrived: float


class EarlyParts:
    """Parts of reads not admitted yet, by (lease id, admission id) (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._reads: dict[tuple[str, str], _Early] = {}  # oldest first (insertion order)
        self.forgotten = 0  # reads dropped unclaimed (expired or crowded out): for tests and logs

    def __len__(self) -> int:
        return len(self._reads)

    def add(self, lease_id: str, admission_id: str, part: int, parts: int) -> None:
        """Keep part ``part`` of ``parts`` of a read not admitted yet."""
        if not 0 <= part < parts <= MAX_PARTS:
            return
        now = self._clock()
        self._expire(now)
        key = (lease_id, admission_id)
        early = self._reads.get(key)
        if early is None:
            if len(self._reads) >= MAX_EARLY_READS:
                del self._reads[next(iter(self._reads))]
                self.forgotten += 1
            early = self._reads[key] = _Early(parts, set(), now)
        if early.parts != parts:  # a part count that disagrees is not the READ the reader posted
            return
        early.seen.add(part)

    def claim(self, lease_id: str, admission_id: str) -> tuple[int, set[int]] | None:
        """The parts that arrived for this read before its admission, as (parts, seen); None if none."""
        self._expire(self._clock())
        early = self._reads.pop((lease_id, admission_id), None)
        return None if early is None else (early.parts, early.seen)

    def _expire(self, now: float) -> None:
        reads = self._reads
        while reads:
            key = next(iter(reads))
            if now - reads[key].arrived < EARLY_READ_TTL_S:
                return
            del reads[key]
            self.forgotten += 1
