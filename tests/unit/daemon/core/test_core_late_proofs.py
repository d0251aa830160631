"""Holder memory a timed-out read tainted is kept only until that read is proven over.

An admitted read that runs past its deadline plus ``read_admission_margin_s`` ends *timed out*:
nothing proves its READs over, so the holder memory it pinned is tainted, and retired (not freed)
when its engine goes. Before issue 42 that was for the daemon's life; a fleet run then ended with
8 MiB quarantined on a node that was quiet (its decode engine killed, its daemon stopped 6.6 s).
The proof can come late, and these scenarios drive each way it comes (lifetime_fakes.py, every
interleaving by hand): the READs' notifications, delayed behind a stopped control process; the
reader's FinishRead (READs with no notification), asked again until the holder can be reached; the
reader's AbandonPull, asked again until a holder it could not reach answers; an AbandonPull for
an admission whose answer was lost.
"""

from __future__ import annotations

import pytest
from lifetime_fakes import Fabric
from test_core_lifetimes import (
    ABORTED,
    DONE,
    FAILED,
    FENCING,
    HOLDER,
    Pair,
    assert_settled,
    ended,
    make_pair,
    registrations,
    run,
    settle,
    sweep_round,
    until_state,
)

from kvd.core import pull_resources
from kvd.core.local_memory import MemoryState
from kvd_client.errors import PeerUnavailable


@pytest.fixture(autouse=True)
def quick_abandon_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unanswered AbandonPull is asked again after 10 ms, not 0.5 s (no outcome depends on it)."""
    monkeypatch.setattr(pull_resources, "ABANDON_RETRY_S", 0.01)


def time_out_admissions(p: Pair) -> None:
    """The holder's clock passes every admission's deadline plus the margin, and it sweeps: as a
    holder whose control process was stopped (or starved) that long sees it when it runs again."""
    holder = p.holder.daemon
    p.fabric.clock.advance(holder.config.transfer_deadline_s + holder.config.read_admission_margin_s + 0.1)
    holder.leases.sweep()


@pytest.mark.parametrize("engine_killed", ["after the timeout", "before the timeout"])
def test_a_read_timed_out_before_its_notifications_were_read_is_proven_over_by_them(
    fabric: Fabric, engine_killed: str
) -> None:
    """The fleet's leak. The holder daemon is stopped (SIGSTOP stops its control process; its
    data-plane worker serves on): the reader's READs complete, the pull is DONE, and their
    notifications wait for the control process. It resumes and sweeps first: the read times out
    and taints the engine's memory; the engine is killed: retired, quarantined. The notifications
    read a moment later prove the read over (both parts: one is not a proof): the mapping is freed."""

    async def scenario() -> None:
        p = await make_pair(fabric, read_notifications=True)
        holder = p.holder.daemon
        memory, regs = p.hrank.memory, registrations(p.hrank.memory)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer, notify=False)  # delivered later (deliver)
        await ended(transfer)
        assert transfer.state is DONE

        if engine_killed == "before the timeout":
            await holder.unregister_engine("eng-h", 0)
        time_out_admissions(p)
        await settle(p.holder)
        if engine_killed == "after the timeout":
            assert memory.state is MemoryState.ACTIVE and memory.tainted
            await holder.unregister_engine("eng-h", 0)
        await sweep_round(p.holder)
        assert p.holder.metric("kvd_admissions_ended_total", reason="timed_out") == 1
        assert memory.state is MemoryState.QUARANTINED and memory.retired and memory.tainted
        assert holder.status().quarantined_bytes == memory.size_bytes
        assert not any(p.holder.dataplane.deregistered(r) for r in regs)

        p.reader.dataplane.deliver(xfers[0])
        await sweep_round(p.holder)
        assert memory.state is MemoryState.QUARANTINED and memory.tainted  # one part of two proves nothing

        p.reader.dataplane.deliver(xfers[1])
        await sweep_round(p.holder)
        assert memory.state is MemoryState.RELEASED and not memory.tainted
        assert all(p.holder.dataplane.deregistered(r) for r in regs)
        assert holder.status().quarantined_bytes == 0 and p.holder.metric("kvd_quarantined_bytes") == 0
        assert holder.leases.unproven == 0
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


@pytest.mark.parametrize("engine_killed", ["after the timeout", "before the timeout"])
def test_a_read_timed_out_before_its_finish_read_arrived_is_proven_over_by_it(
    fabric: Fabric, engine_killed: str
) -> None:
    """The same leak where the READs carry no notification (the default): the reader's READs
    complete and the pull is DONE, but the holder cannot be reached (stopped, cut off), so the
    FinishRead that ends the read is asked again and again. The holder times the read out
    (tainted) and its engine goes (retired, quarantined); the FinishRead that finally arrives
    proves the read over: the mapping is freed, and nothing else of the lease is touched."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder = p.holder.daemon
        memory, regs = p.hrank.memory, registrations(p.hrank.memory)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        assert all(p.reader.dataplane.reads[x].message == b"" for x in xfers)  # quiet READs
        p.reader.transport.unreachable.add(HOLDER)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        assert transfer.state is DONE
        assert p.reader.transport.finishes == []

        if engine_killed == "before the timeout":
            await holder.unregister_engine("eng-h", 0)
        time_out_admissions(p)
        await settle(p.holder)
        if engine_killed == "after the timeout":
            assert memory.state is MemoryState.ACTIVE and memory.tainted
            await holder.unregister_engine("eng-h", 0)
        await sweep_round(p.holder)
        assert p.holder.metric("kvd_admissions_ended_total", reason="timed_out") == 1
        assert memory.state is MemoryState.QUARANTINED and memory.retired and memory.tainted
        assert not any(p.holder.dataplane.deregistered(r) for r in regs)

        p.reader.transport.unreachable.discard(HOLDER)
        await p.reader.transport.finished.reach(1)
        await sweep_round(p.holder)
        (finish,) = p.reader.transport.finishes
        assert finish["transfer_id"] == transfer.transfer_id and finish["nbytes"] == transfer.nbytes
        assert memory.state is MemoryState.RELEASED and not memory.tainted
        assert all(p.holder.dataplane.deregistered(r) for r in regs)
        assert holder.status().quarantined_bytes == 0 and holder.leases.unproven == 0
        assert p.reader.transport.abandons == []
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_a_reader_asks_a_holder_it_cannot_reach_again_until_it_hears_the_read_is_over(fabric: Fabric) -> None:
    """The holder is unreachable (stopped, cut off) when the reader gives its pull up: the
    reader's AbandonPull, sent once its READs are final, fails, and is asked again. Meanwhile the
    holder times the read out and its engine goes: retired, quarantined. Once the holder can be
    reached the AbandonPull arrives, proves the read over, and the mapping is freed."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder = p.holder.daemon
        memory, regs = p.hrank.memory, registrations(p.hrank.memory)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        p.reader.transport.unreachable.add(HOLDER)
        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await until_state(transfer, FENCING)
        for xfer in xfers:
            p.reader.dataplane.fail(xfer)
        await ended(transfer)
        assert transfer.state is ABORTED

        time_out_admissions(p)
        await holder.unregister_engine("eng-h", 0)
        await sweep_round(p.holder)
        assert memory.state is MemoryState.QUARANTINED and memory.tainted
        assert p.reader.transport.abandons == []  # not one reached the holder yet

        p.reader.transport.unreachable.discard(HOLDER)
        await p.reader.transport.abandoned.reach(1)
        await sweep_round(p.holder)
        (abandon,) = p.reader.transport.abandons
        assert abandon["lease_id"] == lease_id and abandon["transfer_id"] == transfer.transfer_id
        assert memory.state is MemoryState.RELEASED and all(p.holder.dataplane.deregistered(r) for r in regs)
        assert holder.status().quarantined_bytes == 0
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_a_reader_whose_reads_failed_as_disconnected_still_tells_the_holder(fabric: Fabric) -> None:
    """READs that fail as the peer disconnected drop the peer; their pull still tells the holder
    it is over (they are final), so the admission ends abandoned, clean, instead of timing out and
    tainting the holder's memory (a holder that was only cut off, or came back, keeps it)."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        for xfer in xfers:
            p.reader.dataplane.fail(xfer, PeerUnavailable(f"NIXL read from peer {HOLDER} failed: disconnected"))
        await ended(transfer)
        assert transfer.state is FAILED
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert [a["lease_id"] for a in p.reader.transport.abandons] == [lease_id]
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.daemon.leases.open_admissions == 0 and not p.hrank.memory.tainted
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_an_admission_whose_answer_was_lost_as_unreachable_is_abandoned(fabric: Fabric) -> None:
    """The holder admitted the read but the answer never came back (a holder stopped past the
    call's timeout runs the call when it resumes; the reader saw it unreachable). The reader
    posted nothing and says so: the admission ends abandoned at once, no taint."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        p.reader.transport.reply_lost = PeerUnavailable(f"peer daemon {HOLDER} unreachable during prepare pull")
        transfer, lease_id = p.pull()
        await ended(transfer)
        assert transfer.state is FAILED and not p.reader.dataplane.reads
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        (abandon,) = p.reader.transport.abandons
        assert abandon["lease_id"] == lease_id and abandon["transfer_id"] == transfer.transfer_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.daemon.leases.open_admissions == 0 and p.hrank.memory.holder_pins == 0
        assert not p.hrank.memory.tainted and not p.hrank.memory.retired
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)
