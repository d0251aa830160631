"""A data-plane worker lost under a daemon, every interleaving driven by hand (docs/lifetimes.md).

When a daemon's worker dies, its READs are final (its death is the fence), its mappings, agents,
lists and staging buffers are gone, and the daemon starts a new worker, maps every registered
engine again under a new registration id (the engines do nothing) and serves on. These scenarios
run two real :class:`kvd.core.daemon.Daemon` objects over the fakes of lifetime_fakes.py: a test
kills a worker with ``FakeDataPlane.lose`` at a chosen moment, and checks what each side's
engines, leases, peers and pins look like afterwards. The fakes carry no bytes: outcomes are
checked through states, events, pins and the fakes' records of NIXL calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvtest import small_spec
from lifetime_fakes import SAFETY_TIMEOUT_S, Fabric, FakeDataPlane, Gate, Node
from test_core_lifetimes import (
    DONE,
    FAILED,
    HOLD_BLOCKS,
    LOCAL_BLOCKS,
    NUM_TOKENS,
    READER,
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
from kvd.core.local_memory import LocalMemory, MemoryState
from kvd.core.peers import PrepareRequest
from kvd.core.transfers import Transfer
from kvd.core.workers import WorkerStartFailed
from kvd.layout.spec import KvLayout
from kvd_client.errors import ErrorCode, Unavailable

LOST, ACTIVE, RELEASED = MemoryState.LOST, MemoryState.ACTIVE, MemoryState.RELEASED


async def restarted(node: Node) -> None:
    """Wait for the node's data-plane restart under way, if any, to end (it must not raise)."""
    task = node.daemon.restarts.restarting
    if task is not None:
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await task
    assert node.daemon.restarts.restarting is None


def assert_mapped(memory: LocalMemory, dp: FakeDataPlane) -> None:
    """The mapping is the worker's: its regions open there, its registrations live there."""
    assert memory.plane is dp and memory.state is ACTIVE
    assert memory.nixl_registrations and all(r in dp.live_registrations() for r in memory.nixl_registrations)
    for region in memory.regions:
        dp.region_table.get(region.region_id)  # raises for a region the worker does not map


async def pull_done(p: Pair, request_id: str, transfer: Transfer | None = None) -> Transfer:
    """Pull (or finish ``transfer``) with every READ ending DONE; the pull must report DONE."""
    if transfer is None:
        transfer, _ = p.pull(request_id)
    dp = p.reader.dataplane
    posted = len(dp.posted)
    reading = asyncio.ensure_future(dp.posts.reach(posted + 2))
    assert transfer.task is not None
    async with asyncio.timeout(SAFETY_TIMEOUT_S):
        await asyncio.wait([reading, transfer.task], return_when=asyncio.FIRST_COMPLETED)
    reading.cancel()
    assert not transfer.state.final, f"the pull ended {transfer.state} before reading: {transfer.error}"
    for xfer in dp.posted[posted:]:
        dp.finish(xfer)
    await ended(transfer)
    assert transfer.state is DONE, transfer.error
    await settle(p.holder, p.reader)
    return transfer


def only_pool(node: Node) -> Any:
    pools = list(node.daemon.puller.reads._staging.values())
    assert len(pools) == 1, pools
    return pools[0]


# --- 1. the reader's worker dies while its pull reads ----------------------------------------------


def test_reader_worker_lost_mid_read_fails_the_pull_once_and_maps_the_engine_again(fabric: Fabric) -> None:
    """The lost worker's READs are final: the pull ends UNAVAILABLE at once (one LoadFailed), the
    holder hears AbandonPull (its admission ends clean), the engine stays registered under a new
    mapping in the new worker, and the next pull reads through it without a new registration."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        reader = p.reader.daemon
        old_dp, old_memory = p.reader.dataplane, p.rrank.memory
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)

        old_dp.lose("SIGKILL")
        assert all(x.final for x in xfers)
        with pytest.raises(Unavailable, match="restarting"):
            reader.require_dataplane()
        await restarted(p.reader)
        await ended(transfer)
        await p.reader.transport.abandoned.reach(1)
        await settle(p.holder, p.reader)

        assert transfer.state is FAILED and transfer.error is not None
        assert transfer.error.code is ErrorCode.UNAVAILABLE
        assert len(engine_events(p.rrank, LoadFailed)) == 1 and not engine_events(p.rrank, FinishedRecving)
        # The engine is still registered, under a new mapping in the new worker.
        new_dp = p.reader.dataplane
        assert new_dp is not old_dp and new_dp.alive and new_dp.name != old_dp.name
        assert reader.registry.get("eng-r", 0) is p.rrank
        new_memory = p.rrank.memory
        assert new_memory is not old_memory and new_memory.registration_id != old_memory.registration_id
        assert old_memory.state is LOST and not old_memory.nixl_registrations
        assert_mapped(new_memory, new_dp)
        # The holder was told: its admission ended as abandoned, its memory is clean.
        (abandon,) = p.reader.transport.abandons
        assert abandon["transfer_id"] == transfer.transfer_id and abandon["lease_id"] == lease_id
        assert p.holder.metric("kvd_admissions_ended_total", reason="abandoned") == 1
        assert p.holder.daemon.leases.open_admissions == 0 and p.hrank.memory.holder_pins == 0
        assert not p.hrank.memory.tainted and p.hrank.memory.state is ACTIVE
        # Counted and shown.
        assert p.reader.metric("kvd_dataplane_restarts_total", reason="SIGKILL") == 1
        status = reader.status()
        assert status.dataplane_restarts == 1 and status.dataplane_last_restart == "SIGKILL"
        assert status.agent_name == new_dp.name and status.serving and status.remote_agents == 0
        assert reader.restarts.fatal is not None and not reader.restarts.fatal.done()
        assert_settled(p.reader, p.holder, memories=(old_memory,))

        # The next pull handshakes again (its agents went with the worker) and reads through
        # the new mapping; the engine registered nothing.
        handshakes = len(p.reader.transport.handshakes)
        await pull_done(p, "req-2")
        assert len(engine_events(p.rrank, FinishedRecving)) == 1
        assert p.rrank.memory is new_memory and len(reader.registry) == 1
        assert len(p.reader.transport.handshakes) == handshakes + 1
        assert [x for x in new_dp.posted if new_dp.reads[x].local.agent != LOCAL] == []
        assert all(new_dp.reads[x].remote.agent == p.holder.dataplane.name for x in new_dp.posted)
        assert old_dp.log[-1] == ("lost", "SIGKILL") and len(old_dp.posted) == 2  # nothing touched it since
        assert_settled(p.reader, p.holder, memories=(old_memory,))

    run(fabric, scenario)


# --- 2. the holder's worker dies while a reader reads out of it ------------------------------------


def test_holder_worker_lost_mid_read_fails_the_read_and_the_retry_reads_the_new_worker(fabric: Fabric) -> None:
    """NIXL fails the reader's READs (the holder's endpoints are gone); the lease survives; the
    retry handshakes again (new agent, new registration ids) and succeeds; the reader's view of
    the holder's lost agent is removed."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder, reader = p.holder.daemon, p.reader.daemon
        transfer, lease_id = p.pull()
        xfers = await p.reading(transfer)
        old_agent, old_hmemory = p.holder.dataplane.name, p.hrank.memory
        old_registration = p.hrank.registration_id

        p.holder.dataplane.lose("SIGSEGV")
        await restarted(p.holder)
        for xfer in xfers:
            p.reader.dataplane.fail(xfer)  # the peer's endpoints went with its worker
        await ended(transfer)
        await settle(p.holder, p.reader)

        assert transfer.state is FAILED and len(engine_events(p.rrank, LoadFailed)) == 1
        lease = holder.leases.find(lease_id)
        assert lease is not None and not lease.draining  # the hold survives its worker
        assert old_hmemory.state is LOST and p.hrank.registration_id != old_registration
        assert_mapped(p.hrank.memory, p.holder.dataplane)
        assert [a.name for a in reader.peers.agents()] == []  # the failed read dropped the peer
        assert p.reader.dataplane.removals(old_agent) == 1

        retry = reader.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, holder.params_of(lease))
        await pull_done(p, "req-1", retry)

        session = reader.peers.cached(p.holder.address)
        assert session is not None and session.agent_name == p.holder.dataplane.name != old_agent
        assert session.engines[("eng-h", 0)].registration_id == p.hrank.registration_id
        assert [a.name for a in reader.peers.agents()] == [p.holder.dataplane.name]  # no leaked RemoteAgent
        assert old_agent not in p.reader.dataplane.remotes
        assert holder.leases.find(lease_id) is None  # read: the lease ended
        assert_settled(p.reader, p.holder, memories=(old_hmemory,))

    run(fabric, scenario)


def test_holder_worker_lost_while_idle_the_next_pull_handshakes_again_and_removes_the_old_agent(
    fabric: Fabric,
) -> None:
    """The reader's cached view names the holder's lost agent and registrations: the holder's
    answer (new registration ids) makes it handshake again; the old agent is removed."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        await pull_done(p, "req-1")
        old_agent = p.holder.dataplane.name
        p.holder.dataplane.lose("exit 3")
        await restarted(p.holder)

        handshakes = len(p.reader.transport.handshakes)
        await pull_done(p, "req-2")
        assert len(p.reader.transport.handshakes) == handshakes + 1
        assert [a.name for a in p.reader.daemon.peers.agents()] == [p.holder.dataplane.name]
        assert p.reader.dataplane.removals(old_agent) == 1 and old_agent not in p.reader.dataplane.remotes
        assert p.holder.metric("kvd_dataplane_restarts_total", reason="exit 3") == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- 3. staging buffers go with their worker -------------------------------------------------------


def test_worker_lost_while_idle_the_next_converting_pull_gets_a_staging_pool_in_the_new_worker(
    fabric: Fabric,
) -> None:
    """The staging pool was the lost worker's buffer: the next converting pull opens a new one in
    the new worker, registered there, and converts there."""

    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        await pull_done(p, "req-1")
        old_dp, old_pool = p.reader.dataplane, only_pool(p.reader)
        assert old_dp.converts == 1

        old_dp.lose("SIGKILL")
        await restarted(p.reader)
        assert old_pool.lost and p.reader.daemon.puller.reads._staging == {}
        await pull_done(p, "req-2")

        new_dp, new_pool = p.reader.dataplane, only_pool(p.reader)
        assert new_pool is not old_pool and not new_pool.lost and new_pool._dataplane is new_dp
        new_dp.region_table.get(new_pool.region_id)
        assert any(r.address == new_pool.address and r.size == new_pool.size for r in new_dp.live_registrations())
        assert new_dp.converts == 1 and old_dp.converts == 1
        assert p.reader.metric("kvd_staging_bytes_in_use") == 0 and new_pool.in_use == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_reader_worker_lost_mid_converting_read_releases_no_list_in_the_new_worker(fabric: Fabric) -> None:
    """A converting pull's one-off lists over the staging chunk are the lost worker's: handing
    them back must not reach the new worker (whose list ids are its own, counted from 1 again)."""

    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        transfer, _ = p.pull()
        await p.reading(transfer)
        p.reader.dataplane.lose("SIGKILL")
        await restarted(p.reader)
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert transfer.state is FAILED and len(engine_events(p.rrank, LoadFailed)) == 1
        assert fabric.violations == []
        await pull_done(p, "req-2")

    run(fabric, scenario)


def test_a_converting_pull_whose_lists_are_released_while_the_worker_hangs_hands_its_staging_back(
    fabric: Fabric,
) -> None:
    """The reads are final, and handing the pull's one-off lists back waits on a worker that hangs
    and is then declared lost: that call fails, and the staging chunk must still go back to its
    pool (it stayed counted in kvd_staging_bytes_in_use for good: a fleet's quiescence check)."""

    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        dp = p.reader.dataplane
        transfer, _ = p.pull()
        xfers = await p.reading(transfer)
        dp.release_gate = Gate()
        for xfer in xfers:
            dp.finish(xfer)
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await dp.release_gate.arrived.reach(1)
        dp.lose("hung")  # the heartbeat gave up on it
        dp.release_gate.open()
        await restarted(p.reader)
        await ended(transfer)
        await settle(p.reader, p.holder)
        assert p.reader.metric("kvd_staging_bytes_in_use") == 0
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- 4. registrations, handshakes and PreparePull while the worker is replaced ----------------------


def test_a_registration_in_flight_when_the_worker_dies_fails_and_leaves_no_rank_on_the_dead_worker(
    fabric: Fabric,
) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric)
        reader, dp = p.reader.daemon, p.reader.dataplane
        gate = dp.register_gate = Gate()
        registering = asyncio.get_running_loop().create_task(fabric.register(p.reader, "eng-x", small_spec(8)))
        await gate.arrived.reach(1)

        dp.lose("SIGKILL")
        gate.open()
        with pytest.raises(Unavailable):
            await registering
        await restarted(p.reader)

        assert reader.registry.ranks_of("eng-x") == {}
        assert [rank.engine_id for rank in reader.registry] == ["eng-r"]
        for rank in reader.registry:
            assert_mapped(rank.memory, p.reader.dataplane)
        # Registering again now works, in the new worker.
        rank = await fabric.register(p.reader, "eng-x", small_spec(8))
        assert_mapped(rank.memory, p.reader.dataplane)
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_while_the_holder_restarts_registrations_handshakes_and_prepare_pull_are_unavailable(
    fabric: Fabric,
) -> None:
    """The replacement worker is still starting: everything that needs it is refused as
    retryable; a pull meeting that fails UNAVAILABLE once; all of it works once it serves."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        holder = p.holder.daemon
        lease, params = holder.hold("eng-h", "req-1", HOLD_BLOCKS, NUM_TOKENS)
        start = fabric.start_gate = Gate()
        p.holder.dataplane.lose("SIGKILL")
        await start.arrived.reach(1)

        with pytest.raises(Unavailable):
            await fabric.register(p.holder, "eng-x", small_spec(8))
        with pytest.raises(Unavailable):
            holder.handshake_info()
        with pytest.raises(Unavailable):
            await holder.prepare_pull(
                PrepareRequest(
                    lease_id=lease.lease_id,
                    engine_id="eng-h",
                    block_ids=tuple(HOLD_BLOCKS),
                    num_tokens=NUM_TOKENS,
                    reader_tp_rank=0,
                    reader_tp_size=1,
                    remote_tp_ranks=(0,),
                )
            )
        transfer = p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params)
        await ended(transfer)
        assert transfer.state is FAILED and transfer.error is not None
        assert transfer.error.code is ErrorCode.UNAVAILABLE
        assert len(engine_events(p.rrank, LoadFailed)) == 1
        assert holder.registry.ranks_of("eng-x") == {} and holder.leases.open_admissions == 0

        start.open()
        await restarted(p.holder)
        assert holder.handshake_info().agent_name == p.holder.dataplane.name
        rank = await fabric.register(p.holder, "eng-x", small_spec(8))
        assert_mapped(rank.memory, p.holder.dataplane)
        retry = p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params)
        await pull_done(p, "req-1", retry)
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_handshakes_a_restarting_holder_refuses_keep_the_channel_and_an_unreachable_one_drops_it(
    fabric: Fabric,
) -> None:
    """A holder that answers "my data plane is restarting" was reached: the reader keeps its
    channel. Dropping it made every pull of that window handshake on a new channel, and gRPC kept
    each one's TCP connection open (the loaded fleet counted 50-120 to one peer). A holder that
    cannot be reached at all is dropped, so that the next try does not wait out a back-off."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        _, params = p.holder.daemon.hold("eng-h", "req-1", HOLD_BLOCKS, NUM_TOKENS)
        start = fabric.start_gate = Gate()
        p.holder.dataplane.lose("SIGKILL")
        await start.arrived.reach(1)
        transport = p.reader.transport
        for attempt in range(5):
            transfer = p.reader.daemon.start_pull("eng-r", 0, f"req-{attempt}", LOCAL_BLOCKS, params)
            await ended(transfer)
            assert transfer.state is FAILED and transfer.error is not None
            assert transfer.error.code is ErrorCode.UNAVAILABLE
        assert transport.handshakes.count(p.holder.address) == 5
        assert transport.forgets == [], "a peer that answered was dropped"

        transport.unreachable.add(p.holder.address)
        transfer = p.reader.daemon.start_pull("eng-r", 0, "req-cut", LOCAL_BLOCKS, params)
        await ended(transfer)
        assert transfer.state is FAILED and transport.forgets == [p.holder.address]

        transport.unreachable.discard(p.holder.address)
        start.open()
        await restarted(p.holder)
        await pull_done(p, "req-1", p.reader.daemon.start_pull("eng-r", 0, "req-1", LOCAL_BLOCKS, params))
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


# --- 5. a crash loop backs off; only a worker that cannot start ends the daemon ----------------------

QUICK_BACKOFF = {"dataplane_restart_backoff_s": 0.01, "dataplane_restart_backoff_max_s": 0.04}


def watch_serving(node: Node) -> list[bool]:
    """Every change of whether a worker serves, as health sees it (kvd.server.app follows it)."""
    seen: list[bool] = []
    node.daemon.restarts.on_serving = lambda: seen.append(node.daemon.restarts.serving)
    return seen


def test_a_crash_loop_backs_off_and_the_engines_keep_their_registrations(fabric: Fabric) -> None:
    """Ten losses in a row: the first is replaced at once, the next wait 10, 20, 40 ms (the cap)
    and so on; while no worker serves the daemon says so (health, gauge) and refuses work that
    needs one; the daemon never gives up; the engine stays registered, mapped into each new
    worker, and the next pull is DONE without the engine registering again."""

    async def scenario() -> None:
        p = await make_pair(fabric, **QUICK_BACKOFF, dataplane_restart_stable_s=3600.0)
        reader, rank = p.reader.daemon, p.rrank
        seen = watch_serving(p.reader)
        assert reader.restarts.serving and p.reader.metric("kvd_dataplane_serving") == 1
        delays = []
        for loss in range(1, 11):
            start = fabric.start_gate = Gate()
            p.reader.dataplane.lose("SIGSEGV" if loss % 2 else "SIGKILL")
            assert not reader.restarts.serving and p.reader.metric("kvd_dataplane_serving") == 0
            with pytest.raises(Unavailable, match="restarting"):
                reader.require_dataplane()
            with pytest.raises(Unavailable):
                await fabric.register(p.reader, "eng-x", small_spec(8))
            delays.append(reader.restarts.backoff.delay_s)
            await start.arrived.reach(1)  # after its back-off, the replacement starts
            assert not reader.restarts.serving
            start.open()
            fabric.start_gate = None
            await restarted(p.reader)
            assert reader.restarts.serving and p.reader.metric("kvd_dataplane_serving") == 1
            assert reader.serving and reader.restarts.fatal is not None and not reader.restarts.fatal.done()
            assert [r.engine_id for r in reader.registry] == ["eng-r"] and reader.registry.get("eng-r", 0) is rank
            assert_mapped(rank.memory, p.reader.dataplane)
        assert delays == [0.0, 0.01, 0.02, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04]
        assert seen == [False, True] * 10
        assert reader.restarts.restarts == 10 and reader.status().dataplane_restarts == 10
        assert p.reader.metric("kvd_dataplane_restarts_total", reason="SIGSEGV") == 5
        assert p.reader.metric("kvd_dataplane_restarts_total", reason="SIGKILL") == 5
        await pull_done(p, "after-ten-losses")
        assert len(engine_events(rank, FinishedRecving)) == 1
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_pulls_in_flight_at_each_loss_end_failed_and_the_next_one_reads(fabric: Fabric) -> None:
    """A pull reading when the worker dies ends FAILED (UNAVAILABLE) and its engine hears it
    once, at every loss of a crash loop; one started while the daemon backs off fails too."""

    async def scenario() -> None:
        p = await make_pair(fabric, **QUICK_BACKOFF, dataplane_restart_stable_s=3600.0)
        for loss in range(3):
            transfer, _ = p.pull(f"mid-{loss}")
            await p.reading(transfer)
            start = fabric.start_gate = Gate()
            p.reader.dataplane.lose("SIGKILL")
            await ended(transfer)
            assert transfer.state is FAILED and transfer.error is not None
            assert transfer.error.code is ErrorCode.UNAVAILABLE
            if loss:  # backing off: a pull asked for now fails the same way, and at once
                during, _ = p.pull(f"during-{loss}")
                await ended(during)
                assert during.state is FAILED and during.error is not None
                assert during.error.code is ErrorCode.UNAVAILABLE
            start.open()
            fabric.start_gate = None
            await restarted(p.reader)
            await settle(p.holder, p.reader)
        assert len(engine_events(p.rrank, LoadFailed)) == 5 and not engine_events(p.rrank, FinishedRecving)
        await pull_done(p, "after")
        assert_settled(p.reader, p.holder)

    run(fabric, scenario)


def test_a_worker_that_served_its_stable_period_ends_the_back_off(fabric: Fabric) -> None:
    async def scenario() -> None:
        node = await fabric.start_node(READER, **QUICK_BACKOFF, dataplane_restart_stable_s=0.05)
        daemon = node.daemon
        rank = await fabric.register(node, "eng-r", small_spec(8))
        delays = []
        for pause in (0.0, 0.0, 0.1, 0.0):  # the third loss comes after 100 ms of serving
            await asyncio.sleep(pause)
            node.dataplane.lose("SIGKILL")
            delays.append(daemon.restarts.backoff.delay_s)
            await restarted(node)
        assert delays == [0.0, 0.01, 0.0, 0.01]
        assert daemon.restarts.restarts == 4 and daemon.restarts.serving
        assert_mapped(rank.memory, node.dataplane)

    run(fabric, scenario)


def test_a_shutdown_while_backing_off_starts_no_worker_and_releases_everything(fabric: Fabric) -> None:
    """The daemon waits (a long back-off) with no worker: nothing starts meanwhile, and a
    shutdown ends the wait, releases the engine and leaves nothing pinned."""

    async def scenario() -> None:
        p = await make_pair(fabric, dataplane_restart_backoff_s=3600.0, dataplane_restart_backoff_max_s=3600.0)
        reader = p.reader.daemon
        p.reader.dataplane.lose("SIGKILL")
        await restarted(p.reader)  # the first loss: replaced at once
        old_memory = p.rrank.memory
        planes = len(fabric.dataplanes)
        p.reader.dataplane.lose("SIGKILL")  # the second in a row: an hour's back-off
        for _ in range(10):
            await asyncio.sleep(0)
        assert reader.restarts.restarting is not None and len(fabric.dataplanes) == planes
        assert not reader.restarts.serving and old_memory.state is LOST
        with pytest.raises(Unavailable, match="restarting"):
            reader.handshake_info()

        await shut_down(fabric, p.reader)
        assert reader.restarts.restarting is None and len(fabric.dataplanes) == planes
        assert len(reader.registry) == 0 and old_memory.pins == 0
        assert reader.restarts.fatal is not None and not reader.restarts.fatal.done()
        assert_settled(p.holder)

    run(fabric, scenario)


def test_a_replacement_that_cannot_start_ends_the_daemon(fabric: Fabric) -> None:
    """A new worker that cannot start (it exited or crashed before it was ready, NIXL refused
    its agent) ends the daemon at once: ``fatal`` says why, in one line; nothing else starts."""

    async def scenario() -> None:
        node = await fabric.start_node(READER)
        await fabric.register(node, "eng-r", small_spec(8))
        seen = watch_serving(node)
        fabric.start_errors = [WorkerStartFailed("the data-plane worker (pid 7) did not start: exit 1; see its log")]
        planes = len(fabric.dataplanes)
        node.dataplane.lose("SIGSEGV")
        await restarted(node)
        assert node.daemon.restarts.fatal is not None and node.daemon.restarts.fatal.done()
        why = node.daemon.restarts.fatal.result()
        assert "cannot start" in why and "exit 1" in why and "SIGSEGV" in why and "\n" not in why
        assert not node.daemon.serving and not node.daemon.restarts.serving and seen == [False]
        assert len(fabric.dataplanes) == planes + 1  # the one that failed, and no other
        assert not any(dp.started for dp in fabric.dataplanes.values() if dp is not node.dataplane)

    run(fabric, scenario)


def test_a_replacement_killed_while_it_starts_is_one_more_loss(fabric: Fabric) -> None:
    """New workers killed from outside while they start (SIGKILL) say nothing about the next:
    the daemon backs off and starts another, counting no serving loss for them."""

    async def scenario() -> None:
        node = await fabric.start_node(READER, **QUICK_BACKOFF)
        rank = await fabric.register(node, "eng-r", small_spec(8))
        killed = "the data-plane worker (pid 7) did not start: SIGKILL; see its log"
        fabric.start_errors = [WorkerStartFailed(killed, killed=True), WorkerStartFailed(killed, killed=True)]
        node.dataplane.lose("SIGKILL")
        await restarted(node)
        daemon = node.daemon
        assert daemon.restarts.fatal is not None and not daemon.restarts.fatal.done()
        assert daemon.restarts.serving and daemon.dataplane.alive
        assert daemon.restarts.backoff.losses_in_a_row == 3 and daemon.restarts.backoff.delay_s == 0.02
        assert daemon.restarts.restarts == 1  # the serving worker's loss only
        assert_mapped(rank.memory, node.dataplane)

    run(fabric, scenario)


# --- 6. shutdown during and after a restart -------------------------------------------------------------


async def shut_down(fabric: Fabric, node: Node) -> None:
    await node.daemon.shutdown(0.0)
    fabric.nodes.pop(node.address)  # Fabric.close shuts the others down


def assert_emptied(dp: FakeDataPlane) -> None:
    """Stopped, nothing registered, nothing mapped."""
    assert dp.stopped and dp.live_registrations() == [] and dp.region_table._regions == {}


def test_shutdown_after_a_restart_releases_everything_in_the_new_worker_and_stops_it(fabric: Fabric) -> None:
    async def scenario() -> None:
        p = await make_pair(fabric, small_spec(8, layout=KvLayout.HND), staging_pool_bytes=1 << 20)
        old_dp, old_memory = p.reader.dataplane, p.rrank.memory
        old_dp.lose("SIGKILL")
        await restarted(p.reader)
        await pull_done(p, "req-1")  # a staging pool in the new worker too
        new_memory, new_dp = p.rrank.memory, p.reader.dataplane
        assert_settled(p.reader, p.holder, memories=(old_memory,))

        await shut_down(fabric, p.reader)
        assert new_memory.state is RELEASED and old_memory.state is LOST
        assert_emptied(new_dp)
        assert not old_dp.stopped or old_dp.log[-1] == ("lost", "SIGKILL")

    run(fabric, scenario)


@pytest.mark.parametrize("held_at", ["start", "remap"])
def test_shutdown_during_a_restart_leaves_nothing_pinned_or_mapped(fabric: Fabric, held_at: str) -> None:
    """The replacement is still starting ("start"), or already serves and maps the engines
    again ("remap"): shutdown ends the restart, and no worker keeps anything."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        old_dp, old_memory = p.reader.dataplane, p.rrank.memory
        start = fabric.start_gate = Gate()
        old_dp.lose("SIGKILL")
        await start.arrived.reach(1)
        replacement = list(fabric.dataplanes.values())[-1]
        assert replacement is not old_dp and not replacement.started
        if held_at == "remap":
            remap = replacement.register_gate = Gate()
            start.open()
            await remap.arrived.reach(1)
            assert p.reader.daemon.dataplane is replacement and p.rrank.memory is old_memory

        await shut_down(fabric, p.reader)
        assert p.reader.daemon.restarts.restarting is None and len(p.reader.daemon.registry) == 0
        assert old_memory.state is LOST and old_memory.pins == 0
        if held_at == "remap":
            assert_emptied(replacement)
        else:
            assert not replacement.started and replacement.region_table._regions == {}
        assert p.reader.daemon.restarts.fatal is not None and not p.reader.daemon.restarts.fatal.done()
        assert_settled(p.holder)

    run(fabric, scenario)


def test_a_replacement_lost_while_it_maps_the_engines_is_replaced_too(fabric: Fabric) -> None:
    """The new worker dies while the engines are mapped into it again (its loss comes while the
    restart is under way): the daemon replaces it as well, counts both losses, and the engine
    stays registered and is mapped into the third worker; nothing serves through a dead one."""

    async def scenario() -> None:
        p = await make_pair(fabric)
        daemon, rank = p.reader.daemon, p.rrank
        first = p.reader.dataplane
        planes = len(fabric.dataplanes)
        start = fabric.start_gate = Gate()
        first.lose("SIGKILL")
        await start.arrived.reach(1)
        replacement = list(fabric.dataplanes.values())[-1]
        remap = replacement.register_gate = Gate()
        start.open()
        await remap.arrived.reach(1)
        assert daemon.dataplane is replacement and daemon.restarts.restarting is not None
        replacement.lose("SIGSEGV")
        remap.open()
        task = daemon.restarts.restarting
        assert task is not None
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await task  # the first restart ends, and starts the next
        await restarted(p.reader)
        third = daemon.dataplane
        assert third is not replacement and third.alive and len(fabric.dataplanes) == planes + 2
        assert daemon.restarts.restarts == 2 and daemon.restarts.last_restart == "SIGSEGV"
        assert [r.engine_id for r in daemon.registry] == [rank.engine_id], "the engine lost its registration"
        assert_mapped(rank.memory, third)
        await pull_done(p, "after-two-losses")

    run(fabric, scenario)
