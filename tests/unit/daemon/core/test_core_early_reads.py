"""A READ posted beside its admission: its notification may reach the holder first.

kvd.core.early_reads keeps such parts, bounded, until the admission claims them; LeaseTable
counts them then exactly as parts that arrive after it (docs/lifetimes.md, "A READ beside its
admission"). On a fake clock.
"""

from __future__ import annotations

import pytest
from lifetime_fakes import FakeClock
from test_core_leases import Recorder

from kvd.core import early_reads
from kvd.core.early_reads import EarlyParts
from kvd.core.leases import AdmissionEnd, LeaseEnd, LeaseTable
from kvd_client.errors import FailedPrecondition

HOLD = 30.0
READER = "incarnation/transfer-1"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ends() -> Recorder:
    return Recorder()


@pytest.fixture
def table(clock: FakeClock, ends: Recorder) -> LeaseTable:
    return LeaseTable(clock=clock, on_admission_over=ends.admission_over, on_lease_over=ends.lease_over)


def test_parts_that_arrive_before_the_admission_end_a_hard_read_once_it_claims_them(
    table: LeaseTable, ends: Recorder
) -> None:
    lease = table.create("eng", "req", (0, 1), 32, ttl_s=HOLD)
    assert table.record_read(lease.lease_id, "read-1", 0, 2) is None
    assert table.record_read(lease.lease_id, "read-1", 1, 2) is None
    assert table.early_reads == 1 and not ends.admissions and not ends.leases  # nothing ends before it is admitted

    admission = table.admit(lease.lease_id, READER, 0, 1, HOLD, admission_id="read-1")
    assert admission.admission_id == "read-1" and admission.ended is None
    table.claim_early_parts(admission)

    assert admission.ended is AdmissionEnd.READ
    assert ends.admissions == [("read-1", AdmissionEnd.READ)] and ends.leases == [(lease.lease_id, LeaseEnd.READ)]
    assert table.early_reads == 0 and table.open_admissions == 0


def test_early_and_late_parts_of_one_read_add_up(table: LeaseTable, ends: Recorder) -> None:
    lease = table.create("eng", "req", (0, 1), 32, ttl_s=HOLD)
    table.record_read(lease.lease_id, "read-1", 1, 2)
    admission = table.admit(lease.lease_id, READER, 0, 1, HOLD, admission_id="read-1")
    table.claim_early_parts(admission)
    assert admission.ended is None and admission.parts_seen == {1}

    table.record_read(lease.lease_id, "read-1", 0, 2)
    assert admission.ended is AdmissionEnd.READ and ends.leases == [(lease.lease_id, LeaseEnd.READ)]


def test_a_soft_read_counts_early_parts_but_ends_only_with_its_finish_read(table: LeaseTable, ends: Recorder) -> None:
    lease = table.create("eng", "req", (0,), 16, ttl_s=HOLD, soft=True)
    table.record_read(lease.lease_id, "read-1", 0, 1)
    admission = table.admit(lease.lease_id, READER, 0, 1, HOLD, admission_id="read-1")
    table.claim_early_parts(admission)
    assert admission.ended is None and admission.reads_seen

    table.finish_read(lease.lease_id, admission, verified=True)
    assert admission.ended is AdmissionEnd.READ


def test_parts_of_another_read_or_a_disagreeing_part_count_count_nothing(table: LeaseTable) -> None:
    lease = table.create("eng", "req", (0, 1), 32, ttl_s=HOLD)
    table.record_read(lease.lease_id, "read-other", 0, 1)
    table.record_read(lease.lease_id, "read-1", 0, 2)
    table.record_read(lease.lease_id, "read-1", 1, 3)  # not the READ that was posted: ignored
    admission = table.admit(lease.lease_id, READER, 0, 1, HOLD, admission_id="read-1")
    table.claim_early_parts(admission)
    assert admission.ended is None and admission.parts_seen == {0} and admission.parts == 2


def test_notifications_of_no_live_lease_are_not_kept(table: LeaseTable) -> None:
    table.record_read("no-such-lease", "read-1", 0, 1)
    lease = table.create("eng", "req", (0,), 16, ttl_s=HOLD)
    table.end(lease.lease_id, LeaseEnd.RELEASED)
    table.record_read(lease.lease_id, "read-1", 0, 1)
    assert table.early_reads == 0


def test_a_read_id_in_use_on_the_lease_is_refused_and_changes_nothing(table: LeaseTable) -> None:
    lease = table.create("eng", "req", (0,), 16, ttl_s=HOLD)
    first = table.admit(lease.lease_id, READER, 0, 2, HOLD, admission_id="read-1")
    with pytest.raises(FailedPrecondition, match="already in use"):
        table.admit(lease.lease_id, "other/transfer-2", 1, 2, HOLD, admission_id="read-1")
    assert table.open_admissions == 1 and lease.admissions == {"read-1": first}


def test_early_parts_are_forgotten_after_their_ttl(clock: FakeClock) -> None:
    parts = EarlyParts(clock)
    parts.add("lease", "read-1", 0, 1)
    clock.advance(early_reads.EARLY_READ_TTL_S + 1)
    parts.add("lease", "read-2", 0, 1)  # any arrival sweeps the expired ones first
    assert parts.claim("lease", "read-1") is None and parts.forgotten == 1
    assert parts.claim("lease", "read-2") == (1, {0})


def test_early_parts_are_bounded_oldest_forgotten_first(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early_reads, "MAX_EARLY_READS", 3)
    parts = EarlyParts(clock)
    for n in range(5):
        parts.add("lease", f"read-{n}", 0, 1)
    assert len(parts) == 3 and parts.forgotten == 2
    assert parts.claim("lease", "read-0") is None and parts.claim("lease", "read-4") == (1, {0})


def test_part_numbers_out_of_range_are_not_kept(clock: FakeClock) -> None:
    parts = EarlyParts(clock)
    parts.add("lease", "read-1", 2, 2)
    parts.add("lease", "read-1", -1, 2)
    parts.add("lease", "read-1", 0, early_reads.MAX_PARTS + 1)
    assert len(parts) == 0
