"""Bad input gets a precise status and a message naming what was wrong, and changes nothing."""

from __future__ import annotations

import time

import grpc
import pytest
from kvtest import ShmEngine, small_spec

from kvd.server import convert
from kvd_client import errors
from kvd_client.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture
def pair(spawn_daemon):
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    holder.register()
    reader.register()
    holder.fill_random(5)
    yield a, b, holder, reader
    holder.close()
    reader.close()


def _snapshot(engine: ShmEngine) -> tuple:
    status = engine.client.get_status()
    return (
        sorted((e.engine_id, e.tp_rank, e.registered_bytes) for e in status.engines),
        status.leases_held,
        status.transfers_in_flight,
    )


def _pull_error(reader: ShmEngine, params, local_blocks) -> errors.KvdError:
    started = reader.client.start_pull(
        engine_id="reader", tp_rank=0, request_id=params.request_id or "r", local_block_ids=local_blocks, remote=params
    )
    with pytest.raises(errors.KvdError) as caught:
        reader.client.wait_transfer(started.transfer_id, timeout_s=30)
    return caught.value


def test_unknown_engine_is_not_found_and_changes_nothing(pair) -> None:
    _, _, holder, _ = pair
    before = _snapshot(holder)
    with pytest.raises(errors.UnknownEngine, match="nosuch"):
        holder.client.hold_blocks(engine_id="nosuch", request_id="r", block_ids=[0], num_tokens=1)
    with pytest.raises(errors.NotFound, match="nosuch"):
        holder.client.unregister_kv_cache(engine_id="nosuch", tp_rank=0)
    assert _snapshot(holder) == before


def test_block_ids_out_of_range_are_invalid_argument(pair) -> None:
    _, _, holder, reader = pair
    before = _snapshot(holder)
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        holder.client.hold_blocks(engine_id="holder", request_id="r", block_ids=[0, 99], num_tokens=20)
    assert _snapshot(holder) == before
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[0, 1], num_tokens=20
    ).kv_transfer_params
    reader_before = _snapshot(reader)
    with pytest.raises(errors.InvalidArgument, match="out of range"):
        reader.client.start_pull(engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[3, 32], remote=params)
    assert _snapshot(reader) == reader_before


def test_lengths_that_disagree_are_invalid_argument(pair) -> None:
    _, _, holder, reader = pair
    with pytest.raises(errors.InvalidArgument, match="need 2 blocks"):
        holder.client.hold_blocks(engine_id="holder", request_id="r", block_ids=[0], num_tokens=20)
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[0, 1], num_tokens=20
    ).kv_transfer_params
    with pytest.raises(errors.InvalidArgument, match="need 2 local blocks"):
        reader.client.start_pull(engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[5], remote=params)
    # A forged token count larger than the lease is refused by the holder, naming the lease.
    params.num_tokens = 30
    err = _pull_error(reader, params, [5, 6])
    assert type(err) is errors.InvalidArgument and "holds 20" in err.message


def test_unknown_and_expired_leases(pair) -> None:
    _, _, holder, reader = pair
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[0], num_tokens=4, ttl_ms=300
    ).kv_transfer_params
    forged = common_pb2.KvTransferParams()
    forged.CopyFrom(params)
    forged.lease_id = "not-a-lease"
    err = _pull_error(reader, forged, [1])
    assert type(err) is errors.UnknownLease and "not-a-lease" in err.message
    time.sleep(0.6)
    err = _pull_error(reader, params, [1])
    # Expired: LeaseExpired until the sweeper removes it, UnknownLease after (each an exact class).
    assert type(err) in (errors.LeaseExpired, errors.UnknownLease), err
    assert params.lease_id in err.message or "expired" in err.message
    with pytest.raises((errors.LeaseExpired, errors.UnknownLease)):
        holder.client.renew_lease(params.lease_id)


def test_layout_the_daemon_cannot_serve_is_failed_precondition(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec(dtype="float16"))
    reader = ShmEngine(b.unix_target, "reader", small_spec(dtype="bfloat16"))
    try:
        holder.register()
        reader.register()
        params = holder.client.hold_blocks(
            engine_id="holder", request_id="r", block_ids=[0], num_tokens=8
        ).kv_transfer_params
        err = _pull_error(reader, params, [0])
        assert type(err) is errors.IncompatibleLayout
        assert "dtype: remote float16 vs local bfloat16" in err.message
    finally:
        holder.close()
        reader.close()


def test_memory_that_cannot_be_opened_is_refused(spawn_daemon) -> None:
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        before = _snapshot(engine)
        missing = common_pb2.MemoryRegion(
            kind=common_pb2.MEMORY_KIND_SHM, size_bytes=engine.spec.total_bytes, shm_name="kvd-no-such-region"
        )
        with pytest.raises(errors.MemoryOpenError, match="does not exist"):
            engine.register(regions=[missing])
        too_big = common_pb2.MemoryRegion(
            kind=common_pb2.MEMORY_KIND_SHM, size_bytes=engine.spec.total_bytes * 2, shm_name=engine.shm_name
        )
        with pytest.raises(errors.MemoryOpenError, match="has .* bytes, the registration claims"):
            engine.register(regions=[too_big])
        with pytest.raises(errors.InvalidArgument, match="plain file name"):
            engine.register(
                regions=[
                    common_pb2.MemoryRegion(
                        kind=common_pb2.MEMORY_KIND_SHM, size_bytes=engine.spec.total_bytes, shm_name="../etc/passwd"
                    )
                ]
            )
        assert _snapshot(engine) == before
        engine.registered = False
    finally:
        engine.close()


def test_invalid_layouts_and_placements_are_invalid_argument(spawn_daemon) -> None:
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        bad_layout = convert.layout_to_pb(engine.spec)
        bad_layout.num_kv_heads = 3  # total heads 4 over TP 1: disagrees
        with pytest.raises(errors.InvalidArgument, match="num_kv_heads 3"):
            engine.register(layout=bad_layout)
        bad_layout = convert.layout_to_pb(engine.spec)
        bad_layout.dtype = 0
        with pytest.raises(errors.InvalidArgument, match="layout.dtype"):
            engine.register(layout=bad_layout)
        layers = [convert.placement_to_pb(p) for p in engine.placements]
        layers[-1].k_offset = engine.spec.total_bytes
        with pytest.raises(errors.InvalidArgument, match="fall outside region"):
            engine.register(layers=layers)
        with pytest.raises(errors.InvalidArgument, match="one per layer"):
            engine.register(layers=layers[:2])
        assert not engine.client.get_status().engines
    finally:
        engine.close()


def test_second_registration_of_a_rank_is_already_exists(spawn_daemon) -> None:
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        engine.register()
        before = _snapshot(engine)
        with pytest.raises(errors.AlreadyExists, match="rank 0 is already registered"):
            engine.register()
        assert _snapshot(engine) == before
    finally:
        engine.close()


def test_unknown_transfer_and_unreachable_peer(pair, spawn_daemon) -> None:
    _, _, holder, reader = pair
    with pytest.raises(errors.UnknownTransfer):
        reader.client.get_transfer("nope")
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[0], num_tokens=4
    ).kv_transfer_params
    params.daemon_address = "127.0.0.1:1"  # nothing listens there
    err = _pull_error(reader, params, [1])
    assert type(err) is errors.PeerUnavailable and "127.0.0.1:1" in err.message


def test_a_soft_hold_without_a_scheduler_stream_is_refused_and_changes_nothing(pair) -> None:
    _, _, holder, _ = pair
    before = _snapshot(holder)
    with pytest.raises(errors.FailedPrecondition, match="no scheduler stream"):
        holder.client.hold_blocks(engine_id="holder", request_id="r", block_ids=[0, 1], num_tokens=20, soft=True)
    assert _snapshot(holder) == before


def test_a_scheduler_stream_must_say_hello_first(pair) -> None:
    a, _, holder, _ = pair
    with grpc.insecure_channel(a.unix_target) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        renew = engine_pb2.SchedulerMessage(renew=engine_pb2.RenewRemoteLeases())
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.SchedulerStream(iter([renew]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello" in caught.value.details()


def test_peer_lease_calls_on_unknown_leases_change_nothing(pair) -> None:
    a, _, holder, _ = pair
    held = holder.client.hold_blocks(engine_id="holder", request_id="r", block_ids=[0, 1], num_tokens=20)
    before = _snapshot(holder)
    with grpc.insecure_channel(a.tcp) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        renewed = stub.RenewLeases(peer_pb2.RenewLeasesRequest(lease_ids=["nosuch"]), timeout=10)
        assert list(renewed.unknown_lease_ids) == ["nosuch"]
        stub.ReleaseLeases(peer_pb2.ReleaseLeasesRequest(lease_ids=["nosuch"], reason="test"), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            stub.FinishRead(peer_pb2.FinishReadRequest(lease_id=held.lease.lease_id, reader_tp_rank=0), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "no read admitted" in caught.value.details()
    assert _snapshot(holder) == before
