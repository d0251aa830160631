"""kvd.core.leases: blocks held for a remote reader, on a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.leases import Lease, LeaseTable
from kvd_client.errors import InvalidArgument, LeaseExpired, UnknownLease


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock=clock)


def _create(table: LeaseTable, ttl: float = 10.0, engine: str = "eng-a", request: str = "req-1") -> Lease:
    return table.create(engine, request, (4, 5, 6), 40, ttl)


# --- create / get -------------------------------------------------------------------------------


def test_create_then_get_returns_the_lease(table: LeaseTable, clock: FakeClock) -> None:
    """A created lease is found by its id, with its fields and a deadline ttl from now."""
    lease = _create(table, ttl=10.0)
    assert table.get(lease.lease_id) is lease
    assert (lease.engine_id, lease.request_id, lease.block_ids, lease.num_tokens) == ("eng-a", "req-1", (4, 5, 6), 40)
    assert lease.expires_at == clock.now + 10.0
    assert table.remaining_s(lease) == 10.0
    assert len(table) == 1 and table.all() == [lease]


def test_lease_ids_are_long_and_distinct(table: LeaseTable) -> None:
    """Lease ids are unguessable: at least 128 bits of randomness, url-safe, never repeated."""
    ids = [_create(table).lease_id for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) >= 22 for i in ids)  # 22 url-safe base64 chars = 132 bits
    assert all(set(i) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") for i in ids)
    # Not derived from the request or the engine, and not sequential.
    assert all("req-1" not in i and "eng-a" not in i for i in ids)
    assert ids != sorted(ids)


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_create_refuses_a_non_positive_ttl(table: LeaseTable, ttl: float) -> None:
    """A lease needs a positive lifetime; nothing is created otherwise."""
    with pytest.raises(InvalidArgument, match="ttl must be > 0"):
        _create(table, ttl=ttl)
    assert len(table) == 0


def test_get_of_an_unknown_id_is_unknown_lease(table: LeaseTable) -> None:
    """An id that was never granted is NOT_FOUND (UnknownLease), naming the id."""
    with pytest.raises(UnknownLease, match="no-such-lease"):
        table.get("no-such-lease")


# --- expiry -------------------------------------------------------------------------------------


def test_get_raises_lease_expired_before_the_sweep(table: LeaseTable, clock: FakeClock) -> None:
    """Once its deadline passes, a lease raises LeaseExpired even though expire_due has not run."""
    lease = _create(table, ttl=5.0)
    clock.advance(4.999)
    assert table.get(lease.lease_id) is lease
    clock.advance(0.001)  # exactly at the deadline: expired
    with pytest.raises(LeaseExpired, match="req-1"):
        table.get(lease.lease_id)
    assert len(table) == 1  # still there until swept


def test_expired_lease_cannot_be_renewed_or_extended(table: LeaseTable, clock: FakeClock) -> None:
    """renew and extend_to of an expired lease raise LeaseExpired and leave its deadline alone."""
    lease = _create(table, ttl=1.0)
    deadline = lease.expires_at
    clock.advance(2.0)
    with pytest.raises(LeaseExpired):
        table.renew(lease.lease_id, 10.0)
    with pytest.raises(LeaseExpired):
        table.extend_to(lease.lease_id, 10.0)
    assert lease.expires_at == deadline


def test_expire_due_removes_exactly_the_due_leases(table: LeaseTable, clock: FakeClock) -> None:
    """expire_due returns and removes the leases at or past their deadline, and only those."""
    short = _create(table, ttl=1.0, request="short")
    exact = _create(table, ttl=2.0, request="exact")
    long = _create(table, ttl=3.0, request="long")
    clock.advance(2.0)
    due = table.expire_due()
    assert {lease.lease_id for lease in due} == {short.lease_id, exact.lease_id}
    assert table.all() == [long]
    assert table.expire_due() == []  # each lease is returned once
    with pytest.raises(UnknownLease):
        table.get(short.lease_id)


@settings(max_examples=100, deadline=None)
@given(
    ttls=st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=0, max_size=20),
    elapsed=st.floats(min_value=0.0, max_value=120.0),
)
def test_expire_due_property(ttls: list[float], elapsed: float) -> None:
    """For any deadlines, expire_due removes the leases with expires_at <= now and keeps the rest."""
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    leases = [table.create("e", f"r{i}", (i,), 1, ttl) for i, ttl in enumerate(ttls)]
    clock.advance(elapsed)
    due = {lease.lease_id for lease in table.expire_due()}
    assert due == {lease.lease_id for lease in leases if lease.expires_at <= clock.now}
    assert {lease.lease_id for lease in table.all()} == {lease.lease_id for lease in leases} - due


# --- renew / extend_to --------------------------------------------------------------------------


def test_renew_sets_a_new_deadline_from_now(table: LeaseTable, clock: FakeClock) -> None:
    """renew(ttl) moves the deadline to now + ttl, shorter or longer than before."""
    lease = _create(table, ttl=10.0)
    clock.advance(3.0)
    assert table.renew(lease.lease_id, 20.0).expires_at == clock.now + 20.0
    assert table.renew(lease.lease_id, 1.0).expires_at == clock.now + 1.0


@pytest.mark.parametrize("ttl", [0.0, -3.0])
def test_renew_refuses_a_non_positive_ttl(table: LeaseTable, ttl: float) -> None:
    """renew with ttl <= 0 is InvalidArgument and changes nothing."""
    lease = _create(table, ttl=10.0)
    deadline = lease.expires_at
    with pytest.raises(InvalidArgument):
        table.renew(lease.lease_id, ttl)
    assert lease.expires_at == deadline


def test_extend_to_only_ever_lengthens(table: LeaseTable, clock: FakeClock) -> None:
    """extend_to keeps a lease alive at least that long from now, never shortening it."""
    lease = _create(table, ttl=10.0)
    deadline = lease.expires_at
    assert table.extend_to(lease.lease_id, 5.0).expires_at == deadline  # already longer
    clock.advance(8.0)
    assert table.extend_to(lease.lease_id, 5.0).expires_at == clock.now + 5.0
    clock.advance(4.9)
    assert table.get(lease.lease_id) is lease  # would have expired without the extension


def test_renew_and_extend_of_unknown_lease(table: LeaseTable) -> None:
    """renew / extend_to of an id never granted raise UnknownLease."""
    with pytest.raises(UnknownLease):
        table.renew("nope", 1.0)
    with pytest.raises(UnknownLease):
        table.extend_to("nope", 1.0)


# --- release ------------------------------------------------------------------------------------


def test_release_returns_the_lease_once(table: LeaseTable) -> None:
    """release removes the lease and returns it; a second release is UnknownLease."""
    lease = _create(table)
    assert table.release(lease.lease_id) is lease
    assert len(table) == 0
    with pytest.raises(UnknownLease):
        table.release(lease.lease_id)
    with pytest.raises(UnknownLease):
        table.get(lease.lease_id)


def test_released_lease_is_not_returned_by_expire_due(table: LeaseTable, clock: FakeClock) -> None:
    """A lease ends exactly once: once released, the sweep never reports it again."""
    lease = _create(table, ttl=1.0)
    table.release(lease.lease_id)
    clock.advance(5.0)
    assert table.expire_due() == []


# --- record_read --------------------------------------------------------------------------------


def test_record_read_completes_when_every_reader_rank_has_every_part(table: LeaseTable) -> None:
    """With reader_tp_size 2, the lease ends only when ranks 0 and 1 each have all their parts."""
    lease = _create(table)
    lease.reader_tp_size = 2  # set by prepare_pull
    assert table.record_read(lease.lease_id, 0, 0, 2) is None
    assert table.record_read(lease.lease_id, 1, 0, 3) is None
    assert table.record_read(lease.lease_id, 0, 1, 2) is None  # rank 0 done, rank 1 not yet
    assert table.record_read(lease.lease_id, 1, 2, 3) is None
    assert len(table) == 1
    assert table.record_read(lease.lease_id, 1, 1, 3) is lease  # rank 1's last part
    assert len(table) == 0
    assert lease.done_readers == {0, 1}


def test_duplicate_parts_are_idempotent(table: LeaseTable) -> None:
    """A part notified twice counts once: it cannot stand in for a missing part."""
    lease = _create(table)
    lease.reader_tp_size = 1
    for _ in range(3):
        assert table.record_read(lease.lease_id, 0, 0, 2) is None
    assert lease.parts_seen == {0: {0}}
    assert table.record_read(lease.lease_id, 0, 1, 2) is lease


def test_a_completed_lease_is_returned_exactly_once(table: LeaseTable) -> None:
    """Notifications after completion (duplicates) return None: the engine is told once."""
    lease = _create(table)
    lease.reader_tp_size = 1
    assert table.record_read(lease.lease_id, 0, 0, 1) is lease
    assert table.record_read(lease.lease_id, 0, 0, 1) is None
    with pytest.raises(UnknownLease):
        table.release(lease.lease_id)


def test_one_rank_reading_twice_does_not_complete_a_two_rank_read(table: LeaseTable) -> None:
    """Rank 0's parts, however many times, do not complete a lease that rank 1 still reads."""
    lease = _create(table)
    lease.reader_tp_size = 2
    for part in (0, 1, 0, 1):
        assert table.record_read(lease.lease_id, 0, part, 2) is None
    assert len(table) == 1


def test_reads_before_the_reader_tp_size_is_known_do_not_complete(table: LeaseTable) -> None:
    """Until prepare_pull sets reader_tp_size, parts are remembered but the lease is not ended."""
    lease = _create(table)
    assert table.record_read(lease.lease_id, 0, 0, 1) is None
    assert len(table) == 1
    lease.reader_tp_size = 2
    assert table.record_read(lease.lease_id, 1, 0, 1) is lease


def test_a_reader_rank_outside_the_reader_tp_is_not_counted(table: LeaseTable) -> None:
    """Only ranks 0..reader_tp_size-1 count: a stray rank 5 cannot stand in for rank 1.

    Ending the lease early would let the holder reuse blocks that rank 1 is still reading.
    """
    lease = _create(table)
    lease.reader_tp_size = 2
    assert table.record_read(lease.lease_id, 0, 0, 1) is None
    assert table.record_read(lease.lease_id, 5, 0, 1) is None
    assert len(table) == 1


@pytest.mark.parametrize(("part", "parts"), [(-1, 2), (2, 2), (0, 0), (3, -1)])
def test_malformed_parts_are_ignored(table: LeaseTable, part: int, parts: int) -> None:
    """A part outside 0..parts-1 (or parts < 1) changes nothing."""
    lease = _create(table)
    lease.reader_tp_size = 1
    assert table.record_read(lease.lease_id, 0, part, parts) is None
    assert lease.parts_seen == {}
    assert len(table) == 1


def test_record_read_of_an_unknown_lease_is_ignored(table: LeaseTable) -> None:
    """A notification for a lease not held here returns None and raises nothing."""
    assert table.record_read("gone", 0, 0, 1) is None


@settings(max_examples=200, deadline=None)
@given(
    reader_tp=st.integers(1, 4),
    parts_of=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    order=st.randoms(use_true_random=False),
    dup=st.integers(0, 3),
)
def test_record_read_property(reader_tp: int, parts_of: list[int], order: object, dup: int) -> None:
    """In any order with duplicates, the lease ends exactly at the notification completing the last rank."""
    table = LeaseTable(clock=FakeClock())
    lease = table.create("e", "r", (0,), 1, 10.0)
    lease.reader_tp_size = reader_tp
    notes = [(rank, part, parts_of[rank]) for rank in range(reader_tp) for part in range(parts_of[rank])]
    notes += notes[:dup]
    order.shuffle(notes)  # type: ignore[attr-defined]
    seen: set[tuple[int, int]] = set()
    ended = 0
    for rank, part, parts in notes:
        seen.add((rank, part))
        result = table.record_read(lease.lease_id, rank, part, parts)
        complete = all((r, p) in seen for r in range(reader_tp) for p in range(parts_of[r]))
        if result is not None:
            ended += 1
            assert result is lease and complete
        elif ended == 0:
            assert not complete
    assert ended == 1
    assert len(table) == 0


# --- of_engine ----------------------------------------------------------------------------------


def test_of_engine_lists_only_that_engines_leases(table: LeaseTable) -> None:
    """of_engine returns the leases held for one engine (to release them when it dies)."""
    a1 = _create(table, engine="a")
    a2 = _create(table, engine="a", request="req-2")
    _create(table, engine="b")
    assert {lease.lease_id for lease in table.of_engine("a")} == {a1.lease_id, a2.lease_id}
    assert table.of_engine("nobody") == []
    table.release(a1.lease_id)
    assert table.of_engine("a") == [a2]
