"""A pull's READs posted beside the holder's admission (``read_beside_admission``, the default):
every interleaving of the READ, its notification and the admission, driven by hand.

Two real daemons over the fake data planes and peer transport of lifetime_fakes.py, as in
test_core_lifetimes.py (which drives the sequential way). The fakes flag every lifetime
violation, AbandonPull sent while a READ is not final included. The rules proven here:
docs/lifetimes.md, "A READ beside its admission".
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

from kvtest import small_spec
from lifetime_fakes import Fabric, Gate
from test_core_lifetimes import (
    DONE,
    FAILED,
    HOLD_BLOCKS,
    LOCAL_BLOCKS,
    NUM_TOKENS,
    READER,
    READING,
    Pair,
    assert_settled,
    ended,
    engine_events,
    make_pair,
    run,
    settle,
)

from kvd.core.events import FinishedRecving, FinishedSending, LoadFailed
from kvd.core.leases import LeaseEnd
from kvd.core.local_memory import MemoryState
from kvd.core.transfers import Transfer
from kvd_client.errors import PeerUnavailable


async def beside_pair(fabric: Fabric, **reader_config: Any) -> Pair:
    return await make_pair(fabric, read_beside_admission=True, **reader_config)


async def admitted_before_reading(p: Pair) -> None:
    """A pull whose PreparePull is held on its way to the holder posts nothing meanwhile (the
    sequential way); it is then cancelled and everything settles."""
    gate = p.reader.transport.prepare_gate = Gate()
    transfer, _ = p.pull()
    await gate.arrived.reach(1)
    await asyncio.sleep(0.01)
    assert p.reader.dataplane.posted == [] and not transfer.state.final
    p.reader.daemon.cancel_transfer(transfer.transfer_id)
    gate.open()
    await ended(transfer)
    await settle(p.holder)
    assert_settled(p.reader, p.holder)


async def posted_before_admitted(p: Pair) -> tuple[Transfer, str, list, Gate]:
    """A pull whose PreparePull is held on its way to the holder while its READs are posted."""
    gate = p.reader.transport.prepare_gate = Gate()
    transfer, lease_id = p.pull()
    await gate.arrived.reach(1)
    dp = p.reader.dataplane
    await dp.posts.reach(2)
    assert transfer.state is READING and p.holder.daemon.leases.open_admissions == 0
    return transfer, lease_id, list(dp.posted), gate


def test_reads_posted_before_the_admission_end_done_and_end_the_lease_once(fabric: Fabric) -> None:
    """The READs are posted and finish (their notifications reach the holder) before the
    admission does: the admission counts them, the lease ends read, the pull is DONE once."""

    async def scenario() -> None:
        p = await beside_pair(fabric, read_notifications=True)
        transfer, lease_id, xfers, gate = await posted_before_admitted(p)
        (prepare,) = p.reader.transport.prepares
        assert prepare["lease_id"] == lease_id

        for xfer in xfers:
            p.reader.dataplane.finish(xfer)  # the notifications arrive first
        await asyncio.sleep(0)
        assert not transfer.state.final, "a pull is never reported before its admission is back"
        assert p.holder.daemon.leases.early_reads == 1 and not engine_events(p.hrank, FinishedSending)

        gate.open()
        await ended(transfer)
        await settle(p.holder)
        assert transfer.state is DONE and len(engine_events(p.rrank, FinishedRecving)) == 1
        (sent,) = engine_events(p.hrank, FinishedSending)
        assert sent.lease_id == lease_id
        assert p.holder.metric("kvd_leases_ended_total", reason="read") == 1
        assert p.holder.daemon.leases.early_reads == 0 and p.hrank.memory.holder_pins == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_quiet_reads_done_before_the_admission_end_the_lease_by_one_finish_read_after_it(fabric: Fabric) -> None:
    """READs with no notification (the default) finish before the admission is back: the holder
    hears nothing of them, the pull waits for its admission, and only then does the reader send
    its FinishRead, which ends the read and the lease once; the pull is DONE once."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        transfer, lease_id, xfers, gate = await posted_before_admitted(p)
        assert all(p.reader.dataplane.reads[x].message == b"" for x in xfers)

        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await asyncio.sleep(0)
        assert not transfer.state.final, "a pull is never reported before its admission is back"
        assert p.holder.daemon.leases.early_reads == 0 and p.reader.transport.finishes == []

        gate.open()
        await ended(transfer)
        await p.reader.transport.finished.reach(1)
        await settle(p.holder)
        assert transfer.state is DONE and len(engine_events(p.rrank, FinishedRecving)) == 1
        (finish,) = p.reader.transport.finishes
        assert finish["lease_id"] == lease_id and finish["nbytes"] == transfer.nbytes > 0
        (sent,) = engine_events(p.hrank, FinishedSending)
        assert sent.lease_id == lease_id
        assert p.holder.metric("kvd_leases_ended_total", reason="read") == 1
        assert p.holder.metric("kvd_transfer_bytes_total", peer=READER, direction="serve") == transfer.nbytes
        assert p.hrank.memory.holder_pins == 0 and p.reader.transport.abandons == []
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_lease_that_ends_between_the_post_and_the_admission_fails_the_pull_never_done(fabric: Fabric) -> None:
    """The holder releases the lease after the READs were posted and before the admission comes:
    the admission is refused, the READs' bytes are discarded (FAILED, one LoadFailed, never
    FinishedRecving), and AbandonPull goes only once the READs are final."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        transfer, lease_id, xfers, gate = await posted_before_admitted(p)
        p.holder.daemon.release_lease(lease_id)
        await settle(p.holder)
        assert p.holder.metric("kvd_leases_ended_total", reason="released") == 1

        gate.open()
        await asyncio.sleep(0.01)
        assert not transfer.state.final or transfer.state is FAILED
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)

        assert transfer.state is FAILED and transfer.error is not None
        assert transfer.error.code.name == "NOT_FOUND", transfer.error
        assert not engine_events(p.rrank, FinishedRecving) and len(engine_events(p.rrank, LoadFailed)) == 1
        assert p.holder.daemon.leases.open_admissions == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_refused_admission_with_reads_in_flight_waits_for_them_before_abandoning(fabric: Fabric) -> None:
    """A second reader of the same lease and rank is refused after its READs were posted: its pull
    ends FAILED only once its READs are final (fenced), and the first reader's pull is DONE."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        transfer, lease_id, xfers, gate = await posted_before_admitted(p)
        gate.open()
        await asyncio.sleep(0.01)
        assert p.holder.daemon.leases.open_admissions == 1
        params = p.holder.daemon.params_of(p.holder.daemon.leases.get(lease_id))

        second = p.reader.daemon.start_pull("eng-r", 0, "req-2", [6, 7, 0], params)
        dp = p.reader.dataplane
        await dp.posts.reach(4)
        second_xfers = [x for x in dp.posted if x not in xfers]
        await asyncio.sleep(0.01)
        assert not second.state.final, "refused, but its READs are not final: it waits for them"
        assert p.reader.transport.abandons == []

        for xfer in second_xfers:
            dp.finish(xfer, notify=False)
        await ended(second)
        assert second.state is FAILED and second.error is not None
        assert second.error.code.name == "FAILED_PRECONDITION"
        for xfer in xfers:
            dp.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert transfer.state is DONE and len(engine_events(p.hrank, FinishedSending)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_an_unreachable_admission_fails_the_pull_and_abandons_once_the_reads_are_final(fabric: Fabric) -> None:
    """The admission's answer is lost (the holder admitted the read): the pull fails, and the
    AbandonPull that ends the admission at once goes only after its READs are final."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        p.reader.transport.reply_lost = PeerUnavailable("peer daemon unreachable during prepare pull")
        reply = p.reader.transport.reply_gate = Gate()
        transfer, lease_id = p.pull()
        dp = p.reader.dataplane
        await dp.posts.reach(2)
        xfers = list(dp.posted)
        await reply.arrived.reach(1)
        assert p.holder.daemon.leases.open_admissions == 1
        reply.open()
        await asyncio.sleep(0.01)
        assert p.reader.transport.abandons == [], "never before the READs are final"

        for xfer in xfers:
            dp.finish(xfer, notify=False)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)
        assert transfer.state is FAILED and not engine_events(p.rrank, FinishedRecving)
        assert [a["lease_id"] for a in p.reader.transport.abandons] == [lease_id]
        assert p.holder.daemon.leases.open_admissions == 0 and not p.hrank.memory.tainted
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_lease_granted_on_a_newer_registration_is_handshaken_again_before_any_read(fabric: Fabric) -> None:
    """The holder's engine registered again after the reader's handshake: the lease names the new
    registration, so the reader handshakes again before posting anything, and reads the new one."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        first, _ = p.pull()
        dp = p.reader.dataplane
        await dp.posts.reach(2)
        for xfer in list(dp.posted):
            dp.finish(xfer)
        await ended(first)
        assert first.state is DONE
        handshakes = len(p.reader.transport.handshakes)

        holder = p.holder.daemon
        await holder.unregister_engine("eng-h", 0)
        p.hrank = await fabric.register(p.holder, "eng-h", p.hrank.spec)
        _, params = holder.hold("eng-h", "req-2", HOLD_BLOCKS, NUM_TOKENS)
        assert params.registration_ids == (p.hrank.registration_id,)
        second = p.reader.daemon.start_pull("eng-r", 0, "req-2", LOCAL_BLOCKS, params)
        await dp.posts.reach(4)
        assert len(p.reader.transport.handshakes) == handshakes + 1
        for xfer in list(dp.posted)[2:]:
            dp.finish(xfer)
        await ended(second)
        await settle(p.holder)
        assert second.state is DONE
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_holder_that_waits_for_commits_is_read_the_sequential_way(fabric: Fabric) -> None:
    """A holder rank that commits after leasing (speculative decoding's deferred writes) does not
    allow early READs: the admission comes first, as before."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        p.hrank.require_commits = True
        await admitted_before_reading(p)

    run(fabric, scenario)


def test_lease_end_reasons_are_unchanged_by_early_parts(fabric: Fabric) -> None:
    """Sanity of the counters the fleet compares: one pull, one read lease end, nothing expired."""

    async def scenario() -> None:
        p = await beside_pair(fabric)
        transfer, _ = p.pull()
        dp = p.reader.dataplane
        await dp.posts.reach(2)
        for xfer in list(dp.posted):
            dp.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert transfer.state is DONE
        assert p.holder.metric("kvd_leases_ended_total", reason=LeaseEnd.READ.value) == 1
        assert p.holder.metric("kvd_leases_ended_total", reason=LeaseEnd.EXPIRED.value) == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_memory_a_holder_lets_go_stays_readable_for_its_early_read_window_then_is_unmapped(fabric: Fabric) -> None:
    """The holder's engine unregisters while a lease of it has no reader yet: a reader may still
    post a READ beside its admission on a handshake that named the memory (never admitted, never
    pinned). The mapping is let go at once (the engine's pages are not kept) but its addresses stay
    readable, as zeros, for the window the holder's handshake announced plus the admission margin;
    the worker unmaps them on a later open once that is over. (A READ of unmapped memory fails on
    the serving side and breaks the UCX connection for every later pull from that holder.)"""

    async def scenario() -> None:
        p = await make_pair(
            fabric,
            holder_config={"early_read_window_s": 0.1, "read_admission_margin_s": 0.05},
            read_beside_admission=True,
        )
        holder = p.holder.daemon
        holder.hold("eng-h", "req-1", HOLD_BLOCKS, NUM_TOKENS, ttl_s=600)
        memory = p.hrank.memory
        address, size = memory.regions[0].address, memory.regions[0].size_bytes
        ctypes.memset(address, 0x5A, size)  # the engine's bytes, seen through the holder's mapping
        table = p.holder.dataplane.region_table

        await holder.unregister_engine("eng-h", 0)
        await settle(p.holder)
        assert memory.state is MemoryState.RELEASED and memory not in holder.memories.quarantine
        assert table.tombstones == 1
        assert ctypes.string_at(address, size) == bytes(size), "a late READ must read zeros, never the engine's bytes"

        await asyncio.sleep(0.2)  # past the window plus the margin
        await fabric.register(p.holder, "eng-x", small_spec(8))
        assert table.tombstones == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_reader_whose_handshake_is_older_than_the_holders_window_handshakes_again_before_an_early_read(
    fabric: Fabric,
) -> None:
    """Past the holder's early-read window from when its handshake was asked, the memory that
    handshake named may be unmapped by now: the reader handshakes again before it posts a READ
    beside an admission, and the pull reads as before."""

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config={"early_read_window_s": 0.1}, read_beside_admission=True)
        dp = p.reader.dataplane
        first, _ = p.pull()
        await dp.posts.reach(2)
        for xfer in list(dp.posted):
            dp.finish(xfer)
        await ended(first)
        handshakes = len(p.reader.transport.handshakes)

        await asyncio.sleep(0.15)
        gate = p.reader.transport.prepare_gate = Gate()
        second, _ = p.pull()
        await gate.arrived.reach(1)
        await dp.posts.reach(4)  # posted beside the admission still held back: on the fresh view
        assert len(p.reader.transport.handshakes) == handshakes + 1
        gate.open()
        for xfer in list(dp.posted)[2:]:
            dp.finish(xfer)
        await ended(second)
        await settle(p.holder)
        assert first.state is DONE and second.state is DONE
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_holder_that_keeps_nothing_readable_is_read_the_sequential_way(fabric: Fabric) -> None:
    """A holder whose handshake announces no early-read window (``early_read_window_s = 0``, or a
    kvd that predates it) unmaps what it lets go at once: its readers are admitted before they read."""

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config={"early_read_window_s": 0.0}, read_beside_admission=True)
        await admitted_before_reading(p)

    run(fabric, scenario)
