"""Reads that timed out, kept for a proof that comes late.

A timed-out admission taints the holder memory it pinned, but its proof may still come: every
part's NIXL notification, or its reader's AbandonPull (its READs are final). Until then the read
is *unproven*; once proven over, the taint is lifted (docs/lifetimes.md). The last MAX_UNPROVEN
are kept; an older one is forgotten, and the memory it tainted stays retired for the daemon's
life. :class:`~kvd.core.leases.LeaseTable` owns one :class:`UnprovenReads`.
"""

from __future__ import annotations

from kvd.core.lease_records import Admission

# Timed-out admissions kept for a late proof; beyond this many the oldest is forgotten, and the
# memory it tainted stays retired for the daemon's life.
MAX_UNPROVEN = 4096


class UnprovenReads:
    """Timed-out admissions by (lease id, admission id), oldest first. Event-loop only.

    (Keyed with the lease: a reader may name its read, kvd.core.early_reads.)"""

    def __init__(self) -> None:
        self._reads: dict[tuple[str, str], Admission] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._reads

    def add(self, admission: Admission) -> None:
        """A read timed out, not proven over: keep it (forgetting the oldest beyond MAX_UNPROVEN)."""
        self._reads[(admission.lease_id, admission.admission_id)] = admission
        if len(self._reads) > MAX_UNPROVEN:
            del self._reads[next(iter(self._reads))]

    def record_part(self, lease_id: str, admission_id: str, part: int, parts: int) -> Admission | None:
        """A notification of a read that is no longer open: if it timed out, count the part; once
        every part arrived its READs are over, and it is returned (proven over late)."""
        admission = self._reads.get((lease_id, admission_id))
        if admission is None:
            return None
        admission.parts_seen.add(part)
        admission.parts = parts
        if not admission.reads_seen:
            return None
        del self._reads[(lease_id, admission_id)]
        return admission

    def prove_abandoned(self, lease_id: str, reader: str, reader_rank: int) -> Admission | None:
        """The reader's AbandonPull (its READs are final) for a read that already timed out:
        that read, proven over late, or None if none of that reader timed out on the lease."""
        for key, admission in self._reads.items():
            if admission.lease_id == lease_id and admission.reader == reader and admission.reader_rank == reader_rank:
                del self._reads[key]
                return admission
        return None
