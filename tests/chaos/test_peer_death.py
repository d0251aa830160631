"""Chaos: a holder daemon is killed (SIGKILL) or frozen (SIGSTOP) in the middle of pulls."""

from __future__ import annotations

import signal
import time

import pytest
from kvtest import ShmEngine, llama_spec, metric_value, scrape, small_spec

from kvd.spawn import child_env
from kvd_client import errors
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.chaos

# TCP only, so that a transfer takes long enough to be interrupted and a dead peer cannot be
# reached through shared memory.
SLOW = child_env(UCX_TLS="tcp")


def _poll_until(stream, kind: str, timeout_s: float = 15.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not got:
        got = [m for m in stream.poll() if m.WhichOneof("kind") == kind]
        time.sleep(0.01)
    return got


def test_holder_killed_mid_transfer_fails_the_pull_and_a_restart_is_rehandshaken(spawn_daemon) -> None:
    holder_daemon = spawn_daemon(name="holder", env=SLOW)
    bystander_daemon = spawn_daemon(name="bystander", env=SLOW)
    reader_daemon = spawn_daemon(name="reader", env=SLOW)
    spec = llama_spec(num_blocks=256)  # 512 MiB: long enough over TCP to be cut
    holder = ShmEngine(holder_daemon.unix_target, "p", spec)
    bystander = ShmEngine(bystander_daemon.unix_target, "q", small_spec())
    reader = ShmEngine(reader_daemon.unix_target, "d", spec)
    small_reader = ShmEngine(reader_daemon.unix_target, "d2", small_spec())
    try:
        for engine in (holder, bystander, reader, small_reader):
            engine.register()
        holder.fill_random(1)
        bystander.fill_random(2)
        reader.fill(0x5A)
        stream = reader.client.open_engine_stream("d", 0)
        params = holder.client.hold_blocks(
            engine_id="p", request_id="big", block_ids=list(range(256)), num_tokens=256 * 16
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="d",
            tp_rank=0,
            request_id="big",
            local_block_ids=list(range(256)),
            remote=params,
            deadline_ms=20000,
        )
        deadline = time.monotonic() + 10
        while reader.client.get_transfer(started.transfer_id).state != common_pb2.TRANSFER_STATE_READING:
            assert time.monotonic() < deadline, "the pull never started reading"
            time.sleep(0.002)
        holder_daemon.kill()
        t0 = time.monotonic()
        with pytest.raises((errors.Unavailable, errors.Aborted, errors.DeadlineExceeded)) as caught:
            reader.client.wait_transfer(started.transfer_id, timeout_s=60)
        assert time.monotonic() - t0 < 25, "the failure was not reported within the transfer deadline"
        assert holder_daemon.tcp in caught.value.message, caught.value.message
        failed = _poll_until(stream, "load_failed")
        assert failed and failed[0].load_failed.request_id == "big"
        assert list(failed[0].load_failed.block_ids) == list(range(256)), "blocks to recompute were not named"
        assert not _poll_until(stream, "finished_recving", timeout_s=0.5), "a failed load was reported loaded"

        # Other transfers go on: a pull from another holder succeeds on the same reader daemon.
        other = bystander.client.hold_blocks(
            engine_id="q", request_id="ok", block_ids=[3], num_tokens=10
        ).kv_transfer_params
        ok = small_reader.client.start_pull(
            engine_id="d2", tp_rank=0, request_id="ok", local_block_ids=[7], remote=other
        )
        assert small_reader.client.wait_transfer(ok.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert small_reader.token_bytes([7], 10).equal(bystander.token_bytes([3], 10))
        assert metric_value(scrape(reader_daemon.metrics), "kvd_peer_drops_total") >= 1

        # The holder comes back on the same address as a new incarnation: the next pull re-handshakes.
        port = holder_daemon.tcp.rsplit(":", 1)[1]
        revived = spawn_daemon("--port", port, name="holder2", env=SLOW)
        assert revived.incarnation != holder_daemon.incarnation
        holder.client.close()
        holder2 = ShmEngine(revived.unix_target, "p", small_spec())
        try:
            holder2.register()
            holder2.fill_random(9)
            again = holder2.client.hold_blocks(
                engine_id="p", request_id="again", block_ids=[0, 1], num_tokens=20
            ).kv_transfer_params
            pulled = small_reader.client.start_pull(
                engine_id="d2", tp_rank=0, request_id="again", local_block_ids=[0, 1], remote=again
            )
            assert (
                small_reader.client.wait_transfer(pulled.transfer_id, timeout_s=30).state
                == common_pb2.TRANSFER_STATE_DONE
            )
            assert small_reader.token_bytes([0, 1], 20).equal(holder2.token_bytes([0, 1], 20))
            # The stale lease from the dead incarnation is refused, naming the restart.
            stale = small_reader.client.start_pull(
                engine_id="d2", tp_rank=0, request_id="big", local_block_ids=[2], remote=_shrunk(params)
            )
            with pytest.raises(errors.FailedPrecondition, match="restarted"):
                small_reader.client.wait_transfer(stale.transfer_id, timeout_s=30)
        finally:
            holder2.close()
        stream.close()
    finally:
        holder.registered = False
        for engine in (holder, bystander, reader, small_reader):
            engine.close()


def _shrunk(params: common_pb2.KvTransferParams) -> common_pb2.KvTransferParams:
    out = common_pb2.KvTransferParams()
    out.CopyFrom(params)
    del out.block_ids[1:]
    out.num_tokens = 8
    return out


def test_frozen_holder_hits_the_deadline(spawn_daemon) -> None:
    """SIGSTOP: the peer neither answers nor disconnects; the pull ends at its deadline."""
    holder_daemon = spawn_daemon(name="holder")
    reader_daemon = spawn_daemon(name="reader")
    holder = ShmEngine(holder_daemon.unix_target, "p", small_spec())
    reader = ShmEngine(reader_daemon.unix_target, "d", small_spec())
    try:
        holder.register()
        reader.register()
        params = holder.client.hold_blocks(
            engine_id="p", request_id="r", block_ids=[0], num_tokens=8
        ).kv_transfer_params
        holder_daemon.process.send_signal(signal.SIGSTOP)
        try:
            started = reader.client.start_pull(
                engine_id="d", tp_rank=0, request_id="r", local_block_ids=[1], remote=params, deadline_ms=1500
            )
            t0 = time.monotonic()
            with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)) as caught:
                reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert time.monotonic() - t0 < 10
            assert holder_daemon.tcp in caught.value.message
        finally:
            holder_daemon.process.send_signal(signal.SIGCONT)
    finally:
        holder.close()
        reader.close()
