"""AsyncKvdClient and AsyncEngineStream against a real in-process grpc server (asyncio.run)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from client_fakes import END, INCARNATION, FakeDaemon
from grpc_health.v1 import health_pb2

from kvd_client import AsyncEngineStream, AsyncKvdClient, errors
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2


def run_with(
    target: str,
    body: Callable[[AsyncKvdClient], Awaitable[None]],
    timeout_s: float | None = 10.0,
) -> None:
    """Run ``body`` with a client made inside the loop (grpc.aio channels belong to their loop)."""

    async def main() -> None:
        async with AsyncKvdClient(target, timeout_s=timeout_s) as kvd:
            await body(kvd)

    asyncio.run(main())


@pytest.fixture(params=["tcp", "unix"])
def target(request: pytest.FixtureRequest, daemon: FakeDaemon) -> str:
    return daemon.tcp if request.param == "tcp" else daemon.unix


def test_every_unary_method_round_trips(target: str, daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        reg = await kvd.register_kv_cache(
            engine_id="e0",
            layout=common_pb2.KvLayoutSpec(num_layers=1),
            layers=[common_pb2.LayerPlacement()],
            require_commits=True,
        )
        assert reg.daemon_incarnation == INCARNATION and reg.registration_id == 1
        await kvd.unregister_kv_cache(engine_id="e0", tp_rank=1)
        held = await kvd.hold_blocks(engine_id="e0", request_id="r1", block_ids=[1], num_tokens=9)
        assert held.lease.lease_id == "lease-r1"
        started = await kvd.start_pull(
            engine_id="d0", request_id="r1", remote=held.kv_transfer_params, local_block_ids=[3]
        )
        assert started.transfer_id == "xfer-r1"
        daemon.router.transfers["xfer-r1"] = common_pb2.TransferStatus(
            transfer_id="xfer-r1", state=common_pb2.TRANSFER_STATE_DONE
        )
        assert (await kvd.get_transfer("xfer-r1")).state == common_pb2.TRANSFER_STATE_DONE
        cancelled = await kvd.cancel_transfer(request=router_pb2.CancelTransferRequest(transfer_id="xfer-r1"))
        assert cancelled.state == common_pb2.TRANSFER_STATE_ABORTED
        assert (await kvd.lookup_held(engine_id="e0")).held[0].lease_id == "l1"
        assert (await kvd.renew_lease("l1", ttl_ms=42)).expires_unix_ms == 42
        await kvd.release_lease("l1")
        assert (await kvd.get_status()).serving
        assert await kvd.health_check() is True

    run_with(target, body)
    assert daemon.engine.requests["UnregisterKvCache"].tp_rank == 1
    assert daemon.router.requests["StartPull"].remote.lease_id == "lease-r1"
    assert daemon.router.requests["ReleaseLease"].lease_id == "l1"


def test_deadline_raises_deadline_exceeded_quickly(daemon: FakeDaemon) -> None:
    daemon.router.status_delay_s = 5.0

    async def body(kvd: AsyncKvdClient) -> None:
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded) as info:
            await kvd.get_status(timeout_s=0.2)
        assert time.monotonic() - started < 2.0
        assert isinstance(info.value.__cause__, grpc.RpcError)
        with pytest.raises(errors.DeadlineExceeded):
            await kvd.get_status()  # the constructor's default

    run_with(daemon.tcp, body, timeout_s=0.2)


def test_error_mapping(daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        with pytest.raises(errors.UnknownLease):
            await kvd.release_lease("unknown")
        with pytest.raises(errors.NotFound) as info:
            await kvd.release_lease("plain-missing")
        assert type(info.value) is errors.NotFound
        with pytest.raises(errors.LeaseExpired):
            await kvd.renew_lease("expired")

    run_with(daemon.unix, body)


def test_unavailable_when_nothing_listens(nowhere: str) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        with pytest.raises(errors.Unavailable):
            await kvd.get_status()
        assert await kvd.health_check() is False

    run_with(nowhere, body)


def test_watch_and_wait_transfer(daemon: FakeDaemon) -> None:
    states = [common_pb2.TRANSFER_STATE_READING, common_pb2.TRANSFER_STATE_DONE]
    daemon.router.watch_scripts["t1"] = [common_pb2.TransferStatus(transfer_id="t1", state=s) for s in states]
    daemon.router.watch_scripts["t2"] = [
        common_pb2.TransferStatus(
            transfer_id="t2",
            state=common_pb2.TRANSFER_STATE_FAILED,
            error_code="UNAVAILABLE",
            error_message="peer 10.0.0.9 died",
        )
    ]
    daemon.router.watch_scripts["t3"] = [30.0]
    daemon.router.watch_scripts["t404"] = [(grpc.StatusCode.NOT_FOUND, "no t404", "UnknownTransfer")]

    async def body(kvd: AsyncKvdClient) -> None:
        assert [s.state async for s in kvd.watch_transfer("t1")] == states
        assert (await kvd.wait_transfer("t1", 5)).state == common_pb2.TRANSFER_STATE_DONE
        with pytest.raises(errors.Unavailable, match="10.0.0.9"):
            await kvd.wait_transfer("t2", 5)
        with pytest.raises(errors.DeadlineExceeded):
            await kvd.wait_transfer("t3", 0.2)
        with pytest.raises(errors.UnknownTransfer):
            async for _ in kvd.watch_transfer("t404"):
                pass

    run_with(daemon.tcp, body)


def test_health_check_not_serving(daemon: FakeDaemon) -> None:
    daemon.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    async def body(kvd: AsyncKvdClient) -> None:
        assert await kvd.health_check() is False

    run_with(daemon.tcp, body)


async def poll_until(stream: AsyncEngineStream, count: int) -> list[engine_pb2.DaemonMessage]:
    got: list[engine_pb2.DaemonMessage] = []
    deadline = time.monotonic() + 5
    while len(got) < count and time.monotonic() < deadline:
        got.extend(await stream.poll(timeout_s=0.05))
    return got


def test_engine_stream_hello_commits_and_poll(daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        stream = kvd.open_engine_stream("e0", 3)
        assert await stream.poll() == []
        for i in range(50):
            assert stream.send_commit("r", i)
        stream.send_post_forward(1, ["r"])
        fake = await asyncio.to_thread(daemon.engine.wait_stream)
        received = await asyncio.to_thread(fake.wait_received, 52)
        assert received[0].hello.engine_id == "e0" and received[0].hello.tp_rank == 3
        assert [m.commit.committed_tokens for m in received[1:51]] == list(range(50))
        assert received[51].post_forward.finished_request_ids == ["r"]
        fake.outbound.put(
            engine_pb2.DaemonMessage(finished_sending=engine_pb2.FinishedSending(request_id="r", lease_id="l"))
        )
        got = await poll_until(stream, 1)
        assert got[0].finished_sending.lease_id == "l"
        await stream.close()
        assert stream.closed and stream.error is None
        assert stream.send_commit("r", 99) is False

    run_with(daemon.unix, body)


def test_engine_stream_async_iteration_and_error(daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        stream = kvd.open_engine_stream("e0", 0)
        fake = await asyncio.to_thread(daemon.engine.wait_stream)
        for rid in ("a", "b"):
            fake.outbound.put(engine_pb2.DaemonMessage(finished_recving=engine_pb2.FinishedRecving(request_id=rid)))
        fake.outbound.put((grpc.StatusCode.UNAVAILABLE, "daemon going away"))
        got = [m.finished_recving.request_id async for m in stream]
        assert got == ["a", "b"]
        assert stream.closed
        assert isinstance(stream.error, errors.Unavailable)
        assert "going away" in str(stream.error)

    run_with(daemon.tcp, body)


def test_engine_stream_unpacks_a_batch_into_its_events(daemon: FakeDaemon) -> None:
    def recving(rid: str) -> engine_pb2.DaemonMessage:
        return engine_pb2.DaemonMessage(finished_recving=engine_pb2.FinishedRecving(request_id=rid))

    async def body(kvd: AsyncKvdClient) -> None:
        stream = kvd.open_engine_stream("e0", 0)
        fake = await asyncio.to_thread(daemon.engine.wait_stream)
        fake.outbound.put(
            engine_pb2.DaemonMessage(batch=engine_pb2.DaemonMessageBatch(messages=[recving("a"), recving("b")]))
        )
        fake.outbound.put(recving("c"))
        assert [m.finished_recving.request_id for m in await poll_until(stream, 3)] == ["a", "b", "c"]
        fake.outbound.put(
            engine_pb2.DaemonMessage(batch=engine_pb2.DaemonMessageBatch(messages=[recving("d"), recving("e")]))
        )
        fake.outbound.put((grpc.StatusCode.UNAVAILABLE, "daemon going away"))
        assert [m.finished_recving.request_id async for m in stream] == ["d", "e"]
        assert (await asyncio.to_thread(fake.wait_received, 1))[0].hello.accepts_batches

    run_with(daemon.unix, body)


def test_engine_stream_ended_by_daemon(daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        async with kvd.open_engine_stream("e5", 1) as stream:
            fake = await asyncio.to_thread(daemon.engine.wait_stream)
            fake.outbound.put(END)
            assert [m async for m in stream] == []
            assert isinstance(stream.error, errors.Unavailable)
            assert "e5 rank 1" in str(stream.error)

    run_with(daemon.unix, body)


def test_client_close_closes_its_streams(daemon: FakeDaemon) -> None:
    async def main() -> None:
        kvd = AsyncKvdClient(daemon.unix)
        stream = kvd.open_engine_stream("e0", 0)
        fake = await asyncio.to_thread(daemon.engine.wait_stream)
        await kvd.close()
        assert stream.closed and stream.error is None
        assert await asyncio.to_thread(fake.client_done.wait, 5)

    asyncio.run(main())


def test_engine_stream_close_cancels_a_daemon_that_never_ends(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        stream = kvd.open_engine_stream("e0", 0)
        fake = await asyncio.to_thread(daemon.engine.wait_stream)
        monkeypatch.setattr(fake.outbound, "put", lambda item: None)
        started = time.monotonic()
        await stream.close(timeout_s=0.3)
        assert time.monotonic() - started < 3
        assert stream.closed and stream.error is None

    run_with(daemon.tcp, body)


def test_start_pulls_returns_each_pull_s_transfer_id_or_its_exact_error(target: str, daemon: FakeDaemon) -> None:
    async def body(kvd: AsyncKvdClient) -> None:
        pulls = [router_pb2.StartPullRequest(engine_id="d0", request_id=r) for r in ("r1", "bad-r2", "r3")]
        results = await kvd.start_pulls(request=router_pb2.StartPullsRequest(pulls=pulls))
        assert results[0] == "xfer-r1" and results[2] == "xfer-r3"
        assert type(results[1]) is errors.InvalidArgument and str(results[1]) == "no bad-r2"
        with pytest.raises(errors.InvalidArgument, match="at most 4"):
            await kvd.start_pulls(pulls + pulls)

    run_with(target, body)
