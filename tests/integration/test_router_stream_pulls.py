"""A router's pull started and waited on the client's one WatchTransfers stream, real daemons.

The reader daemon's first stream message says ``takes_pulls``; from then on the client's
``pull(...)`` (asyncio and sync) sends its start on the stream (``start_pulls``) and learns both
its start (``started``, by seq) and its end (``finished``) there, with no StartPull call. Checked
here with real `kvd serve` daemons and real NIXL pulls: 32 concurrent pulls (default transports and
``UCX_TLS=tcp``) and pulls from 8 threads move exact bytes on one stream; a hand-opened stream
answers each start by its seq before its end, a bad start alone and changing nothing; a message of
more than 1024 starts refuses each one INVALID_ARGUMENT, starts none and the stream goes on; a
refused start raises its exact class from ``pull``; and a pull past its ``timeout_s`` raises
DeadlineExceeded while the pull goes on.

Pulls that stay in flight as long as the test needs: the holder requires commits
(``require_commits``) and waits long for them (``--commit-wait-s``), so a pull of tokens not
committed yet waits in the holder's admission until the test ends it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from kvtest import ShmEngine, metric_value, scrape
from watch_kit import DONE, FILL, FINAL, PULLS, TOKENS, RawWatch, engines, hold

from kvd_client import AsyncKvdClient, KvdClient, errors
from kvd_client.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.integration


def _env(transports: str) -> dict[str, str] | None:
    return {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None


def _request(
    request_id: str, blocks: list[int], remote: common_pb2.KvTransferParams, engine_id: str = "reader"
) -> router_pb2.StartPullRequest:
    return router_pb2.StartPullRequest(
        engine_id=engine_id, request_id=request_id, local_block_ids=blocks, remote=remote
    )


def _nth(i: int, params: common_pb2.KvTransferParams) -> router_pb2.StartPullRequest:
    """Pull ``i``: the holder's blocks 2i, 2i+1 (request r<i>) into the reader's 2i+1, 2i+2."""
    return _request(f"r{i}", [2 * i + 1, 2 * i + 2], params)


def _assert_exact(holder: ShmEngine, reader: ShmEngine, i: int, status: common_pb2.TransferStatus) -> None:
    assert status.state == DONE, status
    assert status.request_id == f"r{i}" and status.bytes > 0, status
    got = reader.token_bytes([2 * i + 1, 2 * i + 2], TOKENS)
    assert got.equal(holder.token_bytes([2 * i, 2 * i + 1], TOKENS)), f"pull r{i} delivered other bytes"


def _leases(holder: ShmEngine) -> dict[str, str]:
    """What the holder holds for remote readers: request id -> lease id."""
    return {p.request_id: p.lease_id for p in holder.client.lookup_held(engine_id="holder").held}


class Counted:
    """A stub method that counts its calls (to tell a pull on the stream from one by StartPull)."""

    def __init__(self, method: Any) -> None:
        self.method = method
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
        return self.method(*args, **kwargs)


def _count_start_pulls(client: AsyncKvdClient | KvdClient) -> Counted:
    counted = Counted(client._router.StartPull)
    client._router.StartPull = counted  # type: ignore[method-assign]
    return counted


async def _stream_answered(router: AsyncKvdClient) -> None:
    """Until the client's stream has its first message (a wait on an unknown id rides it)."""
    [result] = await router.wait_transfers(["no-such-transfer"])
    assert type(result) is errors.UnknownTransfer, result
    assert router._watch._book.takes_pulls


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_32_concurrent_pulls_ride_the_stream_and_move_exact_bytes(spawn_daemon, transports: str) -> None:
    """A router's 32 concurrent ``pull`` calls over TCP, after a first one (StartPull while the
    stream opens): every later start and end rides the one stream, no StartPull is called, each
    pull is DONE and its bytes are the holder's, byte for byte, nothing else written."""
    env = _env(transports)
    a, b = spawn_daemon(name="a", env=env), spawn_daemon(name="b", env=env)
    holder, reader = engines(a, b, seed=41)
    try:
        params = [hold(holder, f"r{i}", 2 * i) for i in range(PULLS + 1)]  # the last: the warm-up

        async def route() -> tuple[common_pb2.TransferStatus, list[common_pb2.TransferStatus]]:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                start_pull = _count_start_pulls(router)
                warm = await router.pull(request=_nth(PULLS, params[PULLS]))
                assert start_pull.calls == 1  # the very first pull: StartPull while the stream opened
                book = router._watch._book
                assert book.generation == 1 and book.takes_pulls
                statuses = await asyncio.gather(*(router.pull(request=_nth(i, params[i])) for i in range(PULLS)))
                assert start_pull.calls == 1, "pulls went by StartPull, not on the stream"
                assert book.generation == 1, "the pulls did not share one stream"
                assert book.waiting == 0 and not book._starts  # nothing left waited on
                # The daemon knows each pull the stream started, by the id the stream answered.
                for status in statuses:
                    assert (await router.get_transfer(status.transfer_id)).state == DONE
                return warm, list(statuses)

        warm, statuses = asyncio.run(route())
        _assert_exact(holder, reader, PULLS, warm)
        for i, status in enumerate(statuses):
            _assert_exact(holder, reader, i, status)
        assert len({s.transfer_id for s in statuses}) == PULLS
        assert reader.untouched_outside([([2 * i + 1, 2 * i + 2], TOKENS) for i in range(PULLS + 1)], FILL)
    finally:
        holder.close()
        reader.close()


def test_a_hand_opened_stream_answers_each_start_before_its_end_and_a_bad_one_alone(spawn_daemon) -> None:
    """The first message says takes_pulls. One message starting a good pull and three bad ones (no
    remote, an unknown engine, too few local blocks): each seq is answered once, the bad ones with
    their exact code and class and no transfer, the good one's final status after its start's
    answer. The bad ones changed nothing (their leases still held, the reader's blocks untouched);
    the good one is the transfer StartPull of the same pull answers; the stream then ends OK."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41)
    watch: RawWatch | None = None
    try:
        good = _request("r0", [1, 2], hold(holder, "r0", 0))
        unknown_engine = _request("unknown-engine", [3, 4], hold(holder, "unknown-engine", 2), engine_id="nosuch")
        too_few = _request("too-few", [5], hold(holder, "too-few", 4))
        no_remote = router_pb2.StartPullRequest(engine_id="reader", request_id="no-remote", local_block_ids=[7, 8])
        held = _leases(holder)
        assert set(held) == {"r0", "unknown-engine", "too-few"}

        watch = RawWatch(b.tcp)
        first = watch.next()
        assert first.takes_pulls and first.incarnation == b.incarnation
        assert not first.finished and not first.refused and not first.started
        watch.start((7, good), (8, no_remote), (9, unknown_engine), (10, too_few))
        started, finished = watch.outcomes({7, 8, 9, 10})

        bad = {seq: started[seq] for seq in (8, 9, 10)}
        assert all(not r.transfer_id for r in bad.values()), bad
        assert (bad[8].error_code, bad[8].error_class) == ("INVALID_ARGUMENT", "InvalidArgument")
        assert "remote" in bad[8].error_message
        assert (bad[9].error_code, bad[9].error_class) == ("NOT_FOUND", "UnknownEngine")
        assert "nosuch" in bad[9].error_message
        assert (bad[10].error_code, bad[10].error_class) == ("INVALID_ARGUMENT", "InvalidArgument")
        assert "local block" in bad[10].error_message
        transfer_id = started[7].transfer_id
        assert transfer_id and not started[7].error_code and not started[7].error_class
        assert list(finished) == [transfer_id]
        _assert_exact(holder, reader, 0, finished[transfer_id])

        # The bad starts changed nothing: their leases are held as before, their blocks untouched.
        after = _leases(holder)
        assert {k: after.get(k) for k in ("unknown-engine", "too-few")} == {
            k: held[k] for k in ("unknown-engine", "too-few")
        }
        assert reader.untouched_outside([([1, 2], TOKENS)], FILL)
        # Started as StartPull would: the same pull asked by StartPull answers that transfer.
        assert reader.client.get_transfer(transfer_id).state == DONE
        assert reader.client.start_pull(request=good).transfer_id == transfer_id

        watch.half_close()
        with pytest.raises(StopIteration):  # everything answered, the caller done: the stream ends OK
            watch.next()
        assert watch.call.code() == grpc.StatusCode.OK
    finally:
        if watch is not None:
            watch.close()
        holder.close()
        reader.close()


def test_more_than_1024_starts_in_one_message_are_each_refused_and_the_stream_goes_on(spawn_daemon) -> None:
    """1025 starts in one message (a good pull among them): each is refused INVALID_ARGUMENT, none
    starts (the good one's lease still held, the reader untouched), and the stream goes on: the
    next message of 1024 starts (the bound itself) starts the good pull, its neighbours each
    refused on their own."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41)
    watch: RawWatch | None = None
    try:
        params = hold(holder, "r0", 0)
        good = _nth(0, params)
        held = _leases(holder)

        def neighbour(n: int) -> router_pb2.StartPullRequest:
            return _request(f"x{n}", [3, 4], params, engine_id="nosuch")

        watch = RawWatch(b.tcp)
        assert watch.next().takes_pulls
        over = [(1, good), *((1 + n, neighbour(n)) for n in range(1, 1025))]
        assert len(over) == 1025
        watch.start(*over)
        started, finished = watch.outcomes({seq for seq, _ in over})
        assert not finished
        for seq, result in started.items():
            assert not result.transfer_id, (seq, result)
            assert (result.error_code, result.error_class) == ("INVALID_ARGUMENT", "InvalidArgument"), (seq, result)
            assert "1024" in result.error_message and "1025" in result.error_message, result.error_message
        assert _leases(holder) == held, "a start of a refused message changed the holder's leases"
        assert reader.buffer.eq(FILL).all(), "a start of a refused message wrote into the reader"

        at_bound = [(2000, good), *((2000 + n, neighbour(n)) for n in range(1, 1024))]
        assert len(at_bound) == 1024
        watch.start(*at_bound)
        started, finished = watch.outcomes({seq for seq, _ in at_bound})
        transfer_id = started.pop(2000).transfer_id
        assert transfer_id
        for seq, result in started.items():
            assert not result.transfer_id, (seq, result)
            assert (result.error_code, result.error_class) == ("NOT_FOUND", "UnknownEngine"), (seq, result)
        assert list(finished) == [transfer_id]
        _assert_exact(holder, reader, 0, finished[transfer_id])
        assert reader.untouched_outside([([1, 2], TOKENS)], FILL)
    finally:
        if watch is not None:
            watch.close()
        holder.close()
        reader.close()


def test_sync_pulls_from_8_threads_at_once_are_done_and_exact(spawn_daemon) -> None:
    """The sync ``KvdClient.pull`` from 8 threads at once, twice over: all DONE, bytes exact, on one
    stream. The first round may go by StartPull (the stream opening); once its first message came,
    none does."""
    threads = 8
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41)
    try:
        params = [hold(holder, f"r{i}", 2 * i) for i in range(3 * threads)]
        with KvdClient(b.tcp, timeout_s=60) as router:
            start_pull = _count_start_pulls(router)
            barrier = threading.Barrier(threads)

            def run(indices: list[int]) -> list[common_pb2.TransferStatus]:
                barrier.wait()
                return [router.pull(request=_nth(i, params[i])) for i in indices]

            with ThreadPoolExecutor(threads) as pool:
                first = list(pool.map(run, [[t] for t in range(threads)]))
                first_calls = start_pull.calls
                assert 1 <= first_calls <= threads
                assert router._watch._book.takes_pulls
                second = list(pool.map(run, [[threads + 2 * t, threads + 2 * t + 1] for t in range(threads)]))
            assert start_pull.calls == first_calls, "pulls went by StartPull once the stream took them"
            book = router._watch._book
            assert book.generation == 1 and book.waiting == 0 and not book._starts
        statuses = [s for batch in first for s in batch]
        for t in range(threads):
            statuses.extend(second[t])
        order = list(range(threads)) + [threads + 2 * t + k for t in range(threads) for k in (0, 1)]
        for i, status in zip(order, statuses, strict=True):
            _assert_exact(holder, reader, i, status)
        assert reader.untouched_outside([([2 * i + 1, 2 * i + 2], TOKENS) for i in range(3 * threads)], FILL)
    finally:
        holder.close()
        reader.close()


def test_a_refused_start_raises_its_exact_class_from_pull_and_changes_nothing(spawn_daemon) -> None:
    """Refused starts raise their exact class from ``pull`` (asyncio and sync), on the first call
    (StartPull) and on the stream alike: an unknown engine, too few or too many local blocks, one
    out of range, no lease, no remote. The daemon's StartPull refused only each client's first
    (the others never called it); the lease is held as before, the reader untouched, and the same
    lease then pulls fine on the stream."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41)
    try:
        params = hold(holder, "r0", 0)
        held = _leases(holder)
        no_lease = common_pb2.KvTransferParams()
        no_lease.CopyFrom(params)
        no_lease.lease_id = ""
        cases: list[tuple[router_pb2.StartPullRequest, type[errors.KvdError], str]] = [
            (_request("r0", [1, 2], params, engine_id="nosuch"), errors.UnknownEngine, "nosuch"),
            (_request("r0", [1], params), errors.InvalidArgument, "local block"),
            (_request("r0", [1, 2, 3], params), errors.InvalidArgument, "local block"),
            (_request("r0", [1, 2 * PULLS + 8], params), errors.InvalidArgument, "out of range"),
            (_request("r0", [1, 2], no_lease), errors.InvalidArgument, "lease"),
            (router_pb2.StartPullRequest(engine_id="reader", request_id="r0", local_block_ids=[1, 2]),
             errors.InvalidArgument, "remote"),
        ]  # fmt: skip

        async def route() -> None:
            async with AsyncKvdClient(b.tcp, timeout_s=30) as router:
                start_pull = _count_start_pulls(router)
                with pytest.raises(errors.KvdError) as info:  # the first: by StartPull
                    await router.pull(request=cases[0][0])
                assert type(info.value) is errors.UnknownEngine, info.value
                assert start_pull.calls == 1
                await _stream_answered(router)
                for request, cls, text in cases:
                    with pytest.raises(errors.KvdError, match=text) as info:
                        await router.pull(request=request)
                    assert type(info.value) is cls, (request, info.value)
                assert start_pull.calls == 1, "a start went by StartPull, not on the stream"
                book = router._watch._book
                assert book.generation == 1 and book.waiting == 0 and not book._starts

        asyncio.run(route())
        # The daemon's StartPull refused the first pull only: the others never called it.
        assert metric_value(scrape(b.metrics), "kvd_errors_total", operation="StartPull") == 1

        with KvdClient(b.tcp, timeout_s=30) as router:
            with pytest.raises(errors.KvdError) as info:  # the first: by StartPull
                router.pull(request=cases[0][0])
            assert type(info.value) is errors.UnknownEngine, info.value
            router.wait_transfers(["no-such-transfer"])  # the stream answered: starts ride it
            assert router._watch._book.takes_pulls
            start_pull = _count_start_pulls(router)
            for request, cls, text in cases:
                with pytest.raises(errors.KvdError, match=text) as info:
                    router.pull(request=request)
                assert type(info.value) is cls, (request, info.value)
            assert start_pull.calls == 0, "a start went by StartPull, not on the stream"
            assert metric_value(scrape(b.metrics), "kvd_errors_total", operation="StartPull") == 2
            assert _leases(holder) == held, "a refused start changed the holder's leases"
            assert reader.buffer.eq(FILL).all(), "a refused start wrote into the reader"
            status = router.pull(request=_nth(0, params))  # the lease was untouched: it pulls fine
            assert start_pull.calls == 0
        _assert_exact(holder, reader, 0, status)
        assert reader.untouched_outside([([1, 2], TOKENS)], FILL)
    finally:
        holder.close()
        reader.close()


def test_a_pull_past_its_timeout_raises_deadline_exceeded_and_goes_on(spawn_daemon) -> None:
    """A pull that waits in the holder's admission (tokens not committed) and ``pull(timeout_s=0.5)``
    (asyncio and sync, on the stream): DeadlineExceeded after about 0.5 s, the pull going on (the
    same pull asked again answers its transfer, not final); a second ``pull`` of it waits on that
    transfer, and cancelling it raises Aborted there; the reader's blocks are untouched."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41, require_commits=True)
    try:
        slow = [_nth(i, hold(holder, f"r{i}", 2 * i)) for i in range(2)]

        async def route() -> None:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                await _stream_answered(router)
                start_pull = _count_start_pulls(router)
                began = time.monotonic()
                with pytest.raises(errors.KvdError, match="goes on") as info:
                    await router.pull(request=slow[0], timeout_s=0.5)
                waited = time.monotonic() - began
                assert type(info.value) is errors.DeadlineExceeded, info.value
                assert 0.45 <= waited < 10, waited
                assert start_pull.calls == 0
                book = router._watch._book
                assert book.waiting == 0 and not book._starts  # the given-up wait left nothing behind
                transfer_id = (await router.start_pull(request=slow[0])).transfer_id  # idempotent: that pull
                assert transfer_id in str(info.value)
                assert (await router.get_transfer(transfer_id)).state not in FINAL
                again = asyncio.create_task(router.pull(request=slow[0]))
                await asyncio.sleep(0.3)
                assert not again.done()
                await router.cancel_transfer(transfer_id)
                with pytest.raises(errors.KvdError) as info:
                    await again
                assert type(info.value) is errors.Aborted, info.value
                assert book.generation == 1 and book.waiting == 0 and not book._starts

        asyncio.run(route())

        with KvdClient(b.tcp, timeout_s=60) as router:
            router.wait_transfers(["no-such-transfer"])  # the stream answered: the pull rides it
            assert router._watch._book.takes_pulls
            start_pull = _count_start_pulls(router)
            began = time.monotonic()
            with pytest.raises(errors.KvdError, match="goes on") as info:
                router.pull(request=slow[1], timeout_s=0.5)
            assert type(info.value) is errors.DeadlineExceeded, info.value
            assert 0.45 <= time.monotonic() - began < 10
            assert start_pull.calls == 0
            transfer_id = router.start_pull(request=slow[1]).transfer_id
            assert start_pull.calls == 1 and transfer_id in str(info.value)
            assert router.get_transfer(transfer_id).state not in FINAL
            assert router.cancel_transfer(transfer_id).state == common_pb2.TRANSFER_STATE_ABORTED
            with pytest.raises(errors.KvdError) as info:
                router.wait_transfer(transfer_id)
            assert type(info.value) is errors.Aborted, info.value
        assert reader.buffer.eq(FILL).all(), "a pull that never got its commits wrote into the reader"
    finally:
        holder.close()
        reader.close()


def test_a_pull_retried_at_once_after_its_timeout_still_learns_its_end(spawn_daemon) -> None:
    """A router retries a pull at once after ``pull(timeout_s=...)`` raised DeadlineExceeded (the
    natural retry: the same pull, idempotent, so the daemon answers the transfer still running).
    The retry's waiter must learn that transfer's end: cancelled, it raises Aborted.

    The given-up wait's unwatch of the transfer and the retry's start leave in one stream message;
    the daemon must not let that unwatch drop the watch the retry's start needs."""
    a = spawn_daemon("--commit-wait-s", "60", name="a")
    b = spawn_daemon(name="b")
    holder, reader = engines(a, b, seed=41, require_commits=True)
    try:
        slow = _nth(0, hold(holder, "r0", 0))

        async def route() -> BaseException | None:
            async with AsyncKvdClient(b.tcp, timeout_s=60) as router:
                await _stream_answered(router)

                async def retried() -> common_pb2.TransferStatus:
                    with pytest.raises(errors.DeadlineExceeded):
                        await router.pull(request=slow, timeout_s=0.5)
                    return await router.pull(request=slow, timeout_s=10)  # at once, no await between

                retry = asyncio.create_task(retried())
                await asyncio.sleep(1.5)  # the first timed out, the retry waits
                assert not retry.done()
                transfer_id = (await router.start_pull(request=slow)).transfer_id
                await router.cancel_transfer(transfer_id)
                try:
                    await retry
                except errors.KvdError as exc:
                    return exc
                return None

        error = asyncio.run(route())
        assert type(error) is errors.Aborted, f"the retry did not learn its transfer's end: {error!r}"
    finally:
        holder.close()
        reader.close()
