"""Lifetimes of engine memory, peer agents, leases and pulls, every interleaving driven by hand.

Two real :class:`kvd.core.daemon.Daemon` objects (a holder and a reader) run in one event loop
over fake data planes and a fake peer transport (tests/unit/core/lifetime_fakes.py): the test
posts nothing itself, but decides when each NIXL READ ends (DONE, ERR, or never), when a
PreparePull reaches the holder, and what time the lease tables see. The fakes flag every
lifetime violation (memory deregistered, a list released, an agent removed, or AbandonPull sent
while a READ through it is not final); every test ends with no violation and no pin left.
Only fences wait on real time (a few tens of milliseconds): their outcome never depends on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kvtest import small_spec
from lifetime_fakes import SAFETY_TIMEOUT_S, Fabric, Gate, Node

from kvd.core import holder as holder_module
from kvd.core.dataplane import LOCAL_AGENT
from kvd.core.events import FinishedRecving, FinishedSending, LoadFailed
from kvd.core.local_memory import LocalMemory, MemoryState
from kvd.core.registry import EngineRank
from kvd.core.transfers import Transfer, TransferState
from kvd.layout.spec import KvLayout, LayoutSpec
from kvd.worker import vm
from kvd_client.errors import AlreadyExists, Internal

PLANNED, READING, POSTPROCESSING, FENCING = (
    TransferState.PLANNED,
    TransferState.READING,
    TransferState.POSTPROCESSING,
    TransferState.FENCING,
)
DONE, FAILED, ABORTED = TransferState.DONE, TransferState.FAILED, TransferState.ABORTED
HOLDER, READER = "holder.test:1", "reader.test:1"
HOLD_BLOCKS, NUM_TOKENS, LOCAL_BLOCKS = [0, 1, 2], 40, [3, 4, 5]  # 2 full blocks + 8 tokens: 2 READs
SHORT_FENCE_S = 0.05  # for tests whose READs never end: the fence gives up after this


@pytest.fixture
def kernel_placed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine memory placed by the kernel, which reuses a released region's addresses at once (as
    where kvd's address arena is unavailable, or for VRAM): what makes a peer reload its agent."""
    monkeypatch.setattr(vm, "ARENA", vm.AddressArena(base=0, end=0))


UNMAPS_AT_ONCE = {"early_read_window_s": 0.0}
"""A holder that unmaps memory it lets go at once (no READ beside an admission: nothing to keep
readable), so kernel-placed memory reuses the addresses right away."""


def run(fabric: Fabric, scenario: Callable[[], Awaitable[None]]) -> None:
    """Run the scenario, require no lifetime violation, then shut every daemon down."""

    async def main() -> None:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: errors.append(context["message"]))
        try:
            await scenario()
            assert fabric.violations == []
            assert errors == []  # no task died with an exception nobody saw
        finally:
            await fabric.close()

    asyncio.run(main())


@dataclasses.dataclass
class Pair:
    fabric: Fabric
    holder: Node
    reader: Node
    hrank: EngineRank
    rrank: EngineRank

    def pull(
        self, request_id: str = "req-1", local_blocks: list[int] | None = None, deadline_s: float = 0.0
    ) -> tuple[Transfer, str]:
        """Hold blocks on the holder and start pulling them into the reader (returns the lease id)."""
        lease, params = self.holder.daemon.hold("eng-h", request_id, HOLD_BLOCKS, NUM_TOKENS)
        transfer = self.reader.daemon.start_pull(
            "eng-r", 0, request_id, local_blocks or LOCAL_BLOCKS, params, deadline_s
        )
        return transfer, lease.lease_id

    async def reading(self, transfer: Transfer, reads: int = 2) -> list[Any]:
        """Wait until the pull posted its READs; returns them (none is final)."""
        dp = self.reader.dataplane
        before = {x for x in dp.posted}
        await dp.posts.reach(len(before) + reads)
        assert transfer.state is READING
        xfers = [x for x in dp.posted if x not in before]
        assert not any(x.final for x in xfers)
        return xfers


async def make_pair(
    fabric: Fabric,
    reader_spec: LayoutSpec | None = None,
    holder_config: dict[str, Any] | None = None,
    **reader_config: Any,
) -> Pair:
    """A holder and a reader with one engine each. The reader pulls the sequential way (the
    admission first, then the READs), whose interleavings these tests drive: conversions and
    holders that wait for commits still take it. ``read_beside_admission=True`` for the default
    way, whose own interleavings are tests/unit/daemon/core/test_core_read_beside_admission.py."""
    reader_config.setdefault("read_beside_admission", False)
    holder = await fabric.start_node(HOLDER, **(holder_config or {}))
    reader = await fabric.start_node(READER, **reader_config)
    hrank = await fabric.register(holder, "eng-h", small_spec(8))
    rrank = await fabric.register(reader, "eng-r", reader_spec or small_spec(8))
    return Pair(fabric, holder, reader, hrank, rrank)


def record_states(transfer: Transfer, probe: Callable[[], Any] = lambda: None) -> list[tuple[TransferState, Any]]:
    """Every state the pull enters, with ``probe()`` taken at that moment (wraps Transfer.advance)."""
    seen: list[tuple[TransferState, Any]] = []
    advance = transfer.advance

    def recording(state: TransferState, error: Any = None) -> None:
        advance(state, error)
        if transfer.state is state:
            seen.append((state, probe()))

    transfer.advance = recording  # type: ignore[method-assign]
    return seen


async def until_state(transfer: Transfer, state: TransferState) -> None:
    async with asyncio.timeout(SAFETY_TIMEOUT_S):
        async for current in transfer.changes():
            if current.state is state:
                return
            assert not current.state.final, f"the pull ended {current.state} before reaching {state}"


async def ended(transfer: Transfer) -> None:
    assert transfer.task is not None
    async with asyncio.timeout(SAFETY_TIMEOUT_S):
        await asyncio.gather(transfer.task, return_exceptions=True)
    assert transfer.state.final


async def settle(*nodes: Node) -> None:
    """Let the readers' FinishReads and AbandonPulls (those whose reads are final) reach their
    holders, then the unpins scheduled by lease callbacks, and the peers' warm-up after a
    handshake, run."""
    for node in nodes:
        telling = [t for n in node.transport.fabric.nodes.values() for t in n.daemon.puller.ending.telling]
        if telling:  # an AbandonPull whose reads never end keeps waiting: not for it
            await asyncio.wait(telling, timeout=0.2)
        await node.daemon.holder.followups.settle(5.0)
        if node.daemon.peers is not None:
            await node.daemon.peers.warmed()


async def finish_reads(p: Pair, xfers: list[Any], *transfers: Transfer) -> None:
    """NIXL ends each READ of ``xfers`` DONE; each of ``transfers`` must then end DONE, and the
    holder's unpins run."""
    for xfer in xfers:
        p.reader.dataplane.finish(xfer)
    for transfer in transfers:
        await ended(transfer)
    await settle(p.holder)
    assert all(t.state is DONE for t in transfers), [t.state for t in transfers]


async def sweep_round(node: Node) -> None:
    """One round of the daemon's sweeper (which the fixture keeps from running on its own)."""
    daemon = node.daemon
    daemon.leases.sweep()
    daemon.holds.lease_gauges()
    await daemon.memories.sweep_quarantine()
    await daemon.puller.sweep()
    await settle(node)


def engine_events(rank: EngineRank, kind: type) -> list[Any]:
    return [e for e in rank.pending if isinstance(e, kind)]


def registrations(memory: LocalMemory) -> list[Any]:
    return list(memory.nixl_registrations)


def assert_settled(*nodes: Node, memories: tuple[LocalMemory, ...] = ()) -> None:
    """No pin left anywhere, and the gauges agree with the tables they count."""
    for node in nodes:
        daemon = node.daemon
        known = [rank.memory for rank in daemon.registry] + list(daemon.memories.quarantine) + list(memories)
        assert all(m.pins == 0 and m.holder_pins == 0 for m in known), [(m.registration_id, m.pins) for m in known]
        assert all(agent.pins == 0 for agent in daemon.peers.agents())
        assert daemon.puller.stale_pulls == 0
        assert node.metric("kvd_transfers_in_flight") == len(daemon.transfers.in_flight()) == 0
        assert node.metric("kvd_admitted_reads") == daemon.leases.open_admissions
        assert node.metric("kvd_leases_draining") == daemon.leases.draining
        assert node.metric("kvd_quarantined_bytes") == daemon.memories.quarantined_bytes
        assert node.metric("kvd_nixl_reads_in_flight") == node.dataplane.in_flight() == 0


# --- the reader's engine unregisters during its pull ------------------------------------------------


def test_unregister_reader_rank_while_planned_aborts_once_and_deregisters_at_once(fabric: Fabric) -> None:
    """Unregistered while PreparePull is in flight: ABORTED, one LoadFailed, memory released (nothing posted)."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        gate = p.reader.transport.prepare_gate = Gate()
        transfer, _ = p.pull()
        await gate.arrived.reach(1)
        assert transfer.state is PLANNED
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)
        assert memory.pins == 1

        await p.reader.daemon.unregister_engine("eng-r", 0)
        await ended(transfer)
        gate.open()

        assert transfer.state is ABORTED
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        assert memory.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in regs)
        assert p.reader.dataplane.posted == []
        # The reader cannot tell whether its withdrawn PreparePull was admitted: it says the read
        # is over (at most once); the holder, which never saw the call, has nothing to end.
        assert len(p.reader.transport.abandons) <= 1
        assert p.holder.daemon.leases.open_admissions == 0  # the PreparePull never reached it
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_a_peer_dropped_after_admitting_the_read_is_told_the_read_is_over(fabric: Fabric) -> None:
    """The holder admits the read, but the reader drops the peer before posting anything (its own
    worker was replaced meanwhile, say): the pull fails, and the holder is told AbandonPull at
    once. Untold, it kept the admission to its deadline and retired its memory as a read never
    proven over (a quarantine the fleet flagged as a leak)."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        gate = p.reader.transport.prepare_gate = Gate()
        transfer, lease_id = p.pull()
        await gate.arrived.reach(1)
        (agent,) = p.reader.daemon.peers.agents()
        agent.removed = True  # as a data-plane restart leaves it: the pull cannot read through it
        gate.open()
        await ended(transfer)
        await settle(p.reader, p.holder)

        assert transfer.state is FAILED and p.reader.dataplane.posted == []
        assert [a["lease_id"] for a in p.reader.transport.abandons] == [lease_id]
        assert p.holder.daemon.leases.open_admissions == 0 and not p.hrank.memory.tainted

    run(fabric, scenario)


def test_unregister_reader_rank_while_reading_deregisters_only_after_reads_final(fabric: Fabric) -> None:
    """Unregistered with READs in flight: FENCING until they end, then ABORTED once, AbandonPull, release."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)

        await p.reader.daemon.unregister_engine("eng-r", 0)
        await until_state(transfer, FENCING)
        assert memory.state is MemoryState.FENCED and not any(p.reader.dataplane.deregistered(r) for r in regs)
        assert not engine_events(p.rrank, LoadFailed)  # not before the fence

        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert transfer.state is ABORTED
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        assert p.reader.metric("kvd_pull_fences_total", outcome="final") == 1
        assert memory.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in regs)
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_unregister_reader_rank_while_a_read_is_being_posted_waits_for_that_read(fabric: Fabric) -> None:
    """The engine dies while NIXL is still posting the pull's READ: the post completes on NIXL's
    thread whatever the pull does, so the pull fences that READ like any other (never reported
    before it, memory deregistered only after it is final). The pull used to forget a READ whose
    post it stopped waiting for, and freed the memory under it (a SIGSEGV over UCX TCP)."""

    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        dp = p.reader.dataplane
        gate = dp.read_gate = Gate()
        transfer, _ = p.pull()
        await gate.arrived.reach(1)
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)

        await p.reader.daemon.unregister_engine("eng-r", 0)
        await asyncio.sleep(SHORT_FENCE_S * 2)
        assert not transfer.state.final, "reported while its READ was still being posted"
        assert not any(dp.deregistered(r) for r in regs)
        dp.read_gate = None
        gate.open()
        await ended(transfer)  # the READ never ends: fenced by retiring the (unregistered) mapping
        (xfer,) = dp.live()
        assert transfer.state is ABORTED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert not any(dp.deregistered(r) for r in regs), "memory deregistered under a READ in flight"
        assert memory.state is MemoryState.QUARANTINED and memory.retired

        dp.finish(xfer)
        await p.reader.transport.abandoned.reach(1)  # the holder stops counting the read now
        await sweep_round(p.reader)
        await settle(p.holder)
        assert memory.state is MemoryState.RELEASED and all(dp.deregistered(r) for r in regs)
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_unregister_reader_rank_with_reads_nixl_never_ends_quarantines_until_they_do(fabric: Fabric) -> None:
    """READs that stay in flight past the fence: ABORTED once, the mapping retired and quarantined
    (never deregistered), no AbandonPull; a late finish frees it on the next quarantine sweep."""

    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)
        reader = p.reader.daemon

        await reader.unregister_engine("eng-r", 0)
        await ended(transfer)

        assert transfer.state is ABORTED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert p.reader.metric("kvd_pull_fences_total", outcome="quarantined") == 1
        assert memory.state is MemoryState.QUARANTINED and memory.retired and memory.pins == 0
        assert not any(p.reader.dataplane.deregistered(r) for r in regs)
        assert p.reader.metric("kvd_quarantined_bytes") == memory.size_bytes
        assert reader.puller.stale_pulls == 1 and reader.peers.agents()[0].pins == 1
        assert p.reader.transport.abandons == []

        await reader.memories.sweep_quarantine()  # still in flight: stays
        assert memory.state is MemoryState.QUARANTINED
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await reader.memories.sweep_quarantine()
        await reader.puller.sweep()
        await settle(p.holder)

        assert memory.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in regs)
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_reads_cut_off_past_the_fence_are_abandoned_at_the_holder_once_they_end(fabric: Fabric) -> None:
    """READs still in flight when their rank went: no AbandonPull while they run (the holder must
    keep counting them), and one as soon as NIXL ends them (here with an error, so no read
    notification reaches the holder): the holder's admission ends as abandoned, not at its deadline."""

    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        await p.reader.daemon.unregister_engine("eng-r", 0)
        await ended(transfer)
        assert transfer.state is ABORTED and p.reader.transport.abandons == []
        assert p.holder.metric("kvd_admitted_reads") == 1

        for xfer in xfers:
            p.reader.dataplane.fail(xfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        (abandon,) = p.reader.transport.abandons
        assert abandon["transfer_id"] == transfer.transfer_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.metric("kvd_admitted_reads") == 0
        await p.reader.daemon.memories.sweep_quarantine()
        await p.reader.daemon.puller.sweep()
        assert_settled(p.reader, p.holder, memories=(p.rrank.memory,))

    run(fabric, scenario)


def test_a_scrape_from_another_thread_reads_the_lease_gauges_computed_on_the_loop(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease gauges are computed when collected, not on every admission: a scrape on the
    metrics server's thread (not the loop) still sees an admitted read, then its end."""
    monkeypatch.setattr(holder_module, "CONNECT_POLL_S", 0.01)  # the handshake's fast polls end first

    async def scenario() -> None:
        p = await make_pair(fabric)
        registry = p.holder.daemon.metrics.registry
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        assert await asyncio.to_thread(registry.get_sample_value, "kvd_admitted_reads", {}) == 1
        assert await asyncio.to_thread(registry.get_sample_value, "kvd_leases_held", {}) == 1
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert await asyncio.to_thread(registry.get_sample_value, "kvd_admitted_reads", {}) == 0
        await asyncio.sleep(0.05)
        assert p.holder.dataplane.fast_poll_until == 0.0  # proven over, none open: the slowest poll

    run(fabric, scenario)


def test_a_served_handshake_polls_fast_while_the_reader_connects_then_slows_down(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader connects its NIXL agent right after the handshake and UCX needs the holder's
    progress for it: the holder's worker polls fast for CONNECT_POLL_S, then (no admission open)
    at the slowest poll again; an admission inside the window keeps its own deadline."""
    monkeypatch.setattr(holder_module, "CONNECT_POLL_S", 0.05)

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder = p.holder.daemon
        await settle(p.holder)
        assert p.holder.dataplane.fast_poll_until == 0.0
        before = time.monotonic()
        holder.handshake_info()
        assert p.holder.dataplane.fast_poll_until >= before + 0.05
        await asyncio.sleep(0.1)
        assert p.holder.dataplane.fast_poll_until == 0.0
        transfer, _ = p.pull()  # a handshake, then an admission that outlives the window
        xfers = await p.reading(transfer)
        await asyncio.sleep(0.1)
        assert p.holder.dataplane.fast_poll_until != 0.0  # the admission keeps its own deadline (fabric clock)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert p.holder.dataplane.fast_poll_until == 0.0

    run(fabric, scenario)


def test_unregister_reader_rank_while_fencing_reports_once_and_releases_after_reads_final(fabric: Fabric) -> None:
    """Unregistered while a cancelled pull fences: still one LoadFailed (ABORTED), and the mapping
    goes only once the READs are final."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)
        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await until_state(transfer, FENCING)

        await p.reader.daemon.unregister_engine("eng-r", 0)
        assert memory.state is MemoryState.FENCED and not any(p.reader.dataplane.deregistered(r) for r in regs)
        for xfer in xfers:
            p.reader.dataplane.fail(xfer)
        await until_state(transfer, ABORTED)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        assert p.reader.metric("kvd_pull_fences_total", outcome="final") == 1
        assert memory.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in regs)
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


class GatedConversion:
    """Wraps the worker's conversion (RegionTable.convert): its thread waits for the test before writing."""

    def __init__(self, regions: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._convert = regions.convert
        self._loop = loop
        self.entered: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.release = threading.Event()
        regions.convert = self

    def __call__(self, *args: Any) -> None:
        self._loop.call_soon_threadsafe(self.entered.set_result, None)
        assert self.release.wait(SAFETY_TIMEOUT_S)
        try:
            self._convert(*args)  # writes the engine's blocks
        finally:
            self._loop.call_soon_threadsafe(self.exited.set_result, None)


def test_unregister_reader_rank_while_postprocessing_reports_load_failed_once(fabric: Fabric) -> None:
    """Unregistered while the layout conversion runs: ABORTED, one LoadFailed, never FinishedRecving."""

    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        conversion = GatedConversion(p.reader.dataplane.region_table, asyncio.get_running_loop())
        transfer, _ = p.pull()
        for xfer in await p.reading(transfer):
            p.reader.dataplane.finish(xfer)
        await conversion.entered
        assert transfer.state is POSTPROCESSING
        memory = p.rrank.memory

        await p.reader.daemon.unregister_engine("eng-r", 0)
        conversion.release.set()
        await ended(transfer)
        await conversion.exited

        assert transfer.state is ABORTED
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        assert memory.state is MemoryState.RELEASED
        assert p.reader.metric("kvd_staging_bytes_in_use") == 0
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_load_failed_is_not_reported_while_the_conversion_still_writes_the_engine_blocks(fabric: Fabric) -> None:
    """The engine recomputes blocks it was told failed: no conversion may write them after that."""

    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        conversion = GatedConversion(p.reader.dataplane.region_table, asyncio.get_running_loop())
        transfer, _ = p.pull()
        for xfer in await p.reading(transfer):
            p.reader.dataplane.finish(xfer)
        await conversion.entered
        memory = p.rrank.memory
        regs = registrations(memory)

        await p.reader.daemon.unregister_engine("eng-r", 0)
        for _ in range(20):  # every step the pull can take on the loop alone
            await asyncio.sleep(0)
        told_while_converting = engine_events(p.rrank, LoadFailed)
        released_while_converting = [r for r in regs if p.reader.dataplane.deregistered(r)]
        conversion.release.set()
        await ended(transfer)
        await conversion.exited

        assert told_while_converting == [], "LoadFailed posted while the conversion still writes the blocks"
        assert released_while_converting == [], "engine mapping deregistered while the conversion writes it"

    run(fabric, scenario)


# --- the holder's engine unregisters during an admitted read ----------------------------------------


async def holder_unregisters_mid_read(p: Pair) -> tuple[Transfer, list[Any], LocalMemory, list[Any]]:
    transfer, _ = p.pull()
    xfers = await p.reading(transfer)
    memory, regs = p.hrank.memory, registrations(p.hrank.memory)
    assert memory.holder_pins == 1
    await p.holder.daemon.unregister_engine("eng-h", 0)
    await sweep_round(p.holder)  # the draining gauge is refreshed by the sweeper
    status = p.holder.daemon.status()
    assert memory.state is MemoryState.FENCED and not any(p.holder.dataplane.deregistered(r) for r in regs)
    assert status.leases_draining == 1 and status.admitted_reads == 1 and status.leases_held == 0
    assert p.holder.metric("kvd_leases_draining") == 1
    assert not engine_events(p.hrank, FinishedSending)
    return transfer, xfers, memory, regs


def test_holder_unregister_during_admitted_read_keeps_memory_until_the_read_notification(fabric: Fabric) -> None:
    """The lease drains and the memory stays registered until every part of the read arrived."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, xfers, memory, regs = await holder_unregisters_mid_read(p)

        p.reader.dataplane.finish(xfers[0])
        await settle(p.holder)
        assert memory.state is MemoryState.FENCED and p.holder.daemon.leases.draining == 1  # one part of two
        p.reader.dataplane.finish(xfers[1])
        await settle(p.holder)
        await ended(transfer)

        assert memory.state is MemoryState.RELEASED and all(p.holder.dataplane.deregistered(r) for r in regs)
        assert p.holder.daemon.leases.draining == 0
        assert p.holder.metric("kvd_leases_ended_total", reason="engine_gone") == 1
        assert not engine_events(p.hrank, FinishedSending)  # the engine is gone: nobody to tell
        assert transfer.state is DONE  # the memory stayed registered while it was read
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_holder_unregister_during_admitted_read_keeps_memory_until_the_reader_abandons(fabric: Fabric) -> None:
    """A reader that fenced its READs and abandoned ends the admission cleanly: memory released."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, xfers, memory, regs = await holder_unregisters_mid_read(p)

        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await until_state(transfer, FENCING)
        for xfer in xfers:
            p.reader.dataplane.fail(xfer)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert transfer.state is ABORTED
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert memory.state is MemoryState.RELEASED and all(p.holder.dataplane.deregistered(r) for r in regs)
        assert p.holder.daemon.leases.draining == 0
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_holder_unregister_during_admitted_read_past_deadline_and_margin_retires_memory(fabric: Fabric) -> None:
    """An admission never proven over ends at its deadline plus the margin: tainted, retired and
    quarantined, never deregistered while its reader may read; the lease drains until then. The
    reader's AbandonPull, once its READs are final, proves it over late: then the memory is freed."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, xfers, memory, regs = await holder_unregisters_mid_read(p)
        holder = p.holder.daemon

        fabric.clock.advance(holder.config.transfer_deadline_s + holder.config.read_admission_margin_s - 0.1)
        holder.leases.sweep()
        await settle(p.holder)
        assert memory.state is MemoryState.FENCED and holder.leases.draining == 1
        fabric.clock.advance(0.2)
        holder.leases.sweep()
        await settle(p.holder)

        assert p.holder.metric("kvd_admissions_ended_total", reason="timed_out") == 1
        # Its reader may still be reading (a stalled READ resumes; over TCP only as the holder
        # progresses): the worker keeps polling every 50 ms, never the 1 s of "nobody admitted".
        assert p.holder.dataplane.fast_poll_until != 0.0
        assert memory.state is MemoryState.QUARANTINED and memory.tainted and memory.retired
        assert not any(p.holder.dataplane.deregistered(r) for r in regs)
        assert holder.leases.draining == 0 and holder.status().quarantined_bytes == memory.size_bytes
        await holder.memories.sweep_quarantine()
        assert memory.state is MemoryState.QUARANTINED  # tainted: kept while its reader may read

        for xfer in xfers:  # the holder's pages are gone: the reader's READs fail
            p.reader.dataplane.fail(xfer)
        await ended(transfer)
        assert transfer.state is FAILED and len(engine_events(p.rrank, LoadFailed)) == 1
        await p.reader.transport.abandoned.reach(1)  # the peer was dropped (disconnected): told anyway
        await sweep_round(p.holder)
        assert memory.state is MemoryState.RELEASED and all(p.holder.dataplane.deregistered(r) for r in regs)
        assert holder.status().quarantined_bytes == 0
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_a_pull_never_reports_done_after_the_holder_gave_its_blocks_back(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric)
        holder = p.holder.daemon
        window = holder.config.transfer_deadline_s + holder.config.read_admission_margin_s
        transfer, lease_id = p.pull(deadline_s=4 * window)
        xfers = await p.reading(transfer)

        holder.release_lease(lease_id)  # the holder's engine is done with the request
        fabric.clock.advance(window + 1.0)  # a stalled READ, still well within the pull's deadline
        holder.leases.sweep()
        await settle(p.holder)
        # The read was admitted for the pull's own deadline: the lease drains, the blocks stay held.
        assert engine_events(p.hrank, FinishedSending) == []
        for xfer in xfers:  # the stalled READs resume and complete
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)

        assert transfer.state is DONE
        assert len(engine_events(p.hrank, FinishedSending)) == 1, "told once, after the read"

    run(fabric, scenario)


# --- peers: a re-handshake while another pull reads through the agent --------------------------------


def test_peer_refresh_with_a_read_in_flight_merges_new_memory_into_the_pinned_agent(fabric: Fabric) -> None:
    """An engine registered on the holder after the first handshake makes pull B re-handshake while
    pull A reads through the same agent: nothing was deregistered, so the fresh metadata is merged
    into the same agent (no reload, B reads at once); dropped peer, the agent goes once, after the
    last READ through it."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        await fabric.register(p.holder, "eng-b", small_spec(8))
        transfer_a, _ = p.pull()
        xfers_a = await p.reading(transfer_a)
        (agent,) = reader.peers.agents()
        assert agent.pins == 1 and dp.remotes == {agent.name: 1}

        await fabric.register(p.holder, "eng-c", small_spec(8))  # after the reader's handshake
        _, params = holder.hold("eng-c", "req-c", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-c", [6, 7, 0], params)
        xfers_b = await p.reading(transfer_b)

        assert p.reader.transport.handshakes == [HOLDER, HOLDER]  # refreshed once
        assert reader.peers.agents() == [agent] and agent.pins == 2 and dp.remotes == {agent.name: 2}
        assert dp.removals(agent.name) == 0 and p.reader.metric("kvd_agent_reloads_total") == 0

        await reader.peers.drop(HOLDER, "test")  # e.g. idle or unreachable: the pins keep the agent
        assert dp.removals(agent.name) == 0 and p.reader.transport.forgets == [HOLDER]
        for xfer in xfers_a:
            dp.finish(xfer)
        await ended(transfer_a)
        assert transfer_a.state is DONE and dp.removals(agent.name) == 0 and agent.pins == 1
        for xfer in xfers_b:
            dp.finish(xfer)
        await ended(transfer_b)
        await settle(p.holder)

        assert transfer_b.state is DONE
        assert dp.removals(agent.name) == 1 and agent.removed and agent.name not in dp.remotes
        assert reader.peers.agents() == [] and p.reader.metric("kvd_remote_agents") == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


@pytest.mark.usefixtures("kernel_placed_memory")
def test_a_holder_that_replaced_memory_is_reloaded_once_the_reads_through_it_end(fabric: Fabric) -> None:
    """eng-b unregisters and registers again after the reader loaded its memory: merging the fresh
    metadata would leave the old region loaded under the new one (NIXL then fails or misresolves the
    new engine's lists). So pull B waits while pull A reads through the agent, the agent is removed
    and loaded afresh, and B reads through the new one; no list is ever prepared over a stale
    region (the fake NIXL flags it), and both pulls end DONE."""

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config=UNMAPS_AT_ONCE)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        await fabric.register(p.holder, "eng-b", small_spec(8))
        transfer_a, _ = p.pull()
        xfers_a = await p.reading(transfer_a)
        (agent,) = reader.peers.agents()
        old = {r.reg_id: r for r in p.holder.dataplane.live_registrations()}

        await holder.unregister_engine("eng-b", 0)
        await fabric.register(p.holder, "eng-b", small_spec(8))
        (fresh,) = [r for r in p.holder.dataplane.live_registrations() if r.reg_id not in old]
        stale = [r for r in old.values() if not r.live]
        assert any(fresh.overlaps(r.address, r.address + r.size) for r in stale), (
            "precondition: the new registration reuses the old one's addresses (the kernel places it)"
        )
        _, params = holder.hold("eng-b", "req-b", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-b", [6, 7, 0], params)
        await asyncio.sleep(0.05)
        assert transfer_b.state is PLANNED and agent.reloading and dp.removals(agent.name) == 0, (
            "pull B must wait for the reload, and the agent must stay while A reads through it"
        )

        for xfer in xfers_a:
            dp.finish(xfer)
        await ended(transfer_a)
        assert transfer_a.state is DONE
        xfers_b = await p.reading(transfer_b)
        (new_agent,) = reader.peers.agents()
        assert new_agent is not agent and agent.removed and dp.removals(agent.name) == 1
        assert dp.remotes == {agent.name: 1} and p.reader.metric("kvd_agent_reloads_total") == 1
        for xfer in xfers_b:
            dp.finish(xfer)
        await ended(transfer_b)
        await settle(p.holder)
        assert transfer_b.state is DONE
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


async def pair_with_engine_b(fabric: Fabric) -> tuple[Pair, Any]:
    """A pair whose holder also serves eng-b, and eng-b's registration (to find lists over it)."""
    p = await make_pair(fabric)
    before = set(p.holder.dataplane.live_registrations())
    await fabric.register(p.holder, "eng-b", small_spec(8))
    (registration,) = [r for r in p.holder.dataplane.live_registrations() if r not in before]
    return p, registration


def test_a_warm_up_list_that_raced_the_holders_unregistration_is_never_read(fabric: Fabric) -> None:
    """The warm-up after a handshake prepares the peer's lists holding no pin, so the peer may
    deregister an engine while its list is being prepared (seen once in CI, where it happened by
    chance). That list is over the old registration, which NIXL still has loaded: it may be
    prepared, but no READ is ever posted on it; the engine's next pull reads through its fresh
    registration, and the stale list is released with the rest."""

    async def scenario() -> None:
        p, old_b = await pair_with_engine_b(fabric)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        entered, release = threading.Event(), threading.Event()
        prepare_table = dp.prepare_table

        def prepare_held_over_b(agent_name: str, rows: Any, mem_type: str) -> Any:
            if agent_name != LOCAL_AGENT and int(rows[:, 0].min()) >= old_b.address:
                entered.set()  # the warm-up's list over eng-b: hold it until eng-b is replaced
                assert release.wait(SAFETY_TIMEOUT_S)
            return prepare_table(agent_name, rows, mem_type)

        dp.prepare_table = prepare_held_over_b  # type: ignore[method-assign]
        transfer_a, _ = p.pull()  # from eng-h: its handshake starts the warm-up
        xfers_a = await p.reading(transfer_a)
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            while not entered.is_set():
                await asyncio.sleep(0.001)

        await holder.unregister_engine("eng-b", 0)
        assert p.holder.dataplane.deregistered(old_b)
        await fabric.register(p.holder, "eng-b", small_spec(8))
        release.set()
        await settle(p.reader)
        dp.prepare_table = prepare_table  # type: ignore[method-assign]

        _, params = holder.hold("eng-b", "req-b", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-b", [6, 7, 0], params)
        await finish_reads(p, xfers_a + await p.reading(transfer_b), transfer_a, transfer_b)
        assert_settled(p.reader, p.holder)

        (agent,) = reader.peers.agents()
        await reader.peers.refresh(HOLDER, "no pull reads through the agent: lists of gone engines are released")
        over_old_b = [t for t in dp.tables if t.agent == agent.name and old_b.overlaps(t.lo, t.hi)]
        assert over_old_b and all(t.released for t in over_old_b)

    run(fabric, scenario)


def test_a_holder_that_replaced_memory_in_its_arena_needs_no_reload(fabric: Fabric) -> None:
    """The same re-registration with kvd's address arena: the new mapping never reuses the old
    one's addresses, so the fresh metadata is merged (no reload, no new connection) and pull B
    reads while pull A still reads through the same agent."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        await fabric.register(p.holder, "eng-b", small_spec(8))
        transfer_a, _ = p.pull()
        xfers_a = await p.reading(transfer_a)
        (agent,) = reader.peers.agents()
        old = list(p.holder.dataplane.live_registrations())

        await holder.unregister_engine("eng-b", 0)
        await fabric.register(p.holder, "eng-b", small_spec(8))
        (fresh,) = [r for r in p.holder.dataplane.live_registrations() if r not in old]
        assert not any(fresh.overlaps(r.address, r.address + r.size) for r in old)
        _, params = holder.hold("eng-b", "req-b", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-b", [6, 7, 0], params)
        xfers_b = await p.reading(transfer_b)
        assert reader.peers.agents() == [agent] and not agent.reloading and dp.removals(agent.name) == 0
        await finish_reads(p, xfers_a + xfers_b, transfer_a, transfer_b)
        assert p.reader.metric("kvd_agent_reloads_total") == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_lists_over_a_replaced_registration_go_when_the_last_pull_reading_through_the_agent_ends(
    fabric: Fabric,
) -> None:
    """A re-handshake while pulls read through the agent cannot release the lists over the
    registrations the peer no longer serves (a pull planned before it may still use one): they
    are released when the last of those pulls ends, with no further handshake, and the lists the
    peer still serves stay."""

    async def scenario() -> None:
        p, old_b = await pair_with_engine_b(fabric)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        transfer_a, _ = p.pull()
        xfers_a = await p.reading(transfer_a)
        await reader.peers.warmed()  # the handshake's warm-up prepared a list over every engine
        (agent,) = reader.peers.agents()

        def lists_over(registration: Any) -> list[Any]:
            return [t for t in dp.tables if t.agent == agent.name and registration.overlaps(t.lo, t.hi)]

        assert lists_over(old_b) and not any(t.released for t in lists_over(old_b))
        await holder.unregister_engine("eng-b", 0)
        await fabric.register(p.holder, "eng-b", small_spec(8))
        _, params = holder.hold("eng-b", "req-b", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-b", [6, 7, 0], params)  # re-handshakes
        xfers_b = await p.reading(transfer_b)
        assert reader.peers.agents() == [agent]
        assert not any(t.released for t in lists_over(old_b)), "pull A may still read through them"

        await finish_reads(p, xfers_a + xfers_b, transfer_a, transfer_b)
        assert_settled(p.reader, p.holder)
        assert all(t.released for t in lists_over(old_b)), "released once no pull pinned the agent"
        kept = [t for t in dp.tables if t.agent == agent.name and not t.released]
        assert kept and agent.trim_lists_to is None  # the lists of what the peer serves stay

    run(fabric, scenario)


@pytest.mark.usefixtures("kernel_placed_memory")
def test_a_reload_that_cannot_wait_fails_that_pull_and_the_next_pull_reloads(fabric: Fabric) -> None:
    """Pull A's READ never ends, so the agent cannot be reloaded within the wait: pull B fails
    UNAVAILABLE (naming the reason) and nothing is prepared over the stale region; once A's READ
    ends, the next pull reloads the agent and reads through the fresh one."""

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config=UNMAPS_AT_ONCE)
        holder, reader, dp = p.holder.daemon, p.reader.daemon, p.reader.dataplane
        await fabric.register(p.holder, "eng-b", small_spec(8))
        transfer_a, _ = p.pull()
        xfers_a = await p.reading(transfer_a)
        (agent,) = reader.peers.agents()
        reader.peers._reload_wait_s = 0.05

        await holder.unregister_engine("eng-b", 0)
        await fabric.register(p.holder, "eng-b", small_spec(8))
        _, params = holder.hold("eng-b", "req-b", HOLD_BLOCKS, NUM_TOKENS)
        transfer_b = reader.start_pull("eng-r", 0, "req-b", [6, 7, 0], params)
        await ended(transfer_b)
        assert transfer_b.state is FAILED and "still read through the previous view" in transfer_b.error.message
        assert agent.reloading and dp.removals(agent.name) == 0

        for xfer in xfers_a:
            dp.finish(xfer)
        await ended(transfer_a)
        assert transfer_a.state is DONE
        _, params = holder.hold("eng-b", "req-c", HOLD_BLOCKS, NUM_TOKENS)
        transfer_c = reader.start_pull("eng-r", 0, "req-c", [6, 7, 0], params)
        xfers_c = await p.reading(transfer_c)
        assert dp.removals(agent.name) == 1 and reader.peers.agents()[0] is not agent
        for xfer in xfers_c:
            dp.finish(xfer)
        await ended(transfer_c)
        await settle(p.holder)
        assert transfer_c.state is DONE
        # B's admission at the holder ends at its deadline (it never read): move the clock past it.
        fabric.clock.advance(60)
        await sweep_round(p.holder)
        await settle(p.holder)
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- leases: release, expiry, a second reader during an admitted read --------------------------------


def test_lease_release_during_admitted_read_drains_until_the_read_is_over(fabric: Fabric) -> None:
    """ReleaseLease while a read is admitted: draining, no FinishedSending until the read ends, then once."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        holder = p.holder.daemon

        holder.release_lease(lease_id)
        assert holder.status().leases_draining == 1 and p.holder.metric("kvd_leases_draining") == 1
        assert p.hrank.memory.holder_pins == 1 and not engine_events(p.hrank, FinishedSending)
        p.reader.dataplane.finish(xfers[0])
        assert not engine_events(p.hrank, FinishedSending)
        p.reader.dataplane.finish(xfers[1])
        await ended(transfer)
        await settle(p.holder)

        (sent,) = engine_events(p.hrank, FinishedSending)
        assert sent.lease_id == lease_id and not sent.expired
        assert p.holder.metric("kvd_leases_ended_total", reason="released") == 1
        assert transfer.state is DONE and len(engine_events(p.rrank, FinishedRecving)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_lease_expiry_during_admitted_read_drains_until_the_read_is_over(fabric: Fabric) -> None:
    """A lease past its ttl (admission not yet past its margin) drains; FinishedSending(expired) after the read."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        holder = p.holder.daemon

        fabric.clock.advance(holder.config.transfer_deadline_s + 1.0)  # < deadline + margin
        holder.leases.sweep()
        await settle(p.holder)
        assert holder.leases.draining == 1 and holder.leases.open_admissions == 1
        assert not engine_events(p.hrank, FinishedSending)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)

        (sent,) = engine_events(p.hrank, FinishedSending)
        assert sent.lease_id == lease_id and sent.expired
        assert transfer.state is DONE
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_second_reader_of_an_admitted_rank_gets_failed_precondition(fabric: Fabric) -> None:
    """Another pull of the same lease for the same reader rank is refused while the first is admitted."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        params = p.holder.daemon.params_of(p.holder.daemon.leases.get(lease_id))

        second = p.reader.daemon.start_pull("eng-r", 0, "req-2", [6, 7, 0], params)  # another request
        await ended(second)
        assert second.state is FAILED and second.error is not None
        assert second.error.code.name == "FAILED_PRECONDITION"
        assert p.holder.daemon.leases.open_admissions == 1 and not engine_events(p.hrank, FinishedSending)

        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert transfer.state is DONE and len(engine_events(p.hrank, FinishedSending)) == 1
        assert [type(e) for e in p.rrank.pending] == [LoadFailed, FinishedRecving]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- a StartPull asked again (a caller's retry) ------------------------------------------------------


def test_the_same_pull_asked_again_while_it_runs_is_that_pull(fabric: Fabric) -> None:
    """A retry of StartPull (same request, blocks and lease) while the pull reads gets the same
    transfer: no second admission at the holder, and the engine hears of the request once."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        lease = p.holder.daemon.leases.get(lease_id)
        params = dataclasses.replace(p.holder.daemon.params_of(lease), lease_expires_unix_ms=1)  # renewed since

        again = p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params)
        assert again is transfer
        assert p.reader.daemon.transfers.in_flight() == [transfer]
        assert p.reader.metric("kvd_transfers_in_flight") == 1

        await finish_reads(p, xfers, transfer)
        assert [type(e) for e in p.rrank.pending] == [FinishedRecving]
        assert len(engine_events(p.hrank, FinishedSending)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_the_same_pull_asked_again_after_it_is_done_is_answered_done_and_reads_nothing(fabric: Fabric) -> None:
    """A retry that arrives after the pull ended DONE (its first answer was lost) gets that
    transfer, DONE: no new pull (the lease is over), no second event for the engine."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        params = p.holder.daemon.params_of(p.holder.daemon.leases.get(lease_id))
        await finish_reads(p, await p.reading(transfer), transfer)
        posted = len(p.reader.dataplane.posted)

        again = p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params)
        assert again is transfer and again.state is DONE
        assert len(p.reader.dataplane.posted) == posted and not p.reader.daemon.transfers.any_in_flight()
        assert [type(e) for e in p.rrank.pending] == [FinishedRecving]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_another_pull_of_a_request_whose_pull_runs_is_already_exists_and_changes_nothing(fabric: Fabric) -> None:
    """Same request, other local blocks (or another lease) while its pull runs: ALREADY_EXISTS,
    raised before anything starts; the running pull is untouched."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        params = p.holder.daemon.params_of(p.holder.daemon.leases.get(lease_id))

        with pytest.raises(AlreadyExists, match=f"request 'req-1' .* in flight \\(transfer {transfer.transfer_id}\\)"):
            p.reader.daemon.start_pull("eng-r", 0, "req-1", [6, 7, 0], params)
        with pytest.raises(AlreadyExists):
            p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, dataclasses.replace(params, lease_id="other"))
        assert p.reader.daemon.transfers.in_flight() == [transfer] and not p.rrank.pending

        await finish_reads(p, xfers, transfer)
        assert [type(e) for e in p.rrank.pending] == [FinishedRecving]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


@pytest.mark.parametrize("notifications", [False, True], ids=["finish-read", "notifications"])
def test_a_request_whose_pull_failed_or_ended_can_be_pulled_again(fabric: Fabric, notifications: bool) -> None:
    """After an ABORTED pull the same order starts a new pull (the retry of a failure); after a
    DONE one, a different order for the request starts one too. The aborted pull's READs end
    DONE within its fence: READs that notify the holder end its lease then (the retry finds it
    gone), READs that do not leave it to the reader, whose AbandonPull keeps it for the retry."""

    async def scenario() -> None:
        p = await make_pair(fabric, read_notifications=notifications)
        transfer, lease_id = p.pull()
        params = p.holder.daemon.params_of(p.holder.daemon.leases.get(lease_id))
        xfers = await p.reading(transfer)
        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await until_state(transfer, FENCING)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        await settle(p.holder)
        assert transfer.state is ABORTED

        retry = p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params)  # the very same order
        assert retry is not transfer
        if notifications:
            await ended(retry)  # a pull of its own: the holder ended that lease with the abandoned read
            assert retry.state is FAILED and retry.error is not None and retry.error.code.name == "NOT_FOUND"
        else:
            await finish_reads(p, await p.reading(retry), retry)  # the lease was kept: the retry reads it

        anew, _ = p.pull()  # a new hold of the request
        await finish_reads(p, await p.reading(anew), anew)
        other, _ = p.pull(local_blocks=[6, 7, 0])  # after a DONE pull, another order of the request
        assert other is not anew
        await finish_reads(p, await p.reading(other), other)
        retried = LoadFailed if notifications else FinishedRecving
        assert [type(e) for e in p.rrank.pending] == [LoadFailed, retried, FinishedRecving, FinishedRecving]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_pull_with_one_failed_part_fences_the_other_and_never_reports_done(fabric: Fabric) -> None:
    """Part 0 fails while part 1 is in flight: FENCING until part 1 is final, then FAILED, never DONE."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        states = record_states(transfer)
        xfers = await p.reading(transfer)

        p.reader.dataplane.fail(xfers[0])
        await until_state(transfer, FENCING)
        p.reader.dataplane.finish(xfers[1])  # its notification is one part of two
        await ended(transfer)
        await settle(p.holder)

        assert [s for s, _ in states] == [READING, FENCING, FAILED]
        assert transfer.error is not None and transfer.error.code.name == "UNAVAILABLE"
        assert not engine_events(p.rrank, FinishedRecving) and len(engine_events(p.rrank, LoadFailed)) == 1
        assert p.reader.metric("kvd_pull_fences_total", outcome="final") == 1
        assert not engine_events(p.hrank, FinishedSending)  # the holder saw one part of two
        assert_settled(p.reader)

    run(fabric, scenario)


# --- deadline and cancel with a READ NIXL cannot cancel at once ---------------------------------------


def test_deadline_with_a_read_that_never_ends_remaps_host_memory_then_fails(fabric: Fabric) -> None:
    """Past its deadline the pull goes FENCING, re-maps the shm mapping (new LocalMemory and
    registration id, the old one retired and quarantined), and only then FAILED (DEADLINE_EXCEEDED);
    no AbandonPull. A late finish of the stale READ frees the old mapping on the next sweep."""

    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=0.1)
        reader = p.reader.daemon
        old = p.rrank.memory
        old_regs = registrations(old)
        transfer, _ = p.pull(deadline_s=1.0)  # planning and posting take a few ms of it
        states = record_states(transfer, lambda: (p.rrank.memory is old, old.retired))
        xfers = await p.reading(transfer)

        await ended(transfer)

        assert states == [(READING, (True, False)), (FENCING, (True, False)), (FAILED, (False, True))]
        assert transfer.error is not None and transfer.error.code.name == "DEADLINE_EXCEEDED"
        (failed,) = engine_events(p.rrank, LoadFailed)
        assert failed.error_code == "DEADLINE_EXCEEDED" and not engine_events(p.rrank, FinishedRecving)
        fresh = p.rrank.memory
        assert isinstance(fresh, LocalMemory) and fresh is not old and fresh.usable
        assert fresh.registration_id != old.registration_id and fresh.addresses != old.addresses
        assert old.state is MemoryState.QUARANTINED and old.retired
        assert not any(p.reader.dataplane.deregistered(r) for r in old_regs)
        assert p.reader.metric("kvd_pull_fences_total", outcome="remapped") == 1
        assert p.reader.metric("kvd_quarantined_bytes") == old.size_bytes
        assert p.reader.transport.abandons == [] and not any(x.final for x in xfers)

        for xfer in xfers:  # NIXL ends the READs late: their bytes went to the retired pages
            p.reader.dataplane.finish(xfer)
        await reader.memories.sweep_quarantine()
        await reader.puller.sweep()
        await settle(p.holder)

        assert old.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in old_regs)
        assert_settled(p.reader, p.holder, memories=(old, fresh))

    run(fabric, scenario)


def test_cancel_with_a_read_that_ends_within_the_fence_aborts_once_and_abandons(fabric: Fabric) -> None:
    """CancelTransfer with READs in flight: FENCING; they end within the fence: ABORTED once,
    fence outcome "final", AbandonPull sent (after the READs were final), no re-map."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        states = record_states(transfer)
        xfers = await p.reading(transfer)
        memory = p.rrank.memory

        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await until_state(transfer, FENCING)
        p.reader.dataplane.finish(xfers[0])
        p.reader.dataplane.fail(xfers[1])
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert [s for s, _ in states] == [READING, FENCING, ABORTED]
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        assert p.reader.metric("kvd_pull_fences_total", outcome="final") == 1
        assert p.reader.metric("kvd_pull_fences_total", outcome="remapped") == 0 and p.rrank.memory is memory
        (abandon,) = p.reader.transport.abandons
        assert abandon["lease_id"] == lease_id and abandon["transfer_id"] == transfer.transfer_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.daemon.leases.open_admissions == 0 and p.hrank.memory.holder_pins == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_cancel_while_the_admission_answer_is_in_flight_abandons_the_admitted_read(fabric: Fabric) -> None:
    """CancelTransfer after the holder admitted the read but before its answer arrived (it is lost
    with the withdrawn call): the reader posted nothing, and it tells the holder so (AbandonPull),
    which ends the admission at once instead of at its deadline, with the holder's memory intact."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        p.reader.transport.reply_gate = gate = Gate()
        transfer, lease_id = p.pull()
        await gate.arrived.reach(1)  # admitted by the holder
        assert p.holder.daemon.leases.open_admissions == 1

        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)

        assert transfer.state is ABORTED and not p.reader.dataplane.reads
        (abandon,) = p.reader.transport.abandons
        assert abandon["lease_id"] == lease_id and abandon["transfer_id"] == transfer.transfer_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.daemon.leases.open_admissions == 0 and p.hrank.memory.holder_pins == 0
        assert not p.hrank.memory.retired
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- re-map races ----------------------------------------------------------------------------------


async def fence_into_remap(p: Pair) -> tuple[Transfer, list[Any], LocalMemory, Gate]:
    """Cancel a reading pull; its fence times out and stops inside the re-map's NIXL registration."""
    transfer, _ = p.pull()
    xfers = await p.reading(transfer)
    old = p.rrank.memory
    gate = p.reader.dataplane.register_gate = Gate()
    p.reader.daemon.cancel_transfer(transfer.transfer_id)
    await gate.arrived.reach(1)
    assert transfer.state is FENCING
    return transfer, xfers, old, gate


def test_unregister_during_a_fence_remap_releases_the_fresh_mapping(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        transfer, xfers, old, gate = await fence_into_remap(p)

        await p.reader.daemon.unregister_engine("eng-r", 0)
        gate.open()
        await ended(transfer)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await p.reader.daemon.memories.sweep_quarantine()
        await p.reader.daemon.puller.sweep()

        assert transfer.state is ABORTED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert old.state is MemoryState.RELEASED
        size = old.size_bytes
        leaked = [r for r in p.reader.dataplane.live_registrations() if r.size == size]
        assert leaked == [], f"{len(leaked)} mapping(s) of the unregistered rank still registered"

    run(fabric, scenario)


def test_two_pulls_fencing_the_same_rank_leave_no_orphan_mapping(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        dp = p.reader.dataplane
        first, _ = p.pull("req-1", [3, 4, 5])
        xfers = await p.reading(first)
        _, params = p.holder.daemon.hold("eng-h", "req-2", [3, 4, 5], NUM_TOKENS)
        second = p.reader.daemon.start_pull("eng-r", 0, "req-2", [6, 7, 0], params)
        xfers += await p.reading(second)
        old, size = p.rrank.memory, p.rrank.memory.size_bytes
        gate = dp.register_gate = Gate()

        p.reader.daemon.cancel_transfer(first.transfer_id)
        p.reader.daemon.cancel_transfer(second.transfer_id)
        await gate.arrived.reach(1)  # one fence re-maps; the other waits for it instead of re-mapping again
        gate.open()
        await ended(first)
        await ended(second)
        for xfer in xfers:
            dp.finish(xfer)
        await p.reader.daemon.memories.sweep_quarantine()
        await p.reader.daemon.puller.sweep()

        assert old.state is MemoryState.RELEASED
        current = {id(r) for r in registrations(p.rrank.memory)}
        orphans = [r for r in dp.live_registrations() if id(r) not in current and r.size == size]
        assert orphans == [], f"{len(orphans)} engine mapping(s) registered for no rank"

    run(fabric, scenario)


def test_a_failed_remap_still_ends_the_pull_and_tells_the_engine_once(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        p.reader.dataplane.register_errors.append(Internal("NIXL could not register memory"))
        transfer, _ = p.pull()
        await p.reading(transfer)
        xfers = list(p.reader.dataplane.posted)
        p.reader.daemon.cancel_transfer(transfer.transfer_id)
        while p.reader.dataplane.register_errors != []:  # the re-map tried, and failed
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        # Unfenced, the failure waits for the reads rather than risk a late byte; then it ends.
        assert transfer.state is TransferState.FENCING and engine_events(p.rrank, LoadFailed) == []
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)

        assert transfer.state is ABORTED and len(engine_events(p.rrank, LoadFailed)) == 1

    run(fabric, scenario)


def test_quarantine_keeps_the_lists_of_a_stale_read_until_it_is_final(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        transfer, _ = p.pull()
        await p.reading(transfer)
        await p.reader.daemon.unregister_engine("eng-r", 0)
        await ended(transfer)
        assert p.rrank.memory.state is MemoryState.QUARANTINED
        assert fabric.table_violations == []

    run(fabric, scenario)


def test_an_idle_peer_is_forgotten_but_never_under_a_pull(fabric: Fabric) -> None:
    """peer_idle_s: a peer unused that long is dropped (channel closed, agent removed), unless a
    pull still reads through its agent; then it goes once that pull's READs are final."""

    async def scenario() -> None:
        p = await make_pair(fabric, peer_idle_s=0.05)
        reader, dp = p.reader.daemon, p.reader.dataplane
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        (agent,) = reader.peers.agents()
        await asyncio.sleep(0.1)
        await reader.peers.forget_idle()
        assert reader.peers.sessions() != [] and dp.removals(agent.name) == 0, "dropped under a pull"

        for xfer in xfers:
            dp.finish(xfer)
        await ended(transfer)
        assert transfer.state is DONE
        await asyncio.sleep(0.1)
        await reader.peers.forget_idle()
        await settle(p.holder)

        assert reader.peers.sessions() == [] and reader.peers.agents() == []
        assert dp.removals(agent.name) == 1 and p.reader.transport.forgets == [HOLDER]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)
