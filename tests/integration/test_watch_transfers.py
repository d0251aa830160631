"""RouterService.WatchTransfers with real `kvd serve` daemons and real NIXL pulls.

A router starts pulls on the reader daemon's TCP port and waits on all of them on one stream
(the client's ``wait_transfer`` / ``wait_transfers`` ride it). Checked here: 32 concurrent pulls
waited on one stream move exact bytes; a pull that ended before it was watched is answered with
how it ended; unknown, empty and hostile input is refused per id or ends only that stream; a
cancelled pull's waiter gets its exact class; a daemon stopped mid-watch sends the outcomes of the
pulls it aborted and ends the stream UNAVAILABLE (a stream opened in its grace period included),
and one killed leaves its waiters Unavailable.

Pulls that stay in flight as long as the test needs: the holder requires commits
(``require_commits``) and waits long for them (``--commit-wait-s``), so a pull of tokens not
committed yet waits in the holder's admission until the test commits them, or ends it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
from watch_kit import FILL, PULLS, TOKENS, RawWatch, engines, hold, start_pulls

from kvd_client import AsyncKvdClient, KvdClient, errors
from kvd_client.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.integration


def test_32_router_pulls_waited_on_one_stream_move_exact_bytes(spawn_daemon) -> None:
    """A router starts 32 pulls at once over TCP and waits on them together: every wait rides the
    client's one stream, each pull is DONE and its bytes are the holder's, byte for byte."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=40)
    try:
        params = [hold(holder, f"r{i}", 2 * i) for i in range(PULLS)]

        async def route() -> list[common_pb2.TransferStatus]:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                started = await asyncio.gather(
                    *(
                        router.start_pull(
                            engine_id="reader",
                            request_id=f"r{i}",
                            local_block_ids=[2 * i + 1, 2 * i + 2],
                            remote=params[i],
                        )
                        for i in range(PULLS)
                    )
                )
                statuses = await asyncio.gather(*(router.wait_transfer(s.transfer_id) for s in started))
                assert router._watch._book.generation == 1, "the waits did not share one stream"
                # The same ids again, all at once: answered at once (they ended), on the same stream.
                again = await router.wait_transfers([s.transfer_id for s in started])
                assert [s.transfer_id for s in again] == [s.transfer_id for s in started]  # type: ignore[union-attr]
                assert router._watch._book.generation == 1
                return list(statuses)

        statuses = asyncio.run(route())
        assert [s.state for s in statuses] == [common_pb2.TRANSFER_STATE_DONE] * PULLS
        for i, status in enumerate(statuses):
            assert status.request_id == f"r{i}" and status.bytes > 0
            got = reader.token_bytes([2 * i + 1, 2 * i + 2], TOKENS)
            assert got.equal(holder.token_bytes([2 * i, 2 * i + 1], TOKENS)), f"pull r{i} delivered other bytes"
        assert reader.buffer[: reader.spec.block_stride].eq(FILL).all()  # block 0 was never written
    finally:
        holder.close()
        reader.close()


def test_a_pull_that_ended_before_it_was_watched_is_answered_with_its_outcome(spawn_daemon) -> None:
    """Asked after the pull ended, the daemon answers at once with how it ended: DONE with its
    status, or the exact class it failed with; an unknown id is refused alone, on the same stream."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=40)
    try:
        good = reader.client.start_pull(
            engine_id="reader", request_id="good", local_block_ids=[1, 2], remote=hold(holder, "good", 0)
        ).transfer_id
        bogus = hold(holder, "bad", 2)
        bogus.lease_id = "no-such-lease"
        bad = reader.client.start_pull(
            engine_id="reader", request_id="bad", local_block_ids=[3, 4], remote=bogus
        ).transfer_id
        deadline = time.monotonic() + 30
        while not all(
            reader.client.get_transfer(t).state
            in (common_pb2.TRANSFER_STATE_DONE, common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_ABORTED)
            for t in (good, bad)
        ):
            assert time.monotonic() < deadline, "the pulls did not end"
            time.sleep(0.01)

        with KvdClient(b.tcp, timeout_s=30) as router:  # a router that never saw these pulls start
            done = router.wait_transfer(good)
            assert done.state == common_pb2.TRANSFER_STATE_DONE and done.request_id == "good"
            with pytest.raises(errors.UnknownLease):
                router.wait_transfer(bad)
            with pytest.raises(errors.UnknownTransfer, match="not-a-transfer"):
                router.wait_transfer("not-a-transfer")
            results = router.wait_transfers([good, "not-a-transfer", bad])
            assert isinstance(results[0], common_pb2.TransferStatus)
            assert type(results[1]) is errors.UnknownTransfer and type(results[2]) is errors.UnknownLease
            assert router._watch._book.generation == 1
        assert reader.token_bytes([1, 2], TOKENS).equal(holder.token_bytes([0, 1], TOKENS))
    finally:
        holder.close()
        reader.close()


def test_bad_and_hostile_input_is_refused_precisely(spawn_daemon) -> None:
    """Unknown and empty ids are refused per id, the stream going on; a message of more ids than
    the bound, or an oversized id, ends that stream INVALID_ARGUMENT; a flood of unknown ids
    from a caller that does not read is answered in full once it reads; the daemon serves on."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=40)
    try:
        pulled = reader.client.start_pull(
            engine_id="reader", request_id="p", local_block_ids=[1, 2], remote=hold(holder, "p", 0)
        ).transfer_id
        reader.client.wait_transfer(pulled, timeout_s=30)

        watch = RawWatch(b.tcp)
        first = watch.next()
        assert first.incarnation == b.incarnation and not first.finished and not first.refused
        watch.send("nosuch", "", pulled)
        got = watch.answers(3)
        assert (
            isinstance(got[pulled], common_pb2.TransferStatus) and got[pulled].state == common_pb2.TRANSFER_STATE_DONE
        )
        unknown, empty = got["nosuch"], got[""]
        assert isinstance(unknown, router_pb2.TransferWatchRefusal)
        assert (unknown.error_code, unknown.error_class) == ("NOT_FOUND", "UnknownTransfer")
        assert isinstance(empty, router_pb2.TransferWatchRefusal)
        assert (empty.error_code, empty.error_class) == ("INVALID_ARGUMENT", "InvalidArgument")

        # A caller that sends 16 messages of 4096 unknown ids without reading: each is answered,
        # the stream goes on, and the daemon serves others meanwhile.
        flood = [[f"x{m}-{i}" for i in range(4096)] for m in range(16)]
        for ids in flood:
            watch.send(*ids)
        with KvdClient(b.tcp, timeout_s=30) as other:
            assert other.get_status().serving
        answers = watch.answers(16 * 4096)
        assert all(isinstance(r, router_pb2.TransferWatchRefusal) for r in answers.values())
        watch.send(pulled)
        assert watch.answers(1)[pulled].state == common_pb2.TRANSFER_STATE_DONE
        watch.half_close()
        with pytest.raises(StopIteration):  # everything answered, the caller done: the stream ends OK
            watch.next()
        assert watch.call.code() == grpc.StatusCode.OK
        watch.close()

        for bad in (["t"] * 4097, ["y" * 5000]):
            hostile = RawWatch(b.tcp)
            hostile.next()
            hostile.send(*bad)
            with pytest.raises(grpc.RpcError) as info:
                hostile.next()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert "4096" in (info.value.details() or "")
            hostile.close()

        with KvdClient(b.tcp, timeout_s=30) as router:  # still serving, nothing changed
            assert router.wait_transfer(pulled).state == common_pb2.TRANSFER_STATE_DONE
    finally:
        holder.close()
        reader.close()


def test_a_cancelled_pull_answers_its_waiter_aborted(spawn_daemon) -> None:
    """A pull waiting in the holder's admission (tokens not committed) is cancelled while a router
    waits on it: the waiter gets Aborted, the engine's blocks are untouched, and a later wait on
    the same id is answered Aborted at once."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=40, require_commits=True)
    try:
        started = reader.client.start_pull(
            engine_id="reader", request_id="c", local_block_ids=[1, 2], remote=hold(holder, "c", 0)
        ).transfer_id

        async def wait_and_cancel() -> BaseException | None:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                waiter = asyncio.create_task(router.wait_transfer(started))
                await asyncio.sleep(0.3)
                assert not waiter.done()
                status = (await router.get_transfer(started)).state
                assert status == common_pb2.TRANSFER_STATE_PLANNED
                await router.cancel_transfer(started)
                try:
                    await waiter
                except errors.KvdError as exc:
                    return exc
                return None

        error = asyncio.run(wait_and_cancel())
        assert type(error) is errors.Aborted and "cancelled by a caller" in str(error)
        with KvdClient(b.tcp, timeout_s=30) as router, pytest.raises(errors.Aborted, match="cancelled"):
            router.wait_transfer(started)
        assert reader.buffer.eq(FILL).all(), "a cancelled pull wrote into the engine's blocks"
    finally:
        holder.close()
        reader.close()


def test_a_daemon_stopped_mid_watch_sends_the_outcomes_then_unavailable(spawn_daemon) -> None:
    """SIGTERM while a router waits on two pulls (both waiting for commits): they are aborted
    within the grace period, each waiter gets that outcome (Aborted, daemon shutting down), the
    stream then ends UNAVAILABLE, and a wait on the client once the daemon exited is Unavailable."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon("--shutdown-grace-s", "0.5", name="b")
    holder, reader = engines(a, b, seed=40, require_commits=True)
    try:
        ids = start_pulls(holder, reader, "s", 2)
        raw = RawWatch(b.tcp)
        raw.next()
        raw.send(*ids)

        async def stop_mid_watch() -> tuple[list[object], BaseException | None]:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                waits = asyncio.create_task(router.wait_transfers(ids))
                await asyncio.sleep(0.3)
                assert not waits.done()
                b.process.send_signal(signal.SIGTERM)
                results = await waits
                assert await asyncio.to_thread(b.process.wait, 30) == 0
                try:
                    await router.wait_transfer(ids[0], timeout_s=10)
                except errors.KvdError as exc:
                    return results, exc
                return results, None

        results, later = asyncio.run(stop_mid_watch())
        for result in results:
            assert type(result) is errors.Aborted and "shutting down" in str(result), result
        assert isinstance(later, errors.Unavailable), later
        got = raw.answers(2)
        assert all(s.state == common_pb2.TRANSFER_STATE_ABORTED for s in got.values())  # type: ignore[union-attr]
        with pytest.raises(grpc.RpcError) as info:
            raw.next()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        raw.close()
    finally:
        reader.registered = False  # its daemon is gone
        holder.close()
        reader.close()


def test_a_watch_opened_in_the_shutdown_grace_gets_the_outcomes_and_starts_nothing(spawn_daemon) -> None:
    """A router that opens its stream after SIGTERM, within the grace period, is served: its waits
    get the outcomes of the pulls the daemon aborts (Aborted, shutting down), a pull it asks to
    start on that stream is refused Unavailable and starts nothing, and once the daemon exited a
    new wait is Unavailable."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon("--shutdown-grace-s", "3", name="b")
    holder, reader = engines(a, b, seed=40, require_commits=True)
    try:
        ids = start_pulls(holder, reader, "g", 2)
        late = hold(holder, "late", 6)
        b.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "signal received" not in b.log_tail(20):
            assert time.monotonic() < deadline, b.log_tail(20)
            time.sleep(0.02)

        async def watch_in_grace() -> tuple[list[object], BaseException | None, BaseException | None]:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                try:
                    await router.pull(engine_id="reader", request_id="late", local_block_ids=[7, 8], remote=late)
                    refused = None
                except errors.KvdError as exc:
                    refused = exc
                results = await router.wait_transfers(ids)
                assert await asyncio.to_thread(b.process.wait, 30) == 0
                try:
                    await router.wait_transfer(ids[0], timeout_s=10)
                except errors.KvdError as exc:
                    return results, refused, exc
                return results, refused, None

        results, refused, later = asyncio.run(watch_in_grace())
        assert type(refused) is errors.Unavailable and "shutting down" in str(refused), refused
        for result in results:
            assert type(result) is errors.Aborted and "shutting down" in str(result), result
        assert isinstance(later, errors.Unavailable), later
        assert reader.buffer.eq(FILL).all(), "an aborted or refused pull wrote into the engine's blocks"
    finally:
        reader.registered = False  # its daemon is gone
        holder.close()
        reader.close()


def test_a_daemon_killed_mid_watch_leaves_its_waiters_unavailable(spawn_daemon) -> None:
    """SIGKILL while a router waits: the stream breaks, the client opens it again, finds nobody,
    and every waiter gets Unavailable."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=40, require_commits=True)
    try:
        ids = start_pulls(holder, reader, "k", 3)
        with KvdClient(b.tcp, timeout_s=120) as router:

            def kill_soon() -> None:
                time.sleep(0.3)
                b.kill()

            killer = threading.Thread(target=kill_soon)
            killer.start()
            results = router.wait_transfers(ids)
            killer.join()
            assert all(isinstance(r, errors.Unavailable) for r in results), results
    finally:
        reader.registered = False
        holder.close()
        reader.close()
