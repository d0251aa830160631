"""An engine's own unregistration (UnregisterKvCache: ``until_let_go``) returns only once nothing
of the daemon can write or read the rank's memory any more, so the engine may reuse it at once:
its pulls' READs final (or their mapping retired), its peers' admitted reads over. Before, it
returned at once, and a READ still in flight landed in memory the engine had reused (found by
tests/integration/test_unregister_mid_read.py). Bounded: past the fence and a margin it returns
anyway. Driven by hand over the lifetime fakes (test_core_lifetimes)."""

from __future__ import annotations

import asyncio

import pytest
from lifetime_fakes import Fabric
from test_core_lifetimes import (
    ABORTED,
    DONE,
    SHORT_FENCE_S,
    assert_settled,
    ended,
    make_pair,
    registrations,
    run,
    settle,
    sweep_round,
)

from kvd.core import engines as engines_module
from kvd.core.local_memory import MemoryState


async def not_yet(task: asyncio.Task[None], turns_s: float = 0.05) -> None:
    """The task is still waiting after ``turns_s`` of the loop running everything else."""
    await asyncio.sleep(turns_s)
    assert not task.done(), "the unregistration answered while its memory could still be touched"


def test_it_returns_only_once_the_pulls_reads_into_the_memory_are_final(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory, regs = p.rrank.memory, registrations(p.rrank.memory)
        unregistering = asyncio.create_task(p.reader.daemon.unregister_engine("eng-r", 0, until_let_go=True))
        await not_yet(unregistering)
        assert not p.reader.daemon.registry.ranks_of("eng-r"), "fenced at once all the same"

        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await asyncio.wait_for(unregistering, 5.0)
        assert memory.state is MemoryState.RELEASED and all(p.reader.dataplane.deregistered(r) for r in regs)
        await ended(transfer)
        assert transfer.state is ABORTED
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder)
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_reads_nixl_never_ends_it_returns_once_the_mapping_is_retired(fabric: Fabric) -> None:
    """READs that never end: the pull's fence retires the mapping (a late copy lands in throw-away
    pages, never in the engine's), and then it returns, well before its bound."""

    async def scenario() -> None:
        p = await make_pair(fabric, fence_timeout_s=SHORT_FENCE_S)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory = p.rrank.memory
        await asyncio.wait_for(p.reader.daemon.unregister_engine("eng-r", 0, until_let_go=True), 5.0)
        assert memory.retired and memory.state is MemoryState.QUARANTINED
        await ended(transfer)
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await p.reader.daemon.memories.sweep_quarantine()
        await p.reader.daemon.puller.sweep()
        await settle(p.holder)
        assert memory.state is MemoryState.RELEASED
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_the_holders_engine_waits_for_its_peers_admitted_read(fabric: Fabric) -> None:
    """The holder's engine unregisters while a peer's admitted read is reading its blocks: it
    returns once every part of the read arrived, and the read is DONE over unchanged memory."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory = p.hrank.memory
        unregistering = asyncio.create_task(p.holder.daemon.unregister_engine("eng-h", 0, until_let_go=True))
        await not_yet(unregistering)
        p.reader.dataplane.finish(xfers[0])
        await settle(p.holder)
        await not_yet(unregistering)  # one part of two proves nothing
        p.reader.dataplane.finish(xfers[1])
        await asyncio.wait_for(unregistering, 5.0)
        assert memory.state is MemoryState.RELEASED
        await ended(transfer)
        assert transfer.state is DONE
        await sweep_round(p.holder)
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)


def test_past_its_bound_it_returns_and_says_what_still_runs(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer's admitted read that never ends: it returns after fence_timeout_s and the margin,
    saying so, the memory still fenced (the holder's own rules end it later)."""
    monkeypatch.setattr(engines_module, "UNREGISTER_WAIT_MARGIN_S", 0.05)

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config={"fence_timeout_s": SHORT_FENCE_S})
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        memory = p.hrank.memory
        await asyncio.wait_for(p.holder.daemon.unregister_engine("eng-h", 0, until_let_go=True), 5.0)
        assert memory.state is MemoryState.FENCED and memory.holder_pins == 1
        assert "a late byte may still touch it" in caplog.text
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await settle(p.holder)
        await ended(transfer)
        assert transfer.state is DONE
        await sweep_round(p.holder)
        assert memory.state is MemoryState.RELEASED
        assert_settled(p.reader, p.holder, memories=(memory,))

    run(fabric, scenario)
