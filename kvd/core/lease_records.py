"""What a lease and a read admitted on it are: the records :class:`~kvd.core.leases.LeaseTable`
keeps, and the ways each ends.

Plain data: the table alone changes a deadline (``Lease.expires_at``, ``Admission.deadline``),
since its deadline heap follows every change (kvd.core.lease_deadlines). What the fields mean
for a holder's memory and a reader: kvd.core.leases and docs/lifetimes.md.
"""

from __future__ import annotations

import dataclasses
import enum


class LeaseEnd(enum.Enum):
    READ = "read"
    RELEASED = "released"
    EXPIRED = "expired"
    ENGINE_GONE = "engine_gone"
    SHUTDOWN = "shutdown"
    ABORTED = "aborted"  # the reading side said nobody will read (aborted, rejected, recomputed)
    EVICTED = "evicted"  # a soft hold's blocks no longer hold its KV (the engine evicted or reused them)


class AdmissionEnd(enum.Enum):
    READ = "read"  # every part arrived: the reader's READs are complete
    ABANDONED = "abandoned"  # the reader fenced its READs and gave up
    REPLACED = "replaced"  # the same reader asked again before posting anything
    TIMED_OUT = "timed_out"  # past its deadline plus the margin: not proven over
    WORKER_LOST = "worker_lost"  # the holder's data-plane worker died: nothing is read out of it any more

    @property
    def clean(self) -> bool:
        """True when no byte of the read can still move (the holder's memory may be unmapped)."""
        return self is not AdmissionEnd.TIMED_OUT


@dataclasses.dataclass(eq=False)
class Admission:
    admission_id: str
    lease_id: str
    reader: str  # "<reader incarnation>/<reader transfer id>"
    reader_rank: int
    # Monotonic. Set only by LeaseTable: its deadline heap holds deadline + margin (kvd.core.lease_deadlines).
    deadline: float
    parts_seen: set[int] = dataclasses.field(default_factory=set)
    parts: int = 0  # how many parts the reader posts (learned from its notifications)
    # Holder memory pinned for this read (kvd.core.local_memory.LocalMemory), owned by the daemon.
    pinned: list[object] = dataclasses.field(default_factory=list)
    ended: AdmissionEnd | None = None
    soft_pinned: bool = False  # a soft lease's blocks are pinned by the engine for this read
    # Holder memory this read left tainted (it ended not proven over), owned by the daemon: the
    # taint is lifted when the read is proven over late (LeaseTable.record_read, prove_abandoned).
    tainted: list[object] = dataclasses.field(default_factory=list)

    @property
    def reads_seen(self) -> bool:
        """Every part's notification arrived: none of the reader's READs is still moving."""
        return self.parts > 0 and len(self.parts_seen) >= self.parts


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: str
    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    # Monotonic clock. Set only by LeaseTable: its deadline heap follows every change (kvd.core.lease_deadlines).
    expires_at: float
    # Block ids of the KV cache groups after group 0 (hybrid models), one tuple per group.
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    reader_tp_size: int = 0  # learned from the first reader
    done_readers: set[int] = dataclasses.field(default_factory=set)
    admissions: dict[str, Admission] = dataclasses.field(default_factory=dict)  # open ones
    # (reader, reader rank) that said AbandonPull while no read of theirs was admitted: a late
    # PreparePull of that reader is refused (the reader's pull is over; nobody would read).
    abandoned: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    ending: LeaseEnd | None = None  # set while draining
    ttl_s: float = 0.0  # what a renewal without a ttl extends it by (the reader's heartbeats)
    # A soft hold: the engine did not keep the blocks; each read is verified (and the blocks
    # pinned) by the engine's scheduler, and the reader ends its read with FinishRead.
    soft: bool = False
    # The table's count of leases created before this one: sweep() ends due leases in this order
    # (the order of the table's dict, which a pass over every lease followed).
    created_seq: int = dataclasses.field(default=0, repr=False)

    @property
    def draining(self) -> bool:
        return self.ending is not None
