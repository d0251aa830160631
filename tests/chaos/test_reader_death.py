"""Chaos on the reading side: the engine being pulled into dies, or the pulling daemon does.

Over UCX TCP so that a 512 MiB pull is slow enough to be interrupted mid-read.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest import ShmEngine, drain, eventually, gauges_settle, llama_spec, metric_value, scrape, wait_reading

from kvd.spawn import child_env
from kvd_client import KvdClient, errors
from kvd_client.shm import unlink_shm
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

SLOW = child_env(UCX_TLS="tcp")
ENGINE_PROC = Path(__file__).resolve().parents[1] / "stress" / "engine_proc.py"
BLOCKS = list(range(256))


def test_reader_engine_killed_mid_read(spawn_daemon, ucx_env: dict[str, str]) -> None:
    """The engine process being pulled into is SIGKILLed: the reader daemon survives, the pull
    ends aborted, the holder's lease is freed once the read is over, nothing stays pinned.

    Over UCX's default transports a 512 MiB read may end before the daemon notices the death
    (it checks every 250 ms): then the pull is DONE, and everything else must hold the same."""
    holder_daemon = spawn_daemon(name="holder", env=ucx_env)
    reader_daemon = spawn_daemon(name="reader", env=ucx_env)
    tcp = ucx_env.get("UCX_TLS") == "tcp"
    holder = ShmEngine(holder_daemon.unix_target, "p", llama_spec(num_blocks=256))
    # The reader engine is its own process (llama-shaped, one rank), so it can be SIGKILLed.
    engine = subprocess.Popen(
        [sys.executable, "-c", _READER_ENGINE, reader_daemon.unix_target],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    client = KvdClient(reader_daemon.unix_target, timeout_s=30)
    shm_name = ""
    try:
        assert engine.stdout is not None
        shm_name = engine.stdout.readline().decode().strip()
        assert shm_name.startswith("kvdtest-"), engine.stderr.read() if engine.stderr else ""
        holder.register()
        holder.fill_random(3)
        stream = holder.client.open_engine_stream("p", 0)
        params = holder.client.hold_blocks(engine_id="p", request_id="r", block_ids=BLOCKS, num_tokens=256 * 16)
        started = client.start_pull(
            engine_id="d",
            tp_rank=0,
            request_id="r",
            local_block_ids=BLOCKS,
            remote=params.kv_transfer_params,
            deadline_ms=20000,
        )
        wait_reading(client, started.transfer_id)
        engine.kill()
        engine.wait()
        try:
            status = client.wait_transfer(started.transfer_id, timeout_s=30)
        except (errors.Aborted, errors.Unavailable, errors.DeadlineExceeded):
            pass
        else:
            assert not tcp, "over TCP the 512 MiB read cannot have finished before the engine's death was seen"
            assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert reader_daemon.process.poll() is None, "the reader daemon died with its engine"
        left = gauges_settle(
            reader_daemon.metrics,
            ("kvd_transfers_in_flight", "kvd_nixl_reads_in_flight", "kvd_engines_registered", "kvd_quarantined_bytes"),
        )
        assert not left, f"the reader daemon kept {left}"
        # The holder: the aborted read was abandoned once fenced (the lease is still held) or it
        # had completed (the lease ended as read); either way nothing is admitted any more.
        assert not gauges_settle(holder_daemon.metrics, ("kvd_admitted_reads",)), (
            "the holder still counts the dead read"
        )
        with contextlib.suppress(errors.UnknownLease):
            holder.client.release_lease(lease_id=params.lease.lease_id)
        ended = [m for m in drain(stream, 5.0) if m.WhichOneof("kind") == "finished_sending"]
        assert len(ended) == 1, "the holder engine was not told exactly once"
        # The reader daemon still serves: a new engine under the same id pulls fine.
        again = ShmEngine(reader_daemon.unix_target, "d", llama_spec(num_blocks=256))
        try:
            again.register()
            p2 = holder.client.hold_blocks(engine_id="p", request_id="r2", block_ids=[0, 1], num_tokens=32)
            t = again.client.start_pull(
                engine_id="d", tp_rank=0, request_id="r2", local_block_ids=[9, 10], remote=p2.kv_transfer_params
            )
            assert again.client.wait_transfer(t.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
            assert bool(again.token_bytes([9, 10], 32).equal(holder.token_bytes([0, 1], 32)))
        finally:
            again.close()
        stream.close()
    finally:
        if engine.poll() is None:
            engine.kill()
        holder.close()
        client.close()
        if shm_name:
            unlink_shm(shm_name)


def test_puller_daemon_killed_mid_read(spawn_daemon) -> None:
    """The reading daemon is SIGKILLed mid-read: the holder's lease drains and ends, its engine is
    told once, and nothing stays pinned for the dead peer (its memory is retired, not unmapped
    under a read that may still be in flight)."""
    holder_daemon = spawn_daemon("--read-admission-margin-s", "1", name="holder", env=SLOW)
    reader_daemon = spawn_daemon(name="reader", env=SLOW)
    holder = ShmEngine(holder_daemon.unix_target, "p", llama_spec(num_blocks=256))
    reader = ShmEngine(reader_daemon.unix_target, "d", llama_spec(num_blocks=256))
    try:
        holder.register()
        reader.register()
        holder.fill_random(4)
        stream = holder.client.open_engine_stream("p", 0)
        params = holder.client.hold_blocks(engine_id="p", request_id="r", block_ids=BLOCKS, num_tokens=256 * 16)
        started = reader.client.start_pull(
            engine_id="d",
            tp_rank=0,
            request_id="r",
            local_block_ids=BLOCKS,
            remote=params.kv_transfer_params,
            deadline_ms=4000,
        )
        wait_reading(reader.client, started.transfer_id)
        # A READ is posted beside its admission (docs/lifetimes.md), so READING may come before
        # the holder admitted it: the death this test is about comes once both are under way.
        admitted = eventually(lambda: metric_value(scrape(holder_daemon.metrics), "kvd_admitted_reads"), 1.0)
        assert admitted == 1, "the holder never admitted the read"
        reader_daemon.kill()
        reader.registered = False
        text = scrape(holder_daemon.metrics)
        assert metric_value(text, "kvd_admitted_reads") == 1
        holder.client.release_lease(lease_id=params.lease.lease_id)
        assert metric_value(scrape(holder_daemon.metrics), "kvd_leases_draining") == 1, (
            "a released lease under read must drain"
        )
        assert not [m for m in stream.poll() if m.WhichOneof("kind") == "finished_sending"], (
            "told before the read was over"
        )
        # The read was admitted for the pull's deadline (4 s) + margin (1 s): then the lease ends and
        # the engine is told, once.
        ended = [m for m in drain(stream, 10.0) if m.WhichOneof("kind") == "finished_sending"]
        assert len(ended) == 1 and ended[0].finished_sending.lease_id == params.lease.lease_id
        assert not gauges_settle(
            holder_daemon.metrics, ("kvd_admitted_reads", "kvd_leases_draining", "kvd_leases_held")
        )
        # Unregistering the engine now retires its mapping (the dead reader's READ was never
        # proven over): the daemon survives and keeps serving.
        holder.client.unregister_kv_cache(engine_id="p", tp_rank=0)
        holder.registered = False
        assert metric_value(scrape(holder_daemon.metrics), "kvd_quarantined_bytes") == holder.spec.total_bytes
        assert holder_daemon.process.poll() is None
        stream.close()
    finally:
        holder.close()
        reader.close()


_READER_ENGINE = rf"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from kvtest import ShmEngine, llama_spec
engine = ShmEngine(sys.argv[1], "d", llama_spec(num_blocks=256))
engine.register()
print(engine.shm_name, flush=True)
while True:
    time.sleep(3600)
"""
