"""Commit watermarks, lease expiry, engine death and SIGTERM, with real daemons."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from kvtest import ShmEngine, metric_value, scrape, small_spec

from kvd_client import KvdClient, errors
from kvd_client.shm import unlink_shm
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.integration, pytest.mark.spare_worker]  # the default daemon: a spare worker too


def _wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_pull_never_reads_past_the_commit_watermark(spawn_daemon) -> None:
    """Uncommitted (draft) tokens are never shipped: the pull waits for the commit, bounded."""
    a = spawn_daemon("--commit-wait-s", "1.0", name="a")
    b = spawn_daemon(name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec(), require_commits=True)
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    try:
        holder.register()
        reader.register()
        holder.fill_random(11)
        stream = holder.client.open_engine_stream("holder", 0)
        stream.send_commit("req", 16)  # only the first block is final
        params = holder.client.hold_blocks(
            engine_id="holder", request_id="req", block_ids=[4, 5], num_tokens=32
        ).kv_transfer_params

        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="req", local_block_ids=[0, 1], remote=params
        )
        with pytest.raises(errors.FailedPrecondition, match="only 16 of 32 tokens committed"):
            reader.client.wait_transfer(started.transfer_id, timeout_s=20)

        # A pull that arrives before the commit waits for it and then succeeds.
        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="req", local_block_ids=[0, 1], remote=params
        )
        time.sleep(0.3)
        assert reader.client.get_transfer(started.transfer_id).state == common_pb2.TRANSFER_STATE_PLANNED
        stream.send_commit("req", 32)
        status = reader.client.wait_transfer(started.transfer_id, timeout_s=20)
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert reader.token_bytes([0, 1], 32).equal(holder.token_bytes([4, 5], 32))
        stream.close()
    finally:
        holder.close()
        reader.close()


def test_expired_lease_tells_the_engine(spawn_daemon) -> None:
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        engine.register()
        stream = engine.client.open_engine_stream("e", 0)
        hold = engine.client.hold_blocks(engine_id="e", request_id="r", block_ids=[1], num_tokens=3, ttl_ms=200)
        renewed = engine.client.renew_lease(hold.lease.lease_id, ttl_ms=400)
        assert renewed.expires_unix_ms > hold.lease.expires_unix_ms
        messages: list = []
        _wait_for(lambda: messages.extend(stream.poll()) or bool(messages), what="finished_sending")
        done = messages[0].finished_sending
        assert done.request_id == "r" and done.lease_id == hold.lease.lease_id and done.expired
        assert metric_value(scrape(daemon.metrics), "kvd_leases_ended_total", reason="expired") == 1
        stream.close()
    finally:
        engine.close()


def test_release_lease_tells_the_engine_once(spawn_daemon) -> None:
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        engine.register()
        stream = engine.client.open_engine_stream("e", 0)
        hold = engine.client.hold_blocks(engine_id="e", request_id="r", block_ids=[1], num_tokens=3)
        assert [p.lease_id for p in engine.client.lookup_held(request_id="r").held] == [hold.lease.lease_id]
        engine.client.release_lease(hold.lease.lease_id)
        with pytest.raises(errors.UnknownLease):
            engine.client.release_lease(hold.lease.lease_id)
        messages: list = []
        _wait_for(lambda: messages.extend(stream.poll()) or bool(messages), what="finished_sending")
        time.sleep(0.2)
        messages.extend(stream.poll())
        assert len(messages) == 1 and not messages[0].finished_sending.expired
        stream.close()
    finally:
        engine.close()


ENGINE_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from kvtest import ShmEngine, small_spec
    engine = ShmEngine({target!r}, "doomed", small_spec())
    engine.register()
    engine.client.hold_blocks(engine_id="doomed", request_id="r", block_ids=[0], num_tokens=4)
    print("ready", engine.shm_name, flush=True)
    time.sleep(60)
    """
)


def test_engine_that_dies_is_released(spawn_daemon) -> None:
    daemon = spawn_daemon()
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT.format(tests=tests_dir, target=daemon.unix_target)],
        stdout=subprocess.PIPE,
    )
    shm_name = ""
    try:
        assert proc.stdout is not None
        ready, shm_name = proc.stdout.readline().decode().split()
        assert ready == "ready"
        with KvdClient(daemon.unix_target) as client:
            status = client.get_status()
            assert [e.engine_id for e in status.engines] == ["doomed"] and status.leases_held == 1
            proc.kill()
            proc.wait()
            _wait_for(lambda: not client.get_status().engines, what="the dead engine to be unregistered")
            assert client.get_status().leases_held == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        if shm_name:  # SIGKILLed: the engine could not unlink its own cache
            unlink_shm(shm_name)


def test_sigterm_releases_everything_and_exits_zero(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    try:
        holder.register()
        reader.register()
        stream = holder.client.open_engine_stream("holder", 0)
        hold = holder.client.hold_blocks(engine_id="holder", request_id="r", block_ids=[0, 1], num_tokens=20)
        health_before = holder.client.health_check()
        a.process.send_signal(signal.SIGTERM)
        assert a.process.wait(30) == 0
        assert health_before
        messages: list = []
        _wait_for(lambda: messages.extend(stream.poll()) or bool(messages) or stream.closed, what="stream end")
        released = [m for m in messages if m.WhichOneof("kind") == "finished_sending"]
        assert released and released[0].finished_sending.lease_id == hold.lease.lease_id
        assert not os.path.exists(a.unix_socket), "the Unix socket was left behind"
        # The reader's daemon fails a pull from the stopped holder cleanly, naming it.
        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[2, 3], remote=hold.kv_transfer_params
        )
        with pytest.raises(errors.Unavailable, match=a.tcp):
            reader.client.wait_transfer(started.transfer_id, timeout_s=30)
    finally:
        holder.registered = False
        holder.close()
        reader.close()


def test_concurrent_pulls_from_one_holder(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec(num_blocks=64))
    reader = ShmEngine(b.unix_target, "reader", small_spec(num_blocks=64))
    try:
        holder.register()
        reader.register()
        holder.fill_random(3)
        results: list = []

        def pull(i: int) -> None:
            params = holder.client.hold_blocks(
                engine_id="holder", request_id=f"r{i}", block_ids=[i * 2, i * 2 + 1], num_tokens=30
            ).kv_transfer_params
            started = reader.client.start_pull(
                engine_id="reader",
                tp_rank=0,
                request_id=f"r{i}",
                local_block_ids=[40 + i * 2, 41 + i * 2],
                remote=params,
            )
            results.append(reader.client.wait_transfer(started.transfer_id, timeout_s=30).state)

        threads = [threading.Thread(target=pull, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [common_pb2.TRANSFER_STATE_DONE] * 8
        for i in range(8):
            assert reader.token_bytes([40 + i * 2, 41 + i * 2], 30).equal(holder.token_bytes([i * 2, i * 2 + 1], 30))
        assert holder.client.get_status().leases_held == 0
    finally:
        holder.close()
        reader.close()


def test_a_new_engine_stream_supersedes_an_open_one(spawn_daemon) -> None:
    """An engine that reconnects is not refused: its new stream takes over, the old one ends."""
    daemon = spawn_daemon()
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        engine.register()
        old = engine.client.open_engine_stream("e", 0)
        time.sleep(0.3)
        new = engine.client.open_engine_stream("e", 0)
        _wait_for(lambda: old.closed, what="the superseded stream to end")
        hold = engine.client.hold_blocks(engine_id="e", request_id="r", block_ids=[1], num_tokens=3)
        engine.client.release_lease(hold.lease.lease_id)
        messages: list = []
        _wait_for(lambda: messages.extend(new.poll()) or bool(messages), what="finished_sending on the new stream")
        assert messages[0].finished_sending.lease_id == hold.lease.lease_id
        assert engine.client.get_status().engines[0].stream_connected
        new.close()
    finally:
        engine.close()
