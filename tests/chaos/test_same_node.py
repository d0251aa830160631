"""Chaos with both engines on one node: one daemon holds the KV and pulls it (kvd.core.loopback).

The engine being read from, or the one being written into, is a process of its own and is
SIGKILLed while a 512 MiB pull between them reads (UCX_TLS=tcp and UCX's default transports,
alternating by round; either way NIXL copies within the daemon's own agent, and the daemon maps
both engines' memory itself, so the read may finish before the daemon sees the death). The daemon
survives, the pull ends DONE with exact bytes or fails with nothing landing late, nothing stays
admitted or in flight, and the daemon goes on serving pulls between its engines.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kvtest import ShmEngine, drain, gauges_settle, llama_spec, wait_reading

from kvd.spawn import child_env
from kvd_client import KvdClient, errors
from kvd_client.shm import unlink_shm
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

BLOCKS = list(range(256))
TOKENS = 256 * 16
SEED = 11
PATTERN = 0x5A
SETTLED = ("kvd_transfers_in_flight", "kvd_nixl_reads_in_flight", "kvd_admitted_reads")

# An engine in its own process (llama-shaped, one rank), so it can be SIGKILLed: it registers,
# fills its cache from SEED, prints its shm name and waits.
_ENGINE = rf"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from kvtest import ShmEngine, llama_spec
engine = ShmEngine(sys.argv[1], sys.argv[2], llama_spec(num_blocks=256))
engine.register()
engine.fill_random({SEED})
print(engine.shm_name, flush=True)
while True:
    time.sleep(3600)
"""


def _ucx_env(chaos_round: int) -> dict[str, str]:
    """UCX_TLS=tcp on odd rounds, UCX's default transports on even ones (the CPU-loaded round
    among them). One daemon copies within its own agent either way, so the rounds alternate
    rather than each running twice."""
    return child_env(UCX_TLS="tcp") if chaos_round % 2 else child_env()


def _engine_process(target: str, engine_id: str) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, target, engine_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    shm_name = process.stdout.readline().decode().strip()
    if not shm_name.startswith("kvdtest-"):
        process.kill()
        raise AssertionError(process.stderr.read().decode() if process.stderr else "the engine did not start")
    return process, shm_name


def _pull_then_kill(client: KvdClient, reader_id: str, params: object, victim: subprocess.Popen[bytes]) -> bool:
    """Pull every block of the lease into ``reader_id``, SIGKILL ``victim`` once the pull reads;
    True if the pull ended DONE, False if it failed with an error naming the death."""
    started = client.start_pull(
        engine_id=reader_id,
        tp_rank=0,
        request_id="r",
        local_block_ids=BLOCKS,
        remote=params,  # type: ignore[arg-type]
        deadline_ms=20000,
    )
    wait_reading(client, started.transfer_id)
    victim.kill()
    victim.wait()
    try:
        status = client.wait_transfer(started.transfer_id, timeout_s=30)
    except (errors.Aborted, errors.Unavailable, errors.DeadlineExceeded, errors.PeerUnavailable):
        return False
    assert status.state == common_pb2.TRANSFER_STATE_DONE
    return True


def _expected_tokens() -> torch.Tensor:
    """The token bytes of BLOCKS in an engine filled from SEED (computed in a scratch engine)."""
    scratch = ShmEngine("unix:///nowhere", "scratch", llama_spec(num_blocks=256))
    try:
        scratch.fill_random(SEED)
        return scratch.token_bytes(BLOCKS, TOKENS).clone()
    finally:
        scratch.close()


def _still_serves(daemon, reader: ShmEngine, reader_id: str) -> None:  # type: ignore[no-untyped-def]
    """A new holder engine on the same daemon: a pull into ``reader`` arrives byte-exact."""
    holder = ShmEngine(daemon.unix_target, "p-again", llama_spec(num_blocks=256))
    try:
        holder.register()
        holder.fill_random(SEED + 1)
        params = holder.client.hold_blocks(engine_id="p-again", request_id="again", block_ids=[0, 1], num_tokens=32)
        started = reader.client.start_pull(
            engine_id=reader_id, tp_rank=0, request_id="again", local_block_ids=[7, 8], remote=params.kv_transfer_params
        )
        status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes([7, 8], 32).equal(holder.token_bytes([0, 1], 32)))
    finally:
        holder.close()


def test_reader_engine_killed_mid_read_on_one_daemon(spawn_daemon, chaos_round: int) -> None:
    """The engine being pulled into dies mid-read; its holder neighbour and the daemon live on."""
    daemon = spawn_daemon(name="node", env=_ucx_env(chaos_round))
    holder = ShmEngine(daemon.unix_target, "p", llama_spec(num_blocks=256))
    engine, shm_name = None, ""
    client = KvdClient(daemon.unix_target, timeout_s=30)
    try:
        engine, shm_name = _engine_process(daemon.unix_target, "d")
        holder.register()
        holder.fill_random(3)
        stream = holder.client.open_engine_stream("p", 0)
        params = holder.client.hold_blocks(engine_id="p", request_id="r", block_ids=BLOCKS, num_tokens=TOKENS)
        _pull_then_kill(client, "d", params.kv_transfer_params, engine)
        assert daemon.process.poll() is None, "the daemon died with an engine"
        assert not gauges_settle(daemon.metrics, SETTLED), "a pull or read is still counted"
        assert not gauges_settle(daemon.metrics, ("kvd_quarantined_bytes",)), (
            "the dead reader's memory stays quarantined"
        )
        with contextlib.suppress(errors.UnknownLease):
            holder.client.release_lease(lease_id=params.lease.lease_id)
        ended = [m for m in drain(stream, 10.0) if m.WhichOneof("kind") == "finished_sending"]
        assert len(ended) == 1, "the holder engine was not told its lease ended"
        stream.close()
        again = ShmEngine(daemon.unix_target, "d2", llama_spec(num_blocks=256))
        try:
            again.register()
            _still_serves(daemon, again, "d2")
        finally:
            again.close()
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        holder.close()
        client.close()
        if shm_name:
            unlink_shm(shm_name)


def test_holder_engine_killed_mid_read_on_one_daemon(spawn_daemon, chaos_round: int) -> None:
    """The engine being read from dies mid-read: the pull is DONE with exact bytes or fails with
    nothing landing after it is reported; the reader engine and the daemon live on."""
    daemon = spawn_daemon(name="node", env=_ucx_env(chaos_round))
    expected = _expected_tokens()
    reader = ShmEngine(daemon.unix_target, "d", llama_spec(num_blocks=256))
    engine, shm_name = None, ""
    try:
        engine, shm_name = _engine_process(daemon.unix_target, "p")
        reader.register()
        reader.fill(PATTERN)
        params = reader.client.hold_blocks(engine_id="p", request_id="r", block_ids=BLOCKS, num_tokens=TOKENS)
        if _pull_then_kill(reader.client, "d", params.kv_transfer_params, engine):
            assert bool(reader.token_bytes(BLOCKS, TOKENS).equal(expected)), "a DONE pull's bytes differ"
        else:
            # Failed: reported only once no byte of it can land. The blocks get a pattern and,
            # well past when a stray read would have ended, are intact.
            reader.fill(PATTERN)
            time.sleep(1.5)
            assert bool((reader.buffer == PATTERN).all()), "a byte of the failed pull landed after it was reported"
        assert daemon.process.poll() is None, "the daemon died with an engine"
        assert not gauges_settle(daemon.metrics, SETTLED), "a pull or read is still counted"
        deadline = time.monotonic() + 10  # the daemon checks its engines' pids every 250 ms
        while [e.engine_id for e in reader.client.get_status().engines] != ["d"]:
            assert time.monotonic() < deadline, "the dead holder engine is still registered"
            time.sleep(0.05)
        _still_serves(daemon, reader, "d")
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        reader.close()
        if shm_name:
            unlink_shm(shm_name)


def test_data_plane_worker_killed_mid_read_on_one_daemon(spawn_daemon, chaos_round: int) -> None:
    """The daemon's data-plane worker (one NIXL agent for the holder and the reader side) is
    SIGKILLed with four pulls between two of its engines reading: each ends DONE with exact bytes
    or fails UNAVAILABLE with nothing landing after it is reported; the daemon replaces the worker
    once, both engines keep their registrations, and the next pull between them is exact."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    daemon = spawn_daemon(name="node", env=_ucx_env(chaos_round))
    holder = ShmEngine(daemon.unix_target, "p", llama_spec(num_blocks=256))
    reader = ShmEngine(daemon.unix_target, "d", llama_spec(num_blocks=256))
    try:
        holder.register()
        reader.register()
        holder.fill_random(SEED)
        reader.fill(PATTERN)
        status = reader.client.get_status()
        old_pid, restarts = int(status.dataplane_pid), status.dataplane_restarts
        pulls = []
        for i in range(4):
            blocks = BLOCKS[i * 64 : (i + 1) * 64]
            params = holder.client.hold_blocks(engine_id="p", request_id=f"r{i}", block_ids=blocks, num_tokens=64 * 16)
            started = reader.client.start_pull(
                engine_id="d",
                tp_rank=0,
                request_id=f"r{i}",
                local_block_ids=blocks,
                remote=params.kv_transfer_params,
                deadline_ms=20000,
            )
            pulls.append((blocks, started.transfer_id))
        deadline = time.monotonic() + 10
        while all(reader.client.get_transfer(t).state == common_pb2.TRANSFER_STATE_PLANNED for _, t in pulls):
            assert time.monotonic() < deadline, "no pull started reading"
            time.sleep(0.001)
        import os

        os.kill(old_pid, signal.SIGKILL)

        def outcome(transfer_id: str) -> str:
            try:
                return common_pb2.TransferState.Name(reader.client.wait_transfer(transfer_id, timeout_s=30).state)
            except errors.Unavailable:
                return "UNAVAILABLE"

        with ThreadPoolExecutor(len(pulls)) as pool:
            outcomes = list(pool.map(outcome, [t for _, t in pulls]))
        assert set(outcomes) <= {"TRANSFER_STATE_DONE", "UNAVAILABLE"}, outcomes
        failed = [blocks for (blocks, _), got in zip(pulls, outcomes, strict=True) if got == "UNAVAILABLE"]
        for (blocks, _), got in zip(pulls, outcomes, strict=True):
            if got == "TRANSFER_STATE_DONE":
                assert bool(reader.token_bytes(blocks, 64 * 16).equal(holder.token_bytes(blocks, 64 * 16)))
        # Nothing lands after the pulls were reported: the whole cache gets a pattern and, well
        # past when a stray read would have ended, is intact.
        reader.fill(PATTERN)
        time.sleep(1.0)
        assert bool((reader.buffer == PATTERN).all()), f"a byte landed after the pulls ended ({len(failed)} failed)"
        deadline = time.monotonic() + 30
        while True:
            status = reader.client.get_status()
            if status.dataplane_pid not in (0, old_pid) and status.dataplane_restarts >= restarts + 1:
                break
            assert time.monotonic() < deadline, "the data plane was not restarted"
            time.sleep(0.01)
        assert status.dataplane_restarts == restarts + 1
        assert sorted(e.engine_id for e in status.engines) == ["d", "p"], "an engine lost its registration"
        assert daemon.process.poll() is None
        assert not gauges_settle(daemon.metrics, SETTLED), "a pull or read is still counted"
        params = holder.client.hold_blocks(engine_id="p", request_id="after", block_ids=[3, 4], num_tokens=32)
        started = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="after", local_block_ids=[200, 201], remote=params.kv_transfer_params
        )
        assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes([200, 201], 32).equal(holder.token_bytes([3, 4], 32)))
    finally:
        holder.close()
        reader.close()
