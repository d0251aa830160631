"""A warm pull's READs queued by the StartPull(s) that starts it, before any task of its step runs
(kvd.core.start_posts), then admitted beside them: every interleaving that matters, by hand.

Each test runs twice: with the transport queueing the admission in StartPulls too, as the gRPC
transport does (PeerTransport.ask_prepare_pull; sent right after the step's last READs), and with the
pull's task asking it (a transport that cannot queue it).

Two real daemons over the fake data planes and peer transport of lifetime_fakes.py. Each test
warms the pair with one whole pull first (the handshake cached, the lists prepared): only then
does a pull qualify. The fakes flag every lifetime violation (an AbandonPull or a FinishRead sent
with a READ of its pull not final among them). The rules: docs/lifetimes.md, "A READ beside its
admission" (the same), and the module docstring of kvd.core.start_posts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvtest import small_spec
from lifetime_fakes import Fabric, Gate
from test_core_lifetimes import (
    ABORTED,
    DONE,
    FAILED,
    HOLD_BLOCKS,
    LOCAL_BLOCKS,
    NUM_TOKENS,
    READING,
    Pair,
    assert_settled,
    ended,
    engine_events,
    make_pair,
    run,
    settle,
)

from kvd.core.daemon import PullOrder
from kvd.core.events import FinishedRecving, FinishedSending, LoadFailed
from kvd.core.start_posts import step_flush_points
from kvd.core.transfers import Transfer, TransferState


@pytest.fixture(params=[True, False], ids=["admission-asked-in-start", "admission-asked-by-task"])
def fabric(fabric: Fabric, request: pytest.FixtureRequest) -> Fabric:
    fabric.asks_early = request.param
    return fabric


async def warm_pair(fabric: Fabric, **reader_config: Any) -> Pair:
    """A pair whose reader has pulled once, to the end: its next pulls qualify."""
    p = await make_pair(fabric, read_beside_admission=True, **reader_config)
    transfer, _ = p.pull("warm-up")
    await p.reading(transfer)
    for xfer in p.reader.dataplane.live():
        p.reader.dataplane.finish(xfer)
    await ended(transfer)
    await settle(p.reader, p.holder)
    assert transfer.state is DONE
    return p


def start_warm(p: Pair, request_id: str) -> tuple[Transfer, str]:
    """Start a pull as an engine does (StartPulls) and check, before anything else runs, that its
    READs are queued, and its admission sent to the holder (after them) where the transport queues
    it, or not asked yet where the pull's task asks it."""
    prepared, sends = len(p.reader.transport.prepares), len(p.fabric.sends)
    lease, params = p.holder.daemon.hold("eng-h", request_id, HOLD_BLOCKS, NUM_TOKENS)
    (transfer,) = p.reader.daemon.start_pulls([PullOrder("eng-r", 0, request_id, LOCAL_BLOCKS, params)])
    assert isinstance(transfer, Transfer)
    assert transfer.state is READING and len(transfer.posts) == 2, "a warm pull queues its READs as it starts"
    assert len(p.reader.transport.prepares) == prepared, "the holder has run nothing of it yet"
    if p.fabric.asks_early:
        assert p.reader.transport.sent_asks[-1] == transfer.transfer_id
        assert [kind for kind, _ in p.fabric.sends[sends:]] == ["reads", "admissions"], "the READs, then the admission"
    else:
        assert transfer.transfer_id not in p.reader.transport.sent_asks, "the pull's task asks the admission"
    return transfer, lease.lease_id


def test_a_warm_pull_queues_its_reads_as_it_starts_and_ends_done_with_one_finish_read(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await warm_pair(fabric)
        transfer, lease_id = start_warm(p, "req-2")
        xfers = await asyncio.gather(*transfer.posts)
        await asyncio.sleep(0.01)
        assert not transfer.state.final, "a pull is never reported before its READs are final"
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await p.reader.transport.finished.reach(2)
        await settle(p.holder)
        assert transfer.state is DONE
        assert [e.request_id for e in engine_events(p.rrank, FinishedRecving)] == ["warm-up", "req-2"]
        finish = p.reader.transport.finishes[-1]
        assert finish["lease_id"] == lease_id and finish["nbytes"] == transfer.nbytes > 0
        assert [e.lease_id for e in engine_events(p.hrank, FinishedSending)][-1] == lease_id
        assert p.reader.transport.abandons == []
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_lease_released_before_the_admission_fails_the_pull_never_done(fabric: Fabric) -> None:
    """The lease ends after the READs were queued and before the holder is asked: the admission
    is refused, the bytes are discarded (FAILED, one LoadFailed, no FinishedRecving), and the
    AbandonPull goes only once the READs are final."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        transfer, lease_id = start_warm(p, "req-2")
        p.holder.daemon.release_lease(lease_id)
        xfers = await asyncio.gather(*transfer.posts)
        async with asyncio.timeout(5):
            while len(p.reader.transport.prepares) < 2:
                await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        assert not transfer.state.final, "a failed pull waits for its READs (the fence)"
        assert p.reader.transport.abandons == []
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.reader, p.holder)
        assert transfer.state is FAILED
        assert [e.request_id for e in engine_events(p.rrank, FinishedRecving)] == ["warm-up"]
        (failed,) = engine_events(p.rrank, LoadFailed)
        assert failed.request_id == "req-2" and failed.error_class == "UnknownLease"
        assert p.reader.transport.abandons[-1]["lease_id"] == lease_id
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_refused_admission_with_reads_in_flight_fences_and_reports_failed_once(fabric: Fabric) -> None:
    """The holder refuses while the READs still run: the pull is FENCING until they are final
    (never reported while a byte can land), then FAILED once."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        gate = p.reader.transport.prepare_gate = Gate()
        transfer, lease_id = start_warm(p, "req-2")
        await gate.arrived.reach(1)
        p.holder.daemon.release_lease(lease_id)
        gate.open()
        xfers = await asyncio.gather(*transfer.posts)
        await asyncio.sleep(0.02)
        assert transfer.state is TransferState.FENCING and not engine_events(p.rrank, LoadFailed)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert transfer.state is FAILED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_pull_cancelled_before_its_task_began_still_fences_reports_once_and_hands_back(fabric: Fabric) -> None:
    """A cancel in the very turn the pull started: asyncio never runs the task's body, yet the
    READs were queued (and the admission sent). The pull's end runs all the same: its admission
    withdrawn, ABORTED once its READs are final, one LoadFailed, every pin handed back, the
    holder told AbandonPull after the READs."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        transfer, lease_id = start_warm(p, "req-2")
        assert transfer.task is not None
        transfer.task.cancel()  # before it ever ran
        xfers = await asyncio.gather(*transfer.posts)
        await asyncio.sleep(0.01)
        if fabric.asks_early:  # its admission, sent in StartPulls, is withdrawn: nobody reads the answer
            assert p.reader.transport.withdrawn_asks == [transfer.transfer_id]
        assert not transfer.began and not transfer.state.final, "reported only once its READs are final"
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        async with asyncio.timeout(5):
            while not transfer.state.final:
                await asyncio.sleep(0.001)
        await settle(p.reader, p.holder)
        assert transfer.state is ABORTED
        (failed,) = engine_events(p.rrank, LoadFailed)
        assert failed.request_id == "req-2"
        assert [e.request_id for e in engine_events(p.rrank, FinishedRecving)] == ["warm-up"]
        await p.reader.transport.abandoned.reach(1)
        assert p.reader.transport.abandons[-1]["lease_id"] == lease_id
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_cold_pull_cancelled_before_its_task_began_is_reported_aborted_once(fabric: Fabric) -> None:
    """The same cancel for a pull that queued nothing (a first contact): ABORTED, one LoadFailed."""

    async def scenario() -> None:
        p = await make_pair(fabric, read_beside_admission=True)
        transfer, _ = p.pull("cold")
        assert transfer.posts == [] and transfer.task is not None
        transfer.task.cancel()
        async with asyncio.timeout(5):
            while not transfer.state.final:
                await asyncio.sleep(0.001)
        await settle(p.reader, p.holder)
        assert transfer.state is ABORTED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_step_queues_every_read_before_any_admission_and_each_pull_ends_on_its_own(fabric: Fabric) -> None:
    """StartPulls of four warm pulls: all eight READs queued before any PreparePull is built;
    one lease released meanwhile fails that pull alone (FAILED), the others end DONE."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        asked = len(p.reader.transport.prepares)
        orders, leases = [], []
        for i in range(4):
            lease, params = p.holder.daemon.hold("eng-h", f"step-{i}", HOLD_BLOCKS, NUM_TOKENS)
            orders.append(PullOrder("eng-r", 0, f"step-{i}", [(b + 2 * i) % 8 for b in LOCAL_BLOCKS], params))
            leases.append(lease.lease_id)
        transfers = p.reader.daemon.start_pulls(orders)
        assert all(isinstance(t, Transfer) and len(t.posts) == 2 for t in transfers)
        assert len(p.reader.transport.prepares) == asked
        p.holder.daemon.release_lease(leases[2])
        posted = [await asyncio.gather(*t.posts) for t in transfers]  # type: ignore[union-attr]
        for xfers in posted:
            for xfer in xfers:
                p.reader.dataplane.finish(xfer)
        for t in transfers:
            await ended(t)  # type: ignore[arg-type]
        await settle(p.reader, p.holder)
        states = [t.state for t in transfers]  # type: ignore[union-attr]
        assert states == [DONE, DONE, FAILED, DONE], states
        assert sorted(e.request_id for e in engine_events(p.rrank, FinishedRecving)) == [
            "step-0",
            "step-1",
            "step-3",
            "warm-up",
        ]
        assert [e.request_id for e in engine_events(p.rrank, LoadFailed)] == ["step-2"]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_step_sends_its_reads_in_growing_sends_before_any_admission_and_every_pull_ends_done(
    fabric: Fabric,
) -> None:
    """StartPulls of 14 warm pulls: their READs leave in sends of 1, 3, 9 and 1 pulls (the worker
    copies the first while the rest are planned), every one of them before any PreparePull is
    built; each pull then ends DONE on its own and the holder's leases all end."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        asked = len(p.reader.transport.prepares)
        plane = p.reader.dataplane
        orders = []
        for i in range(14):
            _, params = p.holder.daemon.hold("eng-h", f"step-{i}", HOLD_BLOCKS, NUM_TOKENS)
            orders.append(PullOrder("eng-r", 0, f"step-{i}", [(b + 2 * i) % 8 for b in LOCAL_BLOCKS], params))
        before, flushes = plane.asked, len(plane.flushed_at)
        transfers = p.reader.daemon.start_pulls(orders)
        assert all(isinstance(t, Transfer) and len(t.posts) == 2 for t in transfers)
        sent = [n - before for n in plane.flushed_at[flushes:]]
        assert sent == [2 * 1, 2 * 4, 2 * 13, 2 * 14], f"READs asked for at each send: {sent}"
        assert len(p.reader.transport.prepares) == asked, "the holder ran no admission before every send left"
        kinds = [kind if kind == "reads" else (kind, n) for kind, n in p.fabric.sends[-5:]]
        if fabric.asks_early:  # the step's 14 admissions in one send, right after its last READs
            assert kinds[-5:] == ["reads", "reads", "reads", "reads", ("admissions", 14)], kinds
        else:
            assert ("admissions", 14) not in p.fabric.sends
        posted = [await asyncio.gather(*t.posts) for t in transfers]  # type: ignore[union-attr]
        for xfers in posted:
            for xfer in xfers:
                plane.finish(xfer)
        for t in transfers:
            await ended(t)  # type: ignore[arg-type]
        await settle(p.reader, p.holder)
        assert [t.state for t in transfers] == [DONE] * 14  # type: ignore[union-attr]
        assert len(engine_events(p.rrank, FinishedRecving)) == 15  # the warm-up's and the step's
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_step_flush_points_grow_threefold_and_a_lone_pull_sends_once() -> None:
    """The schedule itself: sends of 1, 3, 9, 27... pulls; a step of one pull sends once (at its end)."""
    assert step_flush_points(1) == frozenset()
    assert step_flush_points(2) == {1}
    assert step_flush_points(4) == {1}
    assert step_flush_points(5) == {1, 4}
    assert step_flush_points(32) == {1, 4, 13}
    assert step_flush_points(1024) == {1, 4, 13, 40, 121, 364}


def test_a_pull_whose_holder_registered_again_queues_nothing_and_goes_the_usual_way(fabric: Fabric) -> None:
    """The lease names a registration the cached handshake does not (the holder's engine
    registered again): nothing is queued at the start; the pull handshakes again and ends DONE."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        await p.holder.daemon.unregister_engine("eng-h", 0)
        p.hrank = await fabric.register(p.holder, "eng-h", small_spec(8))
        transfer, _ = p.pull("req-2")
        assert transfer.posts == [] and not transfer.state.final
        await p.reading(transfer)
        for xfer in p.reader.dataplane.live():
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert transfer.state is DONE
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_reader_worker_lost_with_reads_queued_at_the_start_fails_the_pull_unavailable(fabric: Fabric) -> None:
    """The reader's data-plane worker dies with the READs queued as the pull started: they are
    final with it (a dead process delivers nothing), the pull FAILED once, nothing left pinned."""

    async def scenario() -> None:
        p = await warm_pair(fabric)
        transfer, _ = start_warm(p, "req-2")
        await asyncio.gather(*transfer.posts)
        p.reader.dataplane.lose()
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert transfer.state is FAILED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert [e.request_id for e in engine_events(p.rrank, FinishedRecving)] == ["warm-up"]

    run(fabric, scenario)


def test_a_failure_to_queue_the_admission_leaves_it_to_the_pulls_task_and_the_pull_ends_done(
    fabric: Fabric, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in queueing the admission (here: the transport raises) must not strand the READs
    already queued: it is logged, the pull's task asks the admission as usual, the pull is DONE."""

    async def scenario() -> None:
        p = await warm_pair(fabric)

        def broken(*_args: Any) -> None:
            raise RuntimeError("broken transport")

        p.reader.transport.ask_prepare_pull = broken  # type: ignore[method-assign]
        lease, params = p.holder.daemon.hold("eng-h", "req-2", HOLD_BLOCKS, NUM_TOKENS)
        (transfer,) = p.reader.daemon.start_pulls([PullOrder("eng-r", 0, "req-2", LOCAL_BLOCKS, params)])
        assert isinstance(transfer, Transfer) and len(transfer.posts) == 2, "its READs were queued all the same"
        for xfer in await asyncio.gather(*transfer.posts):
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert transfer.state is DONE
        assert p.reader.transport.prepares[-1]["reader_transfer_id"] == transfer.transfer_id
        assert [e.lease_id for e in engine_events(p.hrank, FinishedSending)][-1] == lease.lease_id
        assert "queueing the admission of pull" in caplog.text
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)
