"""kvd.core.leases: blocks held for a remote reader and the reads admitted on them, on a fake clock."""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lifetime_fakes import FakeClock

from kvd.core import late_proofs, lease_deadlines
from kvd.core.leases import Admission, AdmissionEnd, Lease, LeaseEnd, LeaseTable
from kvd_client.errors import FailedPrecondition, InvalidArgument, LeaseExpired, UnknownLease

MARGIN = 5.0
HOLD = 30.0


class Recorder:
    """The table's callbacks, recorded in order."""

    def __init__(self) -> None:
        self.admissions: list[tuple[str, AdmissionEnd]] = []
        self.leases: list[tuple[str, LeaseEnd]] = []

    def admission_over(self, admission: Admission) -> None:
        assert admission.ended is not None
        self.admissions.append((admission.admission_id, admission.ended))

    def lease_over(self, lease: Lease, how: LeaseEnd) -> None:
        self.leases.append((lease.lease_id, how))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ends() -> Recorder:
    return Recorder()


@pytest.fixture
def woken() -> list[float]:
    """Each on_new_deadline call (the sweeper woken), as the fake clock's time."""
    return []


@pytest.fixture
def table(clock: FakeClock, ends: Recorder, woken: list[float]) -> LeaseTable:
    return LeaseTable(
        clock=clock,
        on_admission_over=ends.admission_over,
        on_lease_over=ends.lease_over,
        admission_margin_s=MARGIN,
        on_new_deadline=lambda: woken.append(clock.now),
    )


def _create(table: LeaseTable, ttl: float = 10.0, engine: str = "eng-a", request: str = "req-1") -> Lease:
    return table.create(engine, request, (4, 5, 6), 40, ttl)


def _admit(table: LeaseTable, lease: Lease, rank: int = 0, tp: int = 1, reader: str = "inc-1/t1") -> Admission:
    return table.admit(lease.lease_id, reader, rank, tp, HOLD)


def _read_all(table: LeaseTable, lease: Lease, admission: Admission, parts: int = 1) -> None:
    for part in range(parts):
        table.record_read(lease.lease_id, admission.admission_id, part, parts)


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
    assert all("req-1" not in i and "eng-a" not in i for i in ids)
    assert ids != sorted(ids)


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_create_refuses_a_ttl_that_is_not_a_finite_positive_time(
    table: LeaseTable, ttl: float, woken: list[float]
) -> None:
    """A lease needs a positive, finite lifetime (a NaN or infinite one would never come due:
    blocks held for ever); nothing is created, no deadline pushed, the sweeper not woken."""
    with pytest.raises(InvalidArgument, match="lease ttl must be a finite number of seconds > 0"):
        _create(table, ttl=ttl)
    assert len(table) == 0 and table.every() == [] and table._deadlines.entries == [] and woken == []


def test_get_of_an_unknown_id_is_unknown_lease(table: LeaseTable) -> None:
    """An id that was never granted is NOT_FOUND (UnknownLease), naming the id."""
    with pytest.raises(UnknownLease, match="no-such-lease"):
        table.get("no-such-lease")


# --- expiry and renewal -------------------------------------------------------------------------


def test_get_raises_lease_expired_before_the_sweep(table: LeaseTable, clock: FakeClock) -> None:
    """Past its deadline a lease is LeaseExpired at once, even before the sweeper removed it."""
    lease = _create(table, ttl=5.0)
    clock.advance(5.0)
    with pytest.raises(LeaseExpired, match="req-1"):
        table.get(lease.lease_id)


def test_expired_lease_cannot_be_renewed_or_admitted(table: LeaseTable, clock: FakeClock) -> None:
    """Renewing or admitting a read of an expired lease fails; its deadline is not moved."""
    lease = _create(table, ttl=5.0)
    clock.advance(6.0)
    with pytest.raises(LeaseExpired):
        table.renew(lease.lease_id, 10.0)
    with pytest.raises(LeaseExpired):
        _admit(table, lease)
    assert lease.expires_at == 1005.0


def test_sweep_ends_exactly_the_due_leases(table: LeaseTable, clock: FakeClock, ends: Recorder) -> None:
    """The sweep ends every lease whose deadline passed (once, as expired) and keeps the others."""
    short = _create(table, ttl=1.0)
    due = _create(table, ttl=2.0)
    long = _create(table, ttl=3.0)
    clock.advance(2.0)
    table.sweep()
    assert ends.leases == [(short.lease_id, LeaseEnd.EXPIRED), (due.lease_id, LeaseEnd.EXPIRED)]
    assert table.all() == [long]
    table.sweep()
    assert len(ends.leases) == 2


@settings(deadline=None, max_examples=100)
@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=20), st.floats(0.0, 120.0))
def test_sweep_property(ttls: list[float], elapsed: float) -> None:
    """Whatever the ttls and elapsed time: swept = due, kept = not due, each ended once."""
    clock, ends = FakeClock(), Recorder()
    table = LeaseTable(clock=clock, on_lease_over=ends.lease_over)
    leases = [table.create("e", f"r{i}", (0,), 1, ttl) for i, ttl in enumerate(ttls)]
    clock.advance(elapsed)
    table.sweep()
    table.sweep()
    swept = {lease_id for lease_id, _ in ends.leases}
    assert len(swept) == len(ends.leases)
    assert swept == {lease.lease_id for lease in leases if lease.expires_at <= clock.now}
    assert {lease.lease_id for lease in table.all()} == {lease.lease_id for lease in leases} - swept


def test_renew_sets_a_new_deadline_from_now(table: LeaseTable, clock: FakeClock) -> None:
    """Renew moves the deadline to now + ttl (it may shorten it too)."""
    lease = _create(table, ttl=10.0)
    clock.advance(4.0)
    table.renew(lease.lease_id, 3.0)
    assert lease.expires_at == clock.now + 3.0


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_renew_refuses_a_ttl_that_is_not_a_finite_positive_time(table: LeaseTable, ttl: float) -> None:
    lease = _create(table)
    before, heap = lease.expires_at, list(table._deadlines.entries)
    with pytest.raises(InvalidArgument, match="lease ttl must be a finite number of seconds > 0"):
        table.renew(lease.lease_id, ttl)
    assert lease.expires_at == before and table._deadlines.entries == heap


@pytest.mark.parametrize("hold", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_admit_refuses_a_hold_that_is_not_a_finite_positive_time(table: LeaseTable, hold: float) -> None:
    """An admission pins the holder's memory until its deadline: one that never comes (NaN,
    infinity) or is already past is refused, and nothing is admitted or pinned."""
    lease = _create(table)
    before = lease.expires_at
    with pytest.raises(InvalidArgument, match="admission's hold must be a finite number of seconds > 0"):
        table.admit(lease.lease_id, "inc-1/t1", 0, 1, hold)
    assert lease.admissions == {} and table.open_admissions == 0 and lease.expires_at == before


def test_an_admission_keeps_the_lease_alive_for_its_read(table: LeaseTable, clock: FakeClock) -> None:
    """Admitting a read extends the lease to at least the read's deadline, never shortens it."""
    lease = _create(table, ttl=2.0)
    _admit(table, lease)
    assert lease.expires_at == clock.now + HOLD
    long = _create(table, ttl=100.0)
    _admit(table, long)
    assert long.expires_at == clock.now + 100.0


def test_renew_and_admit_of_unknown_lease(table: LeaseTable) -> None:
    with pytest.raises(UnknownLease):
        table.renew("nope", 5.0)
    with pytest.raises(UnknownLease):
        table.admit("nope", "r/t", 0, 1, HOLD)


# --- ending without readers ---------------------------------------------------------------------


def test_end_reports_the_lease_once(table: LeaseTable, ends: Recorder) -> None:
    """Ending a lease with no admitted read ends it at once; a second end is UnknownLease."""
    lease = _create(table)
    table.end(lease.lease_id, LeaseEnd.RELEASED)
    assert ends.leases == [(lease.lease_id, LeaseEnd.RELEASED)]
    with pytest.raises(UnknownLease):
        table.end(lease.lease_id, LeaseEnd.RELEASED)
    assert len(ends.leases) == 1 and len(table) == 0


def test_a_released_lease_does_not_expire_later(table: LeaseTable, clock: FakeClock, ends: Recorder) -> None:
    lease = _create(table, ttl=1.0)
    table.end(lease.lease_id, LeaseEnd.RELEASED)
    clock.advance(10.0)
    table.sweep()
    assert ends.leases == [(lease.lease_id, LeaseEnd.RELEASED)]


# --- reads --------------------------------------------------------------------------------------


def test_the_lease_ends_when_every_reader_rank_has_every_part(table: LeaseTable, ends: Recorder) -> None:
    """A TP-2 reader, 3 parts each: ended (as read) only by the last part of the last rank."""
    lease = _create(table)
    a0, a1 = _admit(table, lease, rank=0, tp=2, reader="i/t0"), _admit(table, lease, rank=1, tp=2, reader="i/t1")
    for part in range(3):
        table.record_read(lease.lease_id, a0.admission_id, part, 3)
    assert ends.leases == [] and ends.admissions == [(a0.admission_id, AdmissionEnd.READ)]
    table.record_read(lease.lease_id, a1.admission_id, 0, 3)
    table.record_read(lease.lease_id, a1.admission_id, 2, 3)
    assert ends.leases == []
    table.record_read(lease.lease_id, a1.admission_id, 1, 3)
    assert ends.leases == [(lease.lease_id, LeaseEnd.READ)]
    assert ends.admissions[-1] == (a1.admission_id, AdmissionEnd.READ)


def test_duplicate_parts_are_idempotent(table: LeaseTable, ends: Recorder) -> None:
    lease = _create(table)
    admission = _admit(table, lease)
    for _ in range(3):
        table.record_read(lease.lease_id, admission.admission_id, 0, 2)
    assert ends.leases == []
    table.record_read(lease.lease_id, admission.admission_id, 1, 2)
    table.record_read(lease.lease_id, admission.admission_id, 1, 2)
    assert ends.leases == [(lease.lease_id, LeaseEnd.READ)]


@pytest.mark.parametrize(("part", "parts"), [(-1, 2), (2, 2), (0, 0), (3, -1)])
def test_malformed_parts_are_ignored(table: LeaseTable, ends: Recorder, part: int, parts: int) -> None:
    lease = _create(table)
    admission = _admit(table, lease)
    table.record_read(lease.lease_id, admission.admission_id, part, parts)
    assert ends.leases == [] and admission.parts_seen == set()


def test_notifications_of_unknown_leases_or_admissions_are_ignored(table: LeaseTable, ends: Recorder) -> None:
    """A forged or stale notification (unknown lease, unknown or replaced admission) counts nothing."""
    lease = _create(table)
    admission = _admit(table, lease)
    table.record_read("no-such-lease", admission.admission_id, 0, 1)
    table.record_read(lease.lease_id, "forged-admission", 0, 1)
    assert ends.leases == [] and admission.parts_seen == set()
    replaced = admission
    admission = _admit(table, lease)  # the same reader asks again
    table.record_read(lease.lease_id, replaced.admission_id, 0, 1)
    assert ends.leases == []
    _read_all(table, lease, admission)
    assert ends.leases == [(lease.lease_id, LeaseEnd.READ)]


@settings(deadline=None, max_examples=150)
@given(st.integers(1, 4), st.lists(st.integers(1, 5), min_size=4, max_size=4), st.randoms(use_true_random=False))
def test_record_read_property(reader_tp: int, parts_of: list[int], rng: random.Random) -> None:
    """Any interleaving (with duplicates) ends the lease exactly once, exactly at the last new part."""
    clock, ends = FakeClock(), Recorder()
    table = LeaseTable(clock=clock, on_admission_over=ends.admission_over, on_lease_over=ends.lease_over)
    lease = table.create("e", "r", (0,), 1, 10.0)
    admissions = [table.admit(lease.lease_id, f"i/t{r}", r, reader_tp, HOLD) for r in range(reader_tp)]
    events = [(r, p) for r in range(reader_tp) for p in range(parts_of[r])]
    events += rng.sample(events, k=min(3, len(events)))  # duplicates
    rng.shuffle(events)
    seen: set[tuple[int, int]] = set()
    for rank, part in events:
        table.record_read(lease.lease_id, admissions[rank].admission_id, part, parts_of[rank])
        seen.add((rank, part))
        complete = len(seen) == sum(parts_of[:reader_tp])
        assert bool(ends.leases) == complete
    assert ends.leases == [(lease.lease_id, LeaseEnd.READ)]
    assert sorted(a for a, _ in ends.admissions) == sorted(a.admission_id for a in admissions)


# --- one reader per rank ------------------------------------------------------------------------


def test_a_second_reader_of_a_rank_is_refused_while_the_first_reads(table: LeaseTable, ends: Recorder) -> None:
    """Two readers race for one lease: the second is FAILED_PRECONDITION; the first is unaffected."""
    lease = _create(table)
    first = _admit(table, lease, reader="inc-1/t1")
    with pytest.raises(FailedPrecondition, match="another reader of rank 0"):
        _admit(table, lease, reader="inc-2/t9")
    assert list(lease.admissions) == [first.admission_id]
    _read_all(table, lease, first)
    assert ends.leases == [(lease.lease_id, LeaseEnd.READ)]


def test_the_same_reader_asking_again_replaces_its_admission(table: LeaseTable, ends: Recorder) -> None:
    lease = _create(table)
    first = _admit(table, lease)
    second = _admit(table, lease)
    assert ends.admissions == [(first.admission_id, AdmissionEnd.REPLACED)]
    assert list(lease.admissions) == [second.admission_id]


def test_a_rank_that_read_the_lease_cannot_read_it_again(table: LeaseTable) -> None:
    lease = _create(table)
    _admit(table, lease, rank=0, tp=2, reader="i/t0")
    done = lease.admissions[next(iter(lease.admissions))]
    _read_all(table, lease, done)
    with pytest.raises(FailedPrecondition, match="already read"):
        _admit(table, lease, rank=0, tp=2, reader="i/t5")


def test_readers_of_another_tp_size_are_refused(table: LeaseTable) -> None:
    lease = _create(table)
    _admit(table, lease, rank=0, tp=2)
    with pytest.raises(InvalidArgument, match="TP-2"):
        _admit(table, lease, rank=0, tp=4, reader="other/t")


# --- draining -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", [LeaseEnd.RELEASED, LeaseEnd.ENGINE_GONE])
def test_ending_a_lease_with_an_admitted_read_drains_until_the_read_completes(
    table: LeaseTable, ends: Recorder, how: LeaseEnd
) -> None:
    """Release (or engine gone) during an admitted read: the engine is not told until the read ends."""
    lease = _create(table)
    admission = _admit(table, lease)
    if how is LeaseEnd.RELEASED:
        table.end(lease.lease_id, how)
    else:
        table.end_all(how, "eng-a")
    assert ends.leases == [] and lease.draining and table.draining == 1 and len(table) == 0
    with pytest.raises(UnknownLease):
        table.get(lease.lease_id)
    with pytest.raises(UnknownLease):
        _admit(table, lease, reader="late/t")
    _read_all(table, lease, admission)
    assert ends.leases == [(lease.lease_id, how)]
    assert table.draining == 0


def test_expiry_during_an_admitted_read_drains(table: LeaseTable, clock: FakeClock, ends: Recorder) -> None:
    lease = _create(table, ttl=1.0)
    admission = _admit(table, lease)
    table.renew(lease.lease_id, 1.0)  # a renewal may shorten the lease below the read's deadline
    clock.advance(2.0)
    table.sweep()
    assert ends.leases == [] and lease.draining
    table.abandon(lease.lease_id, admission.reader, admission.reader_rank)
    assert ends.leases == [(lease.lease_id, LeaseEnd.EXPIRED)]
    assert ends.admissions == [(admission.admission_id, AdmissionEnd.ABANDONED)]


def test_an_admission_past_its_deadline_and_margin_times_out_unclean(
    table: LeaseTable, clock: FakeClock, ends: Recorder
) -> None:
    """A reader that never finishes: the admission ends (not proven over) after deadline + margin."""
    lease = _create(table, ttl=1.0)
    admission = _admit(table, lease)
    table.end(lease.lease_id, LeaseEnd.RELEASED)
    clock.advance(HOLD + MARGIN - 0.1)
    table.sweep()
    assert ends.leases == []
    clock.advance(0.2)
    table.sweep()
    assert ends.admissions == [(admission.admission_id, AdmissionEnd.TIMED_OUT)]
    assert not AdmissionEnd.TIMED_OUT.clean and AdmissionEnd.ABANDONED.clean and AdmissionEnd.READ.clean
    assert ends.leases == [(lease.lease_id, LeaseEnd.RELEASED)]


def _timed_out(table: LeaseTable, clock: FakeClock, lease: Lease, reader: str = "inc-1/t1") -> Admission:
    admission = _admit(table, lease, reader=reader)
    clock.advance(HOLD + MARGIN + 0.1)
    table.sweep()
    assert admission.ended is AdmissionEnd.TIMED_OUT
    return admission


def test_a_timed_out_read_is_proven_over_late_once_every_part_arrived(
    table: LeaseTable, clock: FakeClock, ends: Recorder
) -> None:
    """A stalled holder (stopped, or its loop starved) sweeps before the reader's notifications,
    which were already on their way: the read timed out, but its READs did end. Every part
    arriving late proves it over (returned once); one part alone does not."""
    lease = _create(table)
    admission = _timed_out(table, clock, lease)
    assert table.unproven == 1
    assert table.record_read(lease.lease_id, admission.admission_id, 0, 2) is None  # one part of two
    assert table.record_read(lease.lease_id, admission.admission_id, 0, 2) is None  # a duplicate counts nothing
    assert table.record_read(lease.lease_id, admission.admission_id, 1, 2) is admission
    assert table.unproven == 0
    assert table.record_read(lease.lease_id, admission.admission_id, 1, 2) is None  # proven once
    assert ends.admissions == [(admission.admission_id, AdmissionEnd.TIMED_OUT)]  # no second end


def test_parts_seen_before_the_timeout_count_towards_the_late_proof(table: LeaseTable, clock: FakeClock) -> None:
    lease = _create(table)
    admission = _admit(table, lease)
    table.record_read(lease.lease_id, admission.admission_id, 1, 2)
    clock.advance(HOLD + MARGIN + 0.1)
    table.sweep()
    assert admission.ended is AdmissionEnd.TIMED_OUT
    assert table.record_read(lease.lease_id, admission.admission_id, 0, 2) is admission


def test_a_late_part_must_name_the_timed_out_reads_lease(table: LeaseTable, clock: FakeClock) -> None:
    """A forged or stale notification proves nothing: another lease id, or a read that ended clean."""
    lease = _create(table)
    admission = _timed_out(table, clock, lease)
    assert table.record_read("another-lease", admission.admission_id, 0, 1) is None
    other = _create(table, request="req-2")
    clean = _admit(table, other, reader="inc-1/t2")
    assert table.abandon(other.lease_id, "inc-1/t2", 0)
    assert table.record_read(other.lease_id, clean.admission_id, 0, 1) is None
    assert table.unproven == 1


def test_a_timed_out_read_is_proven_over_late_by_its_readers_abandon(table: LeaseTable, clock: FakeClock) -> None:
    """The reader's AbandonPull (its READs are final) after the timeout: that read, once; only its
    own reader's (incarnation and transfer) and rank's."""
    lease = _create(table)
    admission = _timed_out(table, clock, lease)
    assert table.prove_abandoned(lease.lease_id, "inc-2/t1", 0) is None
    assert table.prove_abandoned(lease.lease_id, "inc-1/t1", 1) is None
    assert table.prove_abandoned("nope", "inc-1/t1", 0) is None
    assert table.prove_abandoned(lease.lease_id, "inc-1/t1", 0) is admission
    assert table.prove_abandoned(lease.lease_id, "inc-1/t1", 0) is None
    assert table.unproven == 0


def test_only_the_latest_timed_out_reads_wait_for_a_late_proof(
    table: LeaseTable, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(late_proofs, "MAX_UNPROVEN", 3)
    timed_out = [_timed_out(table, clock, _create(table, request=f"r{i}"), reader=f"inc-1/t{i}") for i in range(5)]
    assert table.unproven == 3
    first, last = timed_out[0], timed_out[-1]
    assert table.prove_abandoned(first.lease_id, first.reader, 0) is None  # forgotten: stays tainted
    assert table.prove_abandoned(last.lease_id, last.reader, 0) is last


def test_an_abandon_before_the_admission_refuses_that_readers_late_prepare_pull(
    table: LeaseTable, ends: Recorder
) -> None:
    """An AbandonPull that overtook its PreparePull (the call withdrawn, or the abandon sent on a
    new stream): the late PreparePull of that reader is not admitted, so it cannot time out and
    taint the holder's memory. Other readers, and a reader without a transfer id, still are."""
    lease = _create(table)
    assert not table.abandon(lease.lease_id, "inc-1/t1", 0)
    with pytest.raises(FailedPrecondition, match="abandoned its read"):
        _admit(table, lease, reader="inc-1/t1")
    assert table.open_admissions == 0 and ends.admissions == []
    _admit(table, lease, rank=1, tp=2, reader="inc-1/t1")  # its other rank asked nothing yet
    _admit(table, lease, rank=0, tp=2, reader="inc-1/t9")  # the reader's next pull: another transfer
    other = _create(table, request="req-2")
    assert not table.abandon(other.lease_id, "inc-1/", 0)
    _admit(table, other, reader="inc-1/")


def test_abandon_names_the_reader(table: LeaseTable, ends: Recorder) -> None:
    """Only the admitted reader's abandon ends its admission."""
    lease = _create(table)
    admission = _admit(table, lease, reader="inc-1/t1")
    assert not table.abandon(lease.lease_id, "inc-2/t1", 0)
    assert not table.abandon(lease.lease_id, "inc-1/t1", 1)
    assert not table.abandon("nope", "inc-1/t1", 0)
    assert ends.admissions == []
    assert table.abandon(lease.lease_id, "inc-1/t1", 0)
    assert ends.admissions == [(admission.admission_id, AdmissionEnd.ABANDONED)]
    assert ends.leases == [] and table.get(lease.lease_id) is lease  # the lease itself is still held


def test_force_end_admissions_ends_them_unclean_and_drained_leases_end(table: LeaseTable, ends: Recorder) -> None:
    lease = _create(table)
    admission = _admit(table, lease)
    table.end_all(LeaseEnd.SHUTDOWN)
    table.force_end_admissions()
    assert ends.admissions == [(admission.admission_id, AdmissionEnd.TIMED_OUT)]
    assert ends.leases == [(lease.lease_id, LeaseEnd.SHUTDOWN)]


def test_of_engine_lists_only_that_engines_held_leases(table: LeaseTable) -> None:
    a = _create(table, engine="eng-a")
    b = _create(table, engine="eng-b")
    draining = _create(table, engine="eng-a")
    _admit(table, draining)
    table.end(draining.lease_id, LeaseEnd.RELEASED)
    assert table.of_engine("eng-a") == [a]
    assert table.of_engine("eng-b") == [b]
    assert table.of_engine("eng-c") == []


# --- counts kept as admissions open and end ---------------------------------------------------------


def _recount(table: LeaseTable) -> int:
    return sum(len(lease.admissions) for lease in table.every())


def test_open_admissions_and_the_fast_poll_deadline_follow_every_way_an_admission_ends(
    table: LeaseTable, clock: FakeClock
) -> None:
    first, second, third = _create(table, request="r1"), _create(table, request="r2"), _create(table, request="r3")
    a = _admit(table, first)
    clock.advance(1.0)
    b = _admit(table, second, rank=0, tp=2)
    c = _admit(table, second, rank=1, tp=2)
    d = _admit(table, third)
    assert table.open_admissions == _recount(table) == 4
    assert table.latest_admission_deadline() == max(a.deadline, b.deadline, c.deadline, d.deadline)
    _read_all(table, first, a)  # read: ends the admission and the lease
    _admit(table, second, rank=1, tp=2)  # the same reader again: replaces c
    assert table.abandon(third.lease_id, d.reader, d.reader_rank)
    assert table.open_admissions == _recount(table) == 2
    assert table.latest_admission_deadline() >= max(b.deadline, c.deadline)  # a bound, never lower
    table.end(second.lease_id, LeaseEnd.RELEASED)  # drains until its reads are over
    clock.advance(HOLD + MARGIN + 1)
    table.sweep()  # the rest time out
    assert table.open_admissions == _recount(table) == 0
    assert table.latest_admission_deadline() == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 1)), max_size=40))
def test_open_admissions_is_the_count_of_open_admissions_after_any_sequence(ops: list[tuple[int, int, int]]) -> None:
    clock = FakeClock()
    table = LeaseTable(clock=clock, admission_margin_s=MARGIN)
    leases = [table.create("eng", f"r{i}", (1, 2), 20, 50.0) for i in range(3)]
    for op, index, rank in ops:
        lease = leases[index % 3]
        live = table.find(lease.lease_id) is not None and not lease.draining
        if op == 0 and live:
            with contextlib.suppress(FailedPrecondition, InvalidArgument, LeaseExpired, UnknownLease):
                table.admit(lease.lease_id, f"reader-{rank}", rank, 2, HOLD)
        elif op == 1:
            table.abandon(lease.lease_id, f"reader-{rank}", rank)
        elif op == 2:
            for admission in list(lease.admissions.values()):
                table.record_read(lease.lease_id, admission.admission_id, 0, 1)
        elif op == 3 and live:
            table.end(lease.lease_id, LeaseEnd.RELEASED)
        elif op == 4:
            clock.advance(20.0)
            table.sweep()
        assert table.open_admissions == _recount(table)
        if not table.open_admissions:
            assert table.latest_admission_deadline() == 0.0


# --- the sweeper's schedule ---------------------------------------------------------------------


def test_next_deadline_is_the_earliest_expiry_or_admission_end(clock: FakeClock) -> None:
    """The daemon's sweeper sleeps until next_deadline: a live lease's expiry, or an open
    admission's deadline plus the margin, whichever comes first; nothing held: never."""
    woken: list[float] = []
    table = LeaseTable(clock=clock, admission_margin_s=MARGIN, on_new_deadline=lambda: woken.append(clock.now))
    assert table.next_deadline() == float("inf")
    lease = _create(table, ttl=10.0)
    assert table.next_deadline() == clock.now + 10.0
    admission = _admit(table, lease)  # HOLD 30 s: the lease lives until the read's deadline
    assert table.next_deadline() == admission.deadline  # the lease's expiry, stretched to it
    table.end(lease.lease_id, LeaseEnd.RELEASED)  # draining: only the admission's end is due
    assert lease.draining
    assert table.next_deadline() == admission.deadline + MARGIN
    other = _create(table, ttl=2.0, request="req-2")
    assert table.next_deadline() == clock.now + 2.0
    table.renew(other.lease_id, 1.0)  # a renewal may bring the expiry nearer
    assert table.next_deadline() == clock.now + 1.0
    assert len(woken) == 4  # create, admit, create, renew: each may bring a deadline nearer
    table.renew(other.lease_id, 1.0)  # the same deadline: nothing to wake for
    third = _create(table, ttl=1.0, request="req-3")
    table.renew(third.lease_id, 50.0)  # later: the sweeper's wake-up at the old time finds nothing
    assert len(woken) == 5  # only the create
    assert table.next_deadline() == clock.now + 1.0
    clock.advance(1.0)
    table.sweep()
    assert table.find(other.lease_id) is None
    assert table.next_deadline() == admission.deadline + MARGIN


# --- the deadline heap, against a pass over every lease ---------------------------------------------


class Events:
    """Every end the table reports, admissions and leases in one list, in order."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, str, str]] = []

    def admission_over(self, admission: Admission) -> None:
        assert admission.ended is not None
        self.ends.append(("admission", admission.admission_id, admission.ended.value))

    def lease_over(self, lease: Lease, how: LeaseEnd) -> None:
        self.ends.append(("lease", lease.lease_id, how.value))


def _oracle_next_deadline(table: LeaseTable) -> float:
    """next_deadline as a pass over every lease computes it (the table's answer before its heap)."""
    due = float("inf")
    for lease in table.every():
        if not lease.draining:
            due = min(due, lease.expires_at)
        for admission in lease.admissions.values():
            due = min(due, admission.deadline + table.admission_margin_s)
    return due


def _oracle_sweep_ends(table: LeaseTable, now: float) -> list[tuple[str, str, str]]:
    """What a sweep at ``now`` ends, in order, as a pass over every lease finds it: lease by lease
    (creation order), its due admissions in admission order (a draining lease ends with its last
    one), then its expiry (it ends now, or drains while admissions stay open)."""
    ends: list[tuple[str, str, str]] = []
    for lease in table.every():
        open_ = list(lease.admissions.values())
        ended = False
        for admission in list(open_):
            if admission.deadline + table.admission_margin_s <= now:
                how = AdmissionEnd.ABANDONED if admission.reads_seen else AdmissionEnd.TIMED_OUT
                ends.append(("admission", admission.admission_id, how.value))
                open_.remove(admission)
                if lease.ending is not None and not open_:
                    ends.append(("lease", lease.lease_id, lease.ending.value))
                    ended = True
        if not ended and lease.ending is None and lease.expires_at <= now and not open_:
            ends.append(("lease", lease.lease_id, LeaseEnd.EXPIRED.value))
    return ends


def _live_heap_items(table: LeaseTable) -> set[int]:
    """ids of the leases and admissions the heap has a live entry for."""
    return {id(entry[2]) for entry in table._deadlines.entries if table._deadlines.live_lease(entry) is not None}


def _due_items(table: LeaseTable) -> set[int]:
    """ids of what should have a live entry: every lease not draining, every open admission."""
    items = {id(lease) for lease in table.every() if not lease.draining}
    return items | {id(admission) for lease in table.every() for admission in lease.admissions.values()}


def _random_step(table: LeaseTable, clock: FakeClock, rng: random.Random) -> str:
    """One random operation on the table; which one, for the failure message."""
    leases = table.every()
    lease = rng.choice(leases) if leases else None
    ttl = rng.choice([0.5, 1.0, 2.0, 5.0, 10.0, 20.0, rng.uniform(0.1, 20.0)])  # repeats: equal deadlines
    op = rng.choices(
        ["create", "renew", "heartbeat", "admit", "read", "finish", "abandon", "end", "end_all", "lost", "tick"],
        weights=[30, 16, 12, 28, 16, 8, 8, 8, 1, 1, 24],
    )[0]
    errors = (FailedPrecondition, InvalidArgument, LeaseExpired, UnknownLease)
    if op == "create" or lease is None:
        table.create(f"eng-{rng.randrange(3)}", f"r{rng.randrange(10**6)}", (1, 2), 20, ttl, soft=rng.random() < 0.3)
        return "create"
    if op == "renew":
        with contextlib.suppress(*errors):
            table.renew(lease.lease_id, ttl)
    elif op == "heartbeat":
        table.renew_by_own_ttl([le.lease_id for le in rng.sample(leases, k=min(len(leases), 5))] + ["gone"])
    elif op == "admit":
        tp = lease.reader_tp_size or rng.choice([1, 2])
        rank = rng.randrange(tp)
        hold = rng.choice([0.5, 1.0, 2.0, 5.0, 10.0, rng.uniform(0.1, 12.0)])
        with contextlib.suppress(*errors):
            table.admit(lease.lease_id, f"inc-{rng.randrange(2)}/t{rank}", rank, tp, hold)
    elif op == "read" and lease.admissions:
        admission = rng.choice(list(lease.admissions.values()))
        parts = rng.choice([1, 2])
        for part in rng.sample(range(parts), k=rng.randint(1, parts)):
            table.record_read(lease.lease_id, admission.admission_id, part, parts)
    elif op == "finish" and lease.admissions and lease.soft:
        table.finish_read(lease.lease_id, rng.choice(list(lease.admissions.values())), verified=rng.random() < 0.6)
    elif op == "abandon" and lease.admissions:
        admission = rng.choice(list(lease.admissions.values()))
        table.abandon(lease.lease_id, admission.reader, admission.reader_rank)
    elif op == "end":
        with contextlib.suppress(UnknownLease):
            table.end(lease.lease_id, rng.choice([LeaseEnd.RELEASED, LeaseEnd.ABORTED]))
    elif op == "end_all":
        table.end_all(LeaseEnd.ENGINE_GONE, f"eng-{rng.randrange(3)}")
    elif op == "lost":
        rank = rng.randrange(2)
        table.end_admissions_if(lambda a: a.reader_rank == rank, AdmissionEnd.WORKER_LOST)
    elif op == "tick":
        due = table.next_deadline()
        if due != float("inf") and rng.random() < 0.1:
            clock.now = max(clock.now, due)  # land exactly on a deadline: due means <=
        else:
            clock.advance(rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]))
    return op


@pytest.mark.parametrize("slack", [64, 0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_deadline_heap_answers_as_a_pass_over_every_lease(
    seed: int, slack: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A seeded random run of every operation: after each, next_deadline is what a pass over
    every lease finds, the heap has a live entry for exactly what has a deadline, and a sweep
    ends exactly (and in the same order) what the pass would end. Slack 0 rebuilds the heap often."""
    monkeypatch.setattr(lease_deadlines, "HEAP_SLACK", slack)
    rng = random.Random(seed)
    clock, events = FakeClock(), Events()
    table = LeaseTable(
        clock=clock, on_admission_over=events.admission_over, on_lease_over=events.lease_over, admission_margin_s=2.0
    )
    swept = 0
    for step in range(3000):
        op = _random_step(table, clock, rng)
        if step % 500 == 499:  # a new margin moves every admission's end
            table.admission_margin_s = rng.choice([0.0, 1.0, 2.0, 3.5])
        where = f"seed {seed}, step {step} ({op})"
        assert table.next_deadline() == _oracle_next_deadline(table), where
        assert len(table._deadlines.entries) <= 3 * (len(table.every()) + table.open_admissions) + slack, where
        assert _live_heap_items(table) == _due_items(table), where
        draining = sum(lease.draining for lease in table.every())
        assert (len(table), table.draining) == (len(table.every()) - draining, draining), where
        if op == "tick" or rng.random() < 0.1:
            expected = _oracle_sweep_ends(table, clock.now)
            events.ends.clear()
            table.sweep()
            assert events.ends == expected, where
            swept += len(expected)
            assert _oracle_next_deadline(table) > clock.now, where  # nothing due is left
            assert table.next_deadline() == _oracle_next_deadline(table), where
    assert swept > 100  # the run did end things by their deadlines
    table.end_all(LeaseEnd.SHUTDOWN)
    table.force_end_admissions()
    assert table.every() == [] and table.next_deadline() == float("inf") and table._deadlines.entries == []


def test_sweep_ends_in_table_order_not_deadline_order(clock: FakeClock) -> None:
    """A sweep that ends several things reports them lease by lease in creation order (as a pass
    over the table did), each lease's admissions first, whatever order their deadlines are in."""
    events = Events()
    table = LeaseTable(
        clock=clock, on_admission_over=events.admission_over, on_lease_over=events.lease_over, admission_margin_s=1.0
    )
    late = _create(table, ttl=3.0)
    early = _create(table, ttl=1.0)
    read = table.admit(late.lease_id, "i/t", 0, 1, 0.5)  # ends at 1.5, before either expiry
    clock.advance(5.0)
    table.sweep()
    assert events.ends == [
        ("admission", read.admission_id, AdmissionEnd.TIMED_OUT.value),
        ("lease", late.lease_id, LeaseEnd.EXPIRED.value),
        ("lease", early.lease_id, LeaseEnd.EXPIRED.value),
    ]


def test_renewing_one_lease_many_times_does_not_grow_the_heap(clock: FakeClock) -> None:
    """Each renewal leaves a stale entry behind: the heap is rebuilt before they pile up, and the
    next deadline stays right throughout."""
    table = LeaseTable(clock=clock, admission_margin_s=MARGIN)
    lease = _create(table, ttl=10.0)
    others = [_create(table, ttl=100.0, request=f"o{i}") for i in range(9)]
    bound = 3 * (1 + len(others)) + lease_deadlines.HEAP_SLACK
    biggest = 0
    for i in range(20_000):
        clock.advance(0.001)
        if i % 2:
            table.renew(lease.lease_id, 10.0)
        else:
            table.renew_by_own_ttl([lease.lease_id])
        biggest = max(biggest, len(table._deadlines.entries))
        assert table.next_deadline() == lease.expires_at
    assert biggest <= bound
    admission = _admit(table, lease)
    for _ in range(5_000):  # re-handshakes: each replaces the admission and leaves its entry stale
        admission = _admit(table, lease)
        biggest = max(biggest, len(table._deadlines.entries))
    assert biggest <= 3 * (len(others) + 2) + lease_deadlines.HEAP_SLACK
    assert table.next_deadline() == min(lease.expires_at, admission.deadline + MARGIN)


def test_ended_leases_do_not_stay_in_the_heap(clock: FakeClock) -> None:
    """A burst of leases released before they expire: the next sweep drops their stale entries
    (a rebuild), so the heap does not keep the ended leases (and their block ids) alive."""
    table = LeaseTable(clock=clock, admission_margin_s=MARGIN)
    keep = _create(table, ttl=1.0)  # the top of the heap stays live: nothing below it is popped
    burst = [_create(table, ttl=50.0, request=f"b{i}") for i in range(1000)]
    for lease in burst:
        table.end(lease.lease_id, LeaseEnd.RELEASED)
    table.sweep()
    assert len(table._deadlines.entries) <= 3 + lease_deadlines.HEAP_SLACK
    assert table.next_deadline() == keep.expires_at
