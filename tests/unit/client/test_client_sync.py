"""KvdClient (sync) against a real in-process grpc server with fake servicers."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import grpc
import pytest
from client_fakes import INCARNATION, FakeDaemon
from grpc_health.v1 import health_pb2

from kvd_client import KvdClient, errors
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2


@pytest.fixture(params=["tcp", "unix"])
def client(request: pytest.FixtureRequest, daemon: FakeDaemon) -> Iterator[KvdClient]:
    """A client over TCP and over the Unix socket: every test runs on both."""
    target = daemon.tcp if request.param == "tcp" else daemon.unix
    with KvdClient(target) as kvd:
        yield kvd


def layout() -> common_pb2.KvLayoutSpec:
    return common_pb2.KvLayoutSpec(num_layers=2, block_size=16, num_blocks=8, tp_size=1)


def test_register_kv_cache_sends_fields_and_returns_response(client: KvdClient, daemon: FakeDaemon) -> None:
    response = client.register_kv_cache(
        engine_id="e0",
        layout=layout(),
        regions=[common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, shm_name="kv0")],
        layers=[common_pb2.LayerPlacement(k_offset=0), common_pb2.LayerPlacement(k_offset=64)],
        require_commits=True,
        engine_pid=1234,
    )
    assert isinstance(response, engine_pb2.RegisterKvCacheResponse)
    assert response.daemon_incarnation == INCARNATION
    assert response.registration_id == 2
    sent = daemon.engine.requests["RegisterKvCache"]
    assert sent.engine_id == "e0" and sent.require_commits and sent.engine_pid == 1234
    assert sent.layout.block_size == 16 and sent.regions[0].shm_name == "kv0"


def test_prebuilt_request_is_sent_as_is(client: KvdClient, daemon: FakeDaemon) -> None:
    req = engine_pb2.UnregisterKvCacheRequest(engine_id="e1", tp_rank=3)
    client.unregister_kv_cache(request=req)
    assert daemon.engine.requests["UnregisterKvCache"] == req


def test_request_and_fields_together_are_refused(client: KvdClient) -> None:
    with pytest.raises(TypeError, match="not both"):
        client.unregister_kv_cache(engine_id="e1", request=engine_pb2.UnregisterKvCacheRequest(engine_id="e2"))
    with pytest.raises(TypeError, match="UnregisterKvCacheRequest"):
        client.unregister_kv_cache(request=router_pb2.GetStatusRequest())  # type: ignore[arg-type]


def test_hold_blocks_returns_lease_and_transfer_params(client: KvdClient, daemon: FakeDaemon) -> None:
    response = client.hold_blocks(engine_id="e0", request_id="r1", block_ids=[4, 5, 6], num_tokens=40, ttl_ms=500)
    assert response.lease.lease_id == "lease-r1"
    assert list(response.kv_transfer_params.block_ids) == [4, 5, 6]
    assert response.kv_transfer_params.num_tokens == 40
    assert daemon.engine.requests["HoldBlocks"].ttl_ms == 500


def test_start_pull_and_transfer_calls_round_trip(client: KvdClient, daemon: FakeDaemon) -> None:
    remote = common_pb2.KvTransferParams(daemon_address="10.0.0.2:7070", lease_id="L")
    started = client.start_pull(
        engine_id="d0",
        tp_rank=1,
        request_id="r9",
        local_block_ids=[1, 2],
        remote=remote,
        deadline_ms=2000,
    )
    assert started.transfer_id == "xfer-r9"
    sent = daemon.router.requests["StartPull"]
    assert sent.remote.lease_id == "L" and list(sent.local_block_ids) == [1, 2]
    assert sent.deadline_ms == 2000

    daemon.router.transfers["xfer-r9"] = common_pb2.TransferStatus(
        transfer_id="xfer-r9", state=common_pb2.TRANSFER_STATE_READING
    )
    assert client.get_transfer("xfer-r9").state == common_pb2.TRANSFER_STATE_READING
    cancelled = client.cancel_transfer("xfer-r9")
    assert cancelled.state == common_pb2.TRANSFER_STATE_ABORTED
    assert daemon.router.requests["CancelTransfer"].transfer_id == "xfer-r9"


def test_lease_and_lookup_calls_round_trip(client: KvdClient, daemon: FakeDaemon) -> None:
    held = client.lookup_held(engine_id="e0", request_id="r1")
    assert [h.lease_id for h in held.held] == ["l1"]
    assert daemon.router.requests["LookupHeld"].engine_id == "e0"
    assert client.renew_lease("l1", ttl_ms=750).expires_unix_ms == 750
    assert isinstance(client.release_lease("l1"), router_pb2.ReleaseLeaseResponse)
    assert daemon.router.requests["ReleaseLease"].lease_id == "l1"


def test_get_status(client: KvdClient) -> None:
    status = client.get_status()
    assert status.incarnation == INCARNATION and status.serving and status.leases_held == 3
    assert status.engines[0].tp_size == 2


def test_per_call_deadline_raises_deadline_exceeded_quickly(client: KvdClient, daemon: FakeDaemon) -> None:
    daemon.router.status_delay_s = 5.0
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded) as info:
        client.get_status(timeout_s=0.2)
    assert time.monotonic() - started < 2.0
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_constructor_default_deadline_applies(daemon: FakeDaemon) -> None:
    daemon.router.status_delay_s = 5.0
    with KvdClient(daemon.tcp, timeout_s=0.2) as kvd:
        started = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            kvd.get_status()
        assert time.monotonic() - started < 2.0


def test_infinite_timeout_means_no_deadline(daemon: FakeDaemon) -> None:
    daemon.router.status_delay_s = 0.3
    with KvdClient(daemon.tcp, timeout_s=0.05) as kvd:
        assert kvd.get_status(timeout_s=math.inf).serving


@pytest.mark.parametrize(
    ("lease_id", "expected"),
    [
        ("unknown", errors.UnknownLease),
        ("plain-missing", errors.NotFound),
        ("mismatch", errors.InvalidArgument),
        ("bogus-class", errors.NotFound),
    ],
)
def test_errors_map_to_kvd_classes(client: KvdClient, lease_id: str, expected: type[errors.KvdError]) -> None:
    with pytest.raises(errors.KvdError) as info:
        client.release_lease(lease_id)
    assert type(info.value) is expected
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_metadata_class_gives_most_specific_leaf(client: KvdClient) -> None:
    with pytest.raises(errors.LeaseExpired):
        client.renew_lease("expired")
    with pytest.raises(errors.UnknownEngine, match="no engine ghost"):
        client.unregister_kv_cache(engine_id="ghost")
    with pytest.raises(errors.AlreadyExists):
        client.register_kv_cache(engine_id="dup")


def test_unmapped_code_is_a_plain_kvd_error_carrying_the_code(client: KvdClient) -> None:
    with pytest.raises(errors.KvdError) as info:
        client.release_lease("unimplemented")
    assert type(info.value) is errors.KvdError
    assert info.value.code == errors.ErrorCode.UNIMPLEMENTED


def test_unavailable_when_nothing_listens(nowhere: str) -> None:
    with KvdClient(nowhere, timeout_s=2.0) as kvd:
        with pytest.raises(errors.Unavailable) as info:
            kvd.get_status()
        assert isinstance(info.value.__cause__, grpc.RpcError)
        assert kvd.health_check() is False


def test_watch_transfer_yields_each_state(client: KvdClient, daemon: FakeDaemon) -> None:
    states = [
        common_pb2.TRANSFER_STATE_PLANNED,
        common_pb2.TRANSFER_STATE_READING,
        common_pb2.TRANSFER_STATE_DONE,
    ]
    daemon.router.watch_scripts["t1"] = [common_pb2.TransferStatus(transfer_id="t1", state=s) for s in states]
    assert [s.state for s in client.watch_transfer("t1")] == states


def test_watch_transfer_maps_stream_errors(client: KvdClient, daemon: FakeDaemon) -> None:
    daemon.router.watch_scripts["t404"] = [(grpc.StatusCode.NOT_FOUND, "no transfer t404", "UnknownTransfer")]
    with pytest.raises(errors.UnknownTransfer):
        list(client.watch_transfer("t404"))


def test_abandoned_watch_cancels_the_rpc(client: KvdClient, daemon: FakeDaemon) -> None:
    daemon.router.watch_scripts["t2"] = [
        common_pb2.TransferStatus(transfer_id="t2", state=common_pb2.TRANSFER_STATE_READING),
        30.0,
    ]
    watch = client.watch_transfer("t2", timeout_s=math.inf)
    assert next(watch).state == common_pb2.TRANSFER_STATE_READING
    watch.close()
    assert daemon.router.watch_cancelled.wait(5)


def test_wait_transfer_returns_done_status(client: KvdClient, daemon: FakeDaemon) -> None:
    daemon.router.watch_scripts["t3"] = [
        common_pb2.TransferStatus(transfer_id="t3", state=common_pb2.TRANSFER_STATE_READING),
        common_pb2.TransferStatus(transfer_id="t3", state=common_pb2.TRANSFER_STATE_DONE, bytes=4096, direct=True),
    ]
    done = client.wait_transfer("t3", timeout_s=5)
    assert done.state == common_pb2.TRANSFER_STATE_DONE and done.bytes == 4096


@pytest.mark.parametrize(
    ("state", "code", "expected"),
    [
        (common_pb2.TRANSFER_STATE_FAILED, "UNAVAILABLE", errors.Unavailable),
        (common_pb2.TRANSFER_STATE_ABORTED, "ABORTED", errors.Aborted),
        (common_pb2.TRANSFER_STATE_FAILED, "FAILED_PRECONDITION", errors.FailedPrecondition),
        (common_pb2.TRANSFER_STATE_FAILED, "", errors.Internal),
        (common_pb2.TRANSFER_STATE_ABORTED, "", errors.Aborted),
    ],
)
def test_wait_transfer_raises_the_transfer_error(
    client: KvdClient,
    daemon: FakeDaemon,
    state: common_pb2.TransferState,
    code: str,
    expected: type[errors.KvdError],
) -> None:
    daemon.router.watch_scripts["t4"] = [
        common_pb2.TransferStatus(transfer_id="t4", state=state, error_code=code, error_message="peer 10.0.0.2 died")
    ]
    with pytest.raises(expected, match="10.0.0.2"):
        client.wait_transfer("t4", timeout_s=5)


def test_wait_transfer_times_out(client: KvdClient, daemon: FakeDaemon) -> None:
    daemon.router.watch_scripts["t5"] = [
        common_pb2.TransferStatus(transfer_id="t5", state=common_pb2.TRANSFER_STATE_READING),
        30.0,
    ]
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded):
        client.wait_transfer("t5", timeout_s=0.3)
    assert time.monotonic() - started < 2.0


def test_wait_transfer_answers_a_transfer_that_ended_before_the_wait(client: KvdClient, daemon: FakeDaemon) -> None:
    """A transfer that ended before anyone waited is answered at once with how it ended."""
    daemon.router.transfers["t6"] = common_pb2.TransferStatus(
        transfer_id="t6", state=common_pb2.TRANSFER_STATE_ABORTED, error_code="ABORTED", error_class="Aborted"
    )
    with pytest.raises(errors.Aborted):
        client.wait_transfer("t6", timeout_s=5)


def test_waits_share_one_watch_stream(client: KvdClient, daemon: FakeDaemon) -> None:
    """Every wait of a client rides one WatchTransfers stream; an unknown id fails alone."""
    for i in range(5):
        daemon.router.transfers[f"s{i}"] = common_pb2.TransferStatus(
            transfer_id=f"s{i}", state=common_pb2.TRANSFER_STATE_DONE, bytes=i
        )
    assert [client.wait_transfer(f"s{i}", timeout_s=5).bytes for i in range(5)] == list(range(5))
    with pytest.raises(errors.UnknownTransfer):
        client.wait_transfer("nosuch", timeout_s=5)
    results = client.wait_transfers(["s1", "nosuch", "s3"], timeout_s=5)
    assert isinstance(results[0], common_pb2.TransferStatus) and results[0].bytes == 1
    assert isinstance(results[1], errors.UnknownTransfer)
    assert isinstance(results[2], common_pb2.TransferStatus) and results[2].bytes == 3
    assert daemon.router.watch_transfers_streams == 1
    assert "WatchTransfer" not in daemon.router.requests


def test_wait_transfers_reports_each_outcome_and_the_ones_still_running(client: KvdClient, daemon: FakeDaemon) -> None:
    """wait_transfers returns per id, in order, its status or its error; DeadlineExceeded for an
    id still running at the deadline (nothing raised)."""
    daemon.router.transfers["w1"] = common_pb2.TransferStatus(transfer_id="w1", state=common_pb2.TRANSFER_STATE_DONE)
    daemon.router.watch_scripts["w2"] = [30.0]
    daemon.router.watch_scripts["w3"] = [
        common_pb2.TransferStatus(
            transfer_id="w3",
            state=common_pb2.TRANSFER_STATE_FAILED,
            error_code="DEADLINE_EXCEEDED",
            error_class="LeaseExpired",
        )
    ]
    started = time.monotonic()
    done, running, failed = client.wait_transfers(["w1", "w2", "w3"], timeout_s=0.3)
    assert time.monotonic() - started < 2.0
    assert isinstance(done, common_pb2.TransferStatus)
    assert isinstance(running, errors.DeadlineExceeded) and "w2" in running.message
    assert isinstance(failed, errors.LeaseExpired)
    assert client.wait_transfers([], timeout_s=1) == []


def test_wait_transfer_against_a_daemon_without_watch_transfers(client: KvdClient, daemon: FakeDaemon) -> None:
    """A daemon older than WatchTransfers (UNIMPLEMENTED): each wait watches its transfer alone,
    and falls back to GetTransfer when that watch ends early."""
    daemon.router.watch_transfers_unimplemented = True
    daemon.router.watch_scripts["t6"] = [
        common_pb2.TransferStatus(transfer_id="t6", state=common_pb2.TRANSFER_STATE_READING)
    ]
    daemon.router.transfers["t6"] = common_pb2.TransferStatus(transfer_id="t6", state=common_pb2.TRANSFER_STATE_READING)
    daemon.router.watch_scripts["t7"] = []
    daemon.router.transfers["t7"] = common_pb2.TransferStatus(transfer_id="t7", state=common_pb2.TRANSFER_STATE_READING)
    with pytest.raises(errors.Unavailable, match="t6"):
        client.wait_transfer("t6", timeout_s=5)
    daemon.router.transfers["t7"] = common_pb2.TransferStatus(transfer_id="t7", state=common_pb2.TRANSFER_STATE_DONE)
    assert client.wait_transfer("t7", timeout_s=5).state == common_pb2.TRANSFER_STATE_DONE
    daemon.router.watch_scripts["t8"] = [
        common_pb2.TransferStatus(transfer_id="t8", state=common_pb2.TRANSFER_STATE_ABORTED, error_code="ABORTED")
    ]
    (aborted,) = client.wait_transfers(["t8"], timeout_s=5)
    assert isinstance(aborted, errors.Aborted)
    assert daemon.router.requests["WatchTransfer"].transfer_id == "t8"


def test_health_check(client: KvdClient, daemon: FakeDaemon) -> None:
    assert client.health_check() is True
    assert client.health_check(service="kvd.v1.RouterService") is False
    daemon.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert client.health_check() is False
    with pytest.raises(errors.NotFound):
        client.health_check(service="no.such.Service")


def test_close_closes_an_owned_channel_only(daemon: FakeDaemon) -> None:
    kvd = KvdClient(daemon.tcp)
    kvd.close()
    with pytest.raises(ValueError):
        kvd.get_status()

    channel = grpc.insecure_channel(daemon.tcp)
    with KvdClient(channel=channel) as borrowed:
        assert borrowed.get_status().serving
    assert KvdClient(channel=channel).get_status().serving  # still open
    channel.close()


def test_bad_timeout_is_refused(client: KvdClient) -> None:
    with pytest.raises(ValueError, match="positive"):
        client.get_status(timeout_s=0)


def test_start_pulls_returns_each_pull_s_transfer_id_or_its_exact_error(client: KvdClient, daemon: FakeDaemon) -> None:
    """One bad item is returned as its error (the exact class the daemon named), never raised;
    a class name unknown to this client, or one of another code, falls back to the code's class."""
    remote = common_pb2.KvTransferParams(daemon_address="10.0.0.2:7070", lease_id="L")
    pulls = [
        router_pb2.StartPullRequest(engine_id="d0", request_id=r, local_block_ids=[1], remote=remote)
        for r in ("r1", "gone-r2", "odd-r3", "lying-r4")
    ]
    results = client.start_pulls(pulls)
    assert results[0] == "xfer-r1"
    assert [type(r) for r in results[1:]] == [errors.UnknownEngine, errors.Unavailable, errors.Unavailable]
    assert isinstance(results[1], errors.KvdError) and results[1].message == "no gone-r2"
    assert [p.request_id for p in daemon.router.requests["StartPulls"].pulls] == ["r1", "gone-r2", "odd-r3", "lying-r4"]
    assert client.start_pulls([]) == []
    with pytest.raises(errors.InvalidArgument, match="at most 4"):
        client.start_pulls(pulls + pulls)
