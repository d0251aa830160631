"""A holder daemon stopped (SIGTERM) while a peer's read of one of its leases is admitted.

The fleet's clean restart found it: the daemon ended the read's admission at once as "not proven
over" and told the engine ``finished_sending`` while the peer's READ still copied the blocks; the
engine reused them and the peer's pull reported DONE with another request's bytes. The rule
(docs/lifetimes.md: leases end only when no reader can still read) holds at shutdown too: the
lease drains, the admitted read gets the shutdown grace to be proven over, and only a read still
running when the grace is over is ended unproven.
"""

from __future__ import annotations

import asyncio

from lifetime_fakes import SAFETY_TIMEOUT_S, Fabric
from test_core_lifetimes import DONE, ended, engine_events, make_pair, run

from kvd.core.events import FinishedSending


async def turns(n: int = 50) -> None:
    """Let the event loop run the shutdown as far as it goes without a READ ending."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_shutdown_lets_an_admitted_read_end_before_the_engine_gets_its_blocks_back(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        stopping = asyncio.create_task(p.holder.daemon.shutdown(SAFETY_TIMEOUT_S))
        await turns()

        assert not stopping.done()
        assert not engine_events(p.hrank, FinishedSending), "the engine was told while a peer still reads"
        assert p.hrank.memory.holder_pins == 1
        for xfer in xfers:
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await stopping

        assert transfer.state is DONE
        (sent,) = engine_events(p.hrank, FinishedSending)
        assert sent.lease_id == lease_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="read") == 1
        assert p.holder.metric("kvd_admissions_ended_total", reason="timed_out") == 0

    run(fabric, scenario)


def test_shutdown_ends_a_read_still_running_when_its_grace_is_over(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric)
        transfer, _ = p.pull()
        await p.reading(transfer)
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await p.holder.daemon.shutdown(0.05)

        assert len(engine_events(p.hrank, FinishedSending)) == 1
        assert p.holder.metric("kvd_admissions_ended_total", reason="timed_out") == 1

    run(fabric, scenario)


def test_shutdown_waits_for_a_holders_unpin_at_most_fence_timeout(fabric: Fabric) -> None:
    """The unpin that an admission's end schedules runs in the holder's background work; one that
    never ends (a hung worker's call) is waited for at most ``fence_timeout_s`` at shutdown, as
    every owner's background work is, and the shutdown goes on past it."""

    async def scenario() -> None:
        p = await make_pair(fabric, holder_config={"fence_timeout_s": 0.2})
        memories = p.holder.daemon.memories
        assert memories is not None
        real_unpin = memories.unpin
        never = asyncio.Event()
        hung: list[bool] = []

        async def unpin(memory, *, holder: bool = False, stale=()) -> None:  # type: ignore[no-untyped-def]
            if holder:
                hung.append(True)
                await never.wait()  # never set: this unpin does not end
            await real_unpin(memory, holder=holder, stale=stale)

        memories.unpin = unpin  # type: ignore[method-assign]
        transfer, _ = p.pull()
        for xfer in await p.reading(transfer):
            p.reader.dataplane.finish(xfer)
        await ended(transfer)
        assert transfer.state is DONE
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            while not hung:  # the admission's end scheduled its unpin
                await asyncio.sleep(0.01)
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await p.holder.daemon.shutdown(0.05)
        assert len(p.holder.daemon.holder.followups) == 1, "the hung unpin is left running, not awaited"
        assert asyncio.get_running_loop().time() - started < SAFETY_TIMEOUT_S

    run(fabric, scenario)
