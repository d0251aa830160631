"""First contact with a holder: its NIXL metadata loads while the first pull is admitted.

The first pull to a peer never seen handshakes, then loads the peer's agent metadata into the
data-plane worker (``add_remote``: a hop to the worker, the load, the connect) and asks the holder
to admit the read. The two are independent, so the load runs in the background
(``Peers._first_contact``) and only a descriptor list over the agent, so every READ, waits for
it. These scenarios hold the load with a gate (lifetime_fakes.py) and check what may and may not
happen meanwhile, and what a failed or interrupted load leaves behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lifetime_fakes import Fabric, Gate
from test_core_dataplane_restart import restarted
from test_core_lifetimes import (
    DONE,
    FAILED,
    HOLDER,
    Pair,
    assert_settled,
    ended,
    engine_events,
    make_pair,
    run,
    settle,
)

from kvd.core.dataplane import LOCAL
from kvd.core.events import FinishedRecving, LoadFailed
from kvd.core.transfers import Transfer
from kvd_client.errors import ErrorCode, InvalidArgument, PeerUnavailable


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition()`` holds (the fakes never block on real time)."""
    async with asyncio.timeout(5.0):
        while not condition():
            await asyncio.sleep(0)
    assert condition(), what


async def _pulling_while_the_load_is_held(fabric: Fabric) -> tuple[Pair, Gate, Transfer, str]:
    """A pair, the reader's add_remote held by a gate, and one pull the holder has admitted
    while the first contact's metadata load waits at that gate."""
    p = await make_pair(fabric)
    p.reader.dataplane.add_remote_gate = gate = Gate()
    transfer, lease_id = p.pull()
    await _until(
        lambda: p.holder.daemon.leases.open_admissions == 1 and gate.arrived.count == 1,
        "the holder admitted the read while the metadata loads",
    )
    return p, gate, transfer, lease_id


async def _finish(p: Pair, transfer: Transfer, reads: int = 2) -> None:
    xfers = await p.reading(transfer, reads)
    for xfer in xfers:
        p.reader.dataplane.finish(xfer)
    await ended(transfer)


async def _the_next_pull_reads_through_one_agent(p: Pair) -> None:
    """A new pull is DONE, read through the one agent the reader's data plane holds; all settled."""
    retry, _ = p.pull("req-2", local_blocks=[6, 7, 0])
    await _finish(p, retry)
    await settle(p.reader, p.holder)
    assert retry.state is DONE
    (agent,) = p.reader.daemon.peers.agents()
    assert p.reader.dataplane.remotes == {agent.name: 1}
    assert_settled(p.reader, p.holder)


def test_the_holder_admits_the_first_pull_while_the_metadata_loads_and_no_read_starts_before_it(
    fabric: Fabric,
) -> None:
    """The PreparePull reaches the holder while add_remote is held; nothing is prepared over the
    peer's agent and no READ is posted until the load is over; then the pull reads and ends DONE."""

    async def scenario() -> None:
        p, gate, transfer, _ = await _pulling_while_the_load_is_held(fabric)
        dp = p.reader.dataplane
        for _ in range(10):  # whatever else could run meanwhile has run
            await asyncio.sleep(0)
        assert dp.remotes == {}  # the load is still in flight
        assert not dp.posted and not [t for t in dp.tables if t.agent != LOCAL]
        (agent,) = p.reader.daemon.peers.agents()
        assert agent.pins == 1  # the pull pinned the agent it waits for

        gate.open()
        await _finish(p, transfer)
        await settle(p.reader, p.holder)

        assert transfer.state is DONE and len(engine_events(p.rrank, FinishedRecving)) == 1
        assert dp.log.index(("add_remote", agent.name)) < min(
            i for i, entry in enumerate(dp.log) if entry[0] == "read"
        ), "a READ was posted before the agent's metadata was loaded"
        assert dp.remotes == {agent.name: 1}
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_pulls_that_arrive_while_the_first_load_runs_share_it(fabric: Fabric) -> None:
    """Two pulls to a new holder at once: one handshake, one load, each waits for it, all DONE."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        dp = p.reader.dataplane
        dp.add_remote_gate = gate = Gate()
        transfers = [p.pull(f"req-{i}", local_blocks=[3 * i, 3 * i + 1, 3 * i + 2])[0] for i in range(2)]
        await _until(
            lambda: p.holder.daemon.leases.open_admissions == 2 and gate.arrived.count == 1,
            "the holder admitted every read while the metadata loads",
        )
        for _ in range(10):
            await asyncio.sleep(0)
        assert gate.arrived.count == 1 and not dp.posted
        assert p.reader.transport.handshakes == [HOLDER]

        gate.open()
        await p.reader.dataplane.posts.reach(4)
        for xfer in list(dp.posted):
            dp.finish(xfer)
        for transfer in transfers:
            await ended(transfer)
        await settle(p.reader, p.holder)

        assert [t.state for t in transfers] == [DONE] * 2
        (agent,) = p.reader.daemon.peers.agents()
        assert dp.remotes == {agent.name: 1} and p.reader.transport.handshakes == [HOLDER]
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_first_load_that_fails_fails_the_pulls_waiting_for_it_and_the_next_pull_loads_again(
    fabric: Fabric,
) -> None:
    """NIXL refuses the metadata: the admitted pull ends FAILED with that error (one LoadFailed),
    the holder is told its read is over (AbandonPull), and the next pull handshakes again, loads
    the agent afresh and reads."""

    async def scenario() -> None:
        p, gate, transfer, lease_id = await _pulling_while_the_load_is_held(fabric)
        dp = p.reader.dataplane
        dp.add_remote_errors.append(InvalidArgument("peer agent metadata rejected by NIXL: NIXL_ERR_MISMATCH (test)"))
        gate.open()
        await ended(transfer)
        await settle(p.reader, p.holder)

        assert transfer.state is FAILED and isinstance(transfer.error, InvalidArgument)
        assert "NIXL_ERR_MISMATCH" in transfer.error.message
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not dp.posted
        assert [a["lease_id"] for a in p.reader.transport.abandons] == [lease_id]
        assert p.holder.daemon.leases.open_admissions == 0

        await _the_next_pull_reads_through_one_agent(p)
        assert p.reader.transport.handshakes == [HOLDER, HOLDER]

    run(fabric, scenario)


def test_a_peer_dropped_while_its_first_load_runs_is_removed_only_after_the_load(fabric: Fabric) -> None:
    """The holder's PreparePull fails as unreachable while the metadata loads: the session is
    dropped at once, but the agent is removed only once its load is over (a removal first would
    leave NIXL holding an agent nobody removes), and the pull fails PEER_UNAVAILABLE."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        dp = p.reader.dataplane
        dp.add_remote_gate = gate = Gate()
        p.reader.transport.prepare_gate = prepare_gate = Gate()
        transfer, _ = p.pull()
        await _until(lambda: prepare_gate.arrived.count == 1 and gate.arrived.count == 1, "both under way")
        (agent,) = p.reader.daemon.peers.agents()
        del fabric.daemons[HOLDER]  # the holder stops answering
        prepare_gate.open()
        await _until(lambda: p.reader.daemon.peers.sessions() == [], "the session was dropped")
        await asyncio.sleep(0)
        assert dp.removals(agent.name) == 0, "the agent was removed while its metadata loaded"

        gate.open()
        await ended(transfer)
        await _until(lambda: dp.removals(agent.name) == 1, "the agent was removed after its load")
        assert transfer.state is FAILED and isinstance(transfer.error, PeerUnavailable)
        assert dp.log.index(("add_remote", agent.name)) < dp.log.index(("remove_remote", agent.name))
        assert dp.remotes == {} and p.reader.daemon.peers.agents() == []
        fabric.daemons[HOLDER] = p.holder.daemon
        await settle(p.reader)
        assert_settled(p.reader)

    run(fabric, scenario)


def test_a_worker_lost_while_the_first_load_runs_fails_the_pull_and_the_new_worker_loads_the_agent(
    fabric: Fabric,
) -> None:
    """The reader's data-plane worker dies with the metadata load in flight: the pull ends
    UNAVAILABLE (one LoadFailed), the holder is told, and the next pull loads the peer's agent into
    the new worker and reads."""

    async def scenario() -> None:
        p, gate, transfer, lease_id = await _pulling_while_the_load_is_held(fabric)
        old_dp = p.reader.dataplane
        old_dp.lose("SIGKILL")
        gate.open()
        await ended(transfer)
        await restarted(p.reader)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.reader, p.holder)

        assert transfer.state is FAILED and transfer.error is not None
        assert transfer.error.code is ErrorCode.UNAVAILABLE
        assert len(engine_events(p.rrank, LoadFailed)) == 1
        assert [a["lease_id"] for a in p.reader.transport.abandons] == [lease_id]
        assert p.holder.daemon.leases.open_admissions == 0

        new_dp = p.reader.dataplane
        assert new_dp is not old_dp
        await _the_next_pull_reads_through_one_agent(p)

    run(fabric, scenario)


def test_a_known_agent_whose_connection_broke_is_loaded_again_within_the_same_handshake(fabric: Fabric) -> None:
    """A re-handshake's metadata merge finds the connection to a known agent broken (NIXL:
    REMOTE_DISCONNECT): the peer is dropped and the agent loaded afresh at once, so the caller
    gets a session (not PEER_UNAVAILABLE), and the next pull reads through the new agent."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        first, _ = p.pull()
        await _finish(p, first)
        await settle(p.reader, p.holder)
        assert first.state is DONE
        dp = p.reader.dataplane
        dp.add_remote_errors.append(
            PeerUnavailable("peer agent gone while its metadata was loaded: NIXL_ERR_REMOTE_DISCONNECT (test)")
        )
        session = await p.reader.daemon.peers.refresh(HOLDER, "test: a lease names a new registration")
        assert session.agent.live and not session.agent.reloading
        assert p.reader.transport.handshakes == [HOLDER, HOLDER, HOLDER]  # first, the failed merge, the reload
        assert not dp.add_remote_errors

        await _the_next_pull_reads_through_one_agent(p)

    run(fabric, scenario)
