"""Leases: blocks held for a remote reader, with an unguessable id and a deadline.

A lease ends in exactly one of three ways: every reader rank finished reading (the NIXL
notifications say so), someone released it, or it expired. Whoever ends it gets the
:class:`Lease` back exactly once, so the owning engine is told exactly once.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable

from kvd_client.errors import InvalidArgument, LeaseExpired, UnknownLease


@dataclasses.dataclass(eq=False)
class Lease:
    lease_id: str
    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float  # monotonic clock
    reader_tp_size: int = 0  # learned from the first reader
    parts_seen: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # reader rank -> parts read
    done_readers: set[int] = dataclasses.field(default_factory=set)


class LeaseTable:
    """All leases of one daemon. Not thread-safe: used from the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def create(self, engine_id: str, request_id: str, block_ids: tuple[int, ...], num_tokens: int, ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise InvalidArgument(f"lease ttl must be > 0, got {ttl_s}")
        lease = Lease(
            lease_id=secrets.token_urlsafe(18),
            engine_id=engine_id,
            request_id=request_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            expires_at=self._clock() + ttl_s,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        """The live lease; LeaseExpired if its deadline passed (even before the sweeper ran)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id!r} is held here (released, expired and swept, or never granted)")
        if lease.expires_at <= self._clock():
            raise LeaseExpired(f"lease {lease_id!r} on request {lease.request_id!r} expired")
        return lease

    def extend_to(self, lease_id: str, at_least_s: float) -> Lease:
        """Keep the lease alive at least ``at_least_s`` from now (a read is starting)."""
        lease = self.get(lease_id)
        lease.expires_at = max(lease.expires_at, self._clock() + at_least_s)
        return lease

    def renew(self, lease_id: str, ttl_s: float) -> Lease:
        if ttl_s <= 0:
            raise InvalidArgument(f"lease ttl must be > 0, got {ttl_s}")
        lease = self.get(lease_id)
        lease.expires_at = self._clock() + ttl_s
        return lease

    def release(self, lease_id: str) -> Lease:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id!r} is held here")
        return lease

    def record_read(self, lease_id: str, reader_rank: int, part: int, parts: int) -> Lease | None:
        """Note that part ``part`` of ``parts`` of a reader rank's read arrived.

        Returns the lease, removed, once every reader rank has read every part; else None.
        """
        lease = self._leases.get(lease_id)
        if lease is None or parts < 1 or not 0 <= part < parts:
            return None
        if lease.reader_tp_size and not 0 <= reader_rank < lease.reader_tp_size:
            return None  # not a rank of the reader engine: it must not count toward completion
        seen = lease.parts_seen.setdefault(reader_rank, set())
        seen.add(part)
        if len(seen) == parts:
            lease.done_readers.add(reader_rank)
        if lease.reader_tp_size and len(lease.done_readers) >= lease.reader_tp_size:
            return self._leases.pop(lease_id)
        return None

    def expire_due(self) -> list[Lease]:
        """Remove and return every lease past its deadline."""
        now = self._clock()
        due = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in due:
            del self._leases[lease.lease_id]
        return due

    def of_engine(self, engine_id: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.engine_id == engine_id]

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def remaining_s(self, lease: Lease) -> float:
        return lease.expires_at - self._clock()
