"""Soft leases and their checks (kvd.core.leases, kvd.core.holdchecks), on a fake clock and by hand.

A soft lease's read ends with the reader's FinishRead, verified: its NIXL notifications alone do not
end it; a failed verification ends the lease as evicted; an admission that never said FinishRead
is clean only if every part arrived. Reader heartbeats renew each lease by its own TTL. The
scheduler channel answers checks, fails them when silent or gone, and never leaks a late PIN.
"""

from __future__ import annotations

import asyncio

from lifetime_fakes import FakeClock

from kvd.core.holdchecks import HoldCheckCommand, HoldChecks, HoldEndedCommand
from kvd.core.leases import Admission, AdmissionEnd, Lease, LeaseEnd, LeaseTable
from kvd_client.v1.schema import HoldCheckAction

MARGIN = 5.0


class Recorder:
    def __init__(self) -> None:
        self.admissions: list[AdmissionEnd] = []
        self.leases: list[LeaseEnd] = []

    def admission_over(self, admission: Admission) -> None:
        assert admission.ended is not None
        self.admissions.append(admission.ended)

    def lease_over(self, lease: Lease, how: LeaseEnd) -> None:
        self.leases.append(how)


def _table() -> tuple[LeaseTable, FakeClock, Recorder]:
    clock, ends = FakeClock(), Recorder()
    table = LeaseTable(
        clock=clock, on_admission_over=ends.admission_over, on_lease_over=ends.lease_over, admission_margin_s=MARGIN
    )
    return table, clock, ends


def test_a_soft_read_ends_with_finish_read_not_with_its_notifications() -> None:
    table, _, ends = _table()
    lease = table.create("eng", "req", (1, 2), 32, 10.0, soft=True)
    admission = table.admit(lease.lease_id, "inc/t1", 0, 1, 30.0)
    table.record_read(lease.lease_id, admission.admission_id, 0, 1)
    assert admission.reads_seen and admission.ended is None and not ends.leases  # still open: not verified yet
    table.finish_read(lease.lease_id, admission, verified=True)
    assert ends.admissions == [AdmissionEnd.READ] and ends.leases == [LeaseEnd.READ]


def test_a_failed_verification_ends_the_lease_as_evicted_for_every_reader() -> None:
    table, _, ends = _table()
    lease = table.create("eng", "req", (1, 2), 32, 10.0, soft=True)
    first = table.admit(lease.lease_id, "inc/t1", 0, 2, 30.0)
    second = table.admit(lease.lease_id, "inc/t2", 1, 2, 30.0)
    table.finish_read(lease.lease_id, first, verified=False)
    assert ends.admissions == [AdmissionEnd.ABANDONED] and not ends.leases  # drains: rank 1 still reads
    assert table.find(lease.lease_id) is not None and table.find(lease.lease_id).draining
    table.finish_read(lease.lease_id, second, verified=True)  # too late: the lease is ending as evicted
    assert ends.leases == [LeaseEnd.EVICTED]


def test_a_soft_reader_that_never_finishes_is_clean_only_if_every_part_arrived() -> None:
    table, clock, ends = _table()
    seen = table.create("eng", "a", (1,), 16, 100.0, soft=True)
    unseen = table.create("eng", "b", (2,), 16, 100.0, soft=True)
    a = table.admit(seen.lease_id, "inc/t1", 0, 1, 1.0)
    table.admit(unseen.lease_id, "inc/t2", 0, 1, 1.0)
    table.record_read(seen.lease_id, a.admission_id, 0, 1)
    clock.advance(1.0 + MARGIN)
    table.sweep()
    assert sorted(e.value for e in ends.admissions) == ["abandoned", "timed_out"]


def test_hard_leases_still_end_on_their_notifications() -> None:
    table, _, ends = _table()
    lease = table.create("eng", "req", (1,), 16, 10.0)
    admission = table.admit(lease.lease_id, "inc/t1", 0, 1, 30.0)
    table.record_read(lease.lease_id, admission.admission_id, 0, 1)
    assert ends.leases == [LeaseEnd.READ]


def test_heartbeats_renew_each_lease_by_its_own_ttl_and_name_the_gone_ones() -> None:
    table, clock, ends = _table()
    short = table.create("eng", "a", (1,), 16, 2.0)
    long = table.create("eng", "b", (2,), 16, 20.0)
    released = table.create("eng", "c", (3,), 16, 20.0)
    table.end(released.lease_id, LeaseEnd.ABORTED)
    clock.advance(1.5)
    unknown = table.renew_by_own_ttl([short.lease_id, long.lease_id, released.lease_id, "nope"])
    assert unknown == [released.lease_id, "nope"]
    assert table.remaining_s(short) == 2.0  # renewed by its own 2 s
    assert table.remaining_s(long) == 20.0  # each by its own TTL
    clock.advance(2.5)  # no heartbeat for longer than its TTL: the short lease lapses
    table.sweep()
    assert ends.leases == [LeaseEnd.ABORTED, LeaseEnd.EXPIRED]
    assert table.renew_by_own_ttl([short.lease_id]) == [short.lease_id]


def test_checks_are_answered_and_fail_when_silent_or_gone() -> None:
    async def main() -> None:
        checks = HoldChecks()
        assert await checks.check("eng", HoldCheckAction.PIN, "r", "L", "p1", 0.05) == (
            False,
            "engine 'eng' has no scheduler stream: its blocks cannot be verified",
        )
        channel = checks.attach("eng")
        asking = asyncio.ensure_future(checks.check("eng", HoldCheckAction.PIN, "r", "L", "p1", 5.0))
        command = await channel.outbox.get()
        assert isinstance(command, HoldCheckCommand) and command.action is HoldCheckAction.PIN
        checks.answer(channel, command.seq, True, "")
        assert await asyncio.wait_for(asking, 1.0) == (True, "")

        # A silent scheduler: the PIN fails after the timeout and an UNPIN of the same pin follows it.
        ok, why = await checks.check("eng", HoldCheckAction.PIN, "r", "L", "p2", 0.05)
        assert not ok and "did not answer" in why
        pin, unpin = channel.outbox.get_nowait(), channel.outbox.get_nowait()
        assert isinstance(pin, HoldCheckCommand) and isinstance(unpin, HoldCheckCommand)
        assert (pin.action, unpin.action) == (HoldCheckAction.PIN, HoldCheckAction.UNPIN)
        assert pin.pin_id == unpin.pin_id == "p2"

        # The stream ends (superseded by a reconnect): waiting checks fail at once.
        waiting = asyncio.ensure_future(checks.check("eng", HoldCheckAction.VERIFY_UNPIN, "r", "L", "p1", 5.0))
        await asyncio.sleep(0)
        newer = checks.attach("eng")
        ok, why = await asyncio.wait_for(waiting, 1.0)
        assert not ok and "superseded" in why
        assert not checks.detach(channel) and checks.connected("eng")
        checks.tell_ended("eng", "r", "L", "read")
        assert newer.outbox.get_nowait() == HoldEndedCommand("r", "L", "read")
        assert checks.detach(newer) and not checks.connected("eng")

    asyncio.run(main())


def test_a_pin_whose_asker_gives_up_is_followed_by_its_unpin() -> None:
    """The reader withdrew the PreparePull (or its stream ended) while the engine pinned: nobody
    would end that pin, so an UNPIN of it follows the PIN on the same stream."""

    async def main() -> None:
        checks = HoldChecks()
        channel = checks.attach("eng")
        asking = asyncio.ensure_future(checks.check("eng", HoldCheckAction.PIN, "r", "L", "p1", 5.0))
        pin = await channel.outbox.get()
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        assert asking.cancelled()
        unpin = channel.outbox.get_nowait()
        assert isinstance(pin, HoldCheckCommand) and isinstance(unpin, HoldCheckCommand)
        assert (pin.action, unpin.action, unpin.pin_id) == (HoldCheckAction.PIN, HoldCheckAction.UNPIN, "p1")
        assert not channel.pending  # the engine's late answer finds nothing waiting
        verifying = asyncio.ensure_future(checks.check("eng", HoldCheckAction.VERIFY_UNPIN, "r", "L", "p2", 5.0))
        await channel.outbox.get()
        verifying.cancel()  # a VERIFY_UNPIN unpins by itself: nothing follows it
        await asyncio.gather(verifying, return_exceptions=True)
        assert channel.outbox.empty()

    asyncio.run(main())
