"""The data-plane worker dies; the daemon does not.

``kvd serve`` is a control process and a data-plane worker (docs/architecture.md, "Processes").
These tests kill the worker from outside, as an abort or a segfault in UCX would, on the holder's
side and on the reader's, between pulls and mid-read, and check what the issue promises: the
control process lives, engines keep their registrations and streams, failed pulls end UNAVAILABLE
within their deadline, and the next pull is byte-exact without the engine doing anything.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from kvtest import ShmEngine, llama_spec, metric_value, scrape

from kvd_client import KvdClient, errors
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

RESTART_TIMEOUT_S = 20.0


def worker_pid(client: KvdClient) -> int:
    return int(client.get_status().dataplane_pid)


def wait_restarted(client: KvdClient, old_pid: int, timeout_s: float = RESTART_TIMEOUT_S) -> float:
    """Seconds until the daemon reports a new worker (and serves pulls again)."""
    started = time.monotonic()
    while True:
        status = client.get_status()
        if status.dataplane_pid not in (0, old_pid) and status.dataplane_restarts:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, "the data plane was not restarted"
        time.sleep(0.01)


def pull(reader: ShmEngine, holder: ShmEngine, request_id: str, blocks: list[int], deadline_ms: int = 20000):
    params = holder.client.hold_blocks(
        engine_id=holder.engine_id, request_id=request_id, block_ids=blocks, num_tokens=len(blocks) * 16
    )
    started = reader.client.start_pull(
        engine_id=reader.engine_id,
        tp_rank=0,
        request_id=request_id,
        local_block_ids=blocks,
        remote=params.kv_transfer_params,
        deadline_ms=deadline_ms,
    )
    return params, started


def pull_until_done(reader: ShmEngine, holder: ShmEngine, blocks: list[int], attempts: int = 5) -> int:
    """Pull (a router retries a pull that failed UNAVAILABLE); the attempts it took."""
    for attempt in range(1, attempts + 1):
        _, started = pull(reader, holder, f"again-{attempt}-{time.monotonic_ns()}", blocks)
        try:
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        except errors.Unavailable:
            continue
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes(blocks, len(blocks) * 16).equal(holder.token_bytes(blocks, len(blocks) * 16)))
        return attempt
    raise AssertionError(f"no pull succeeded in {attempts} attempts after the restart")


@pytest.mark.parametrize("side", ["holder", "reader"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_worker_killed_between_pulls_is_replaced_and_engines_keep_working(
    spawn_daemon, side: str, sig: signal.Signals
) -> None:
    holder_daemon = spawn_daemon(name="holder")
    reader_daemon = spawn_daemon(name="reader")
    holder = ShmEngine(holder_daemon.unix_target, "p", llama_spec(num_blocks=32))
    reader = ShmEngine(reader_daemon.unix_target, "d", llama_spec(num_blocks=32))
    try:
        holder.register()
        reader.register()
        holder.fill_random(7)
        blocks = list(range(8))
        assert pull_until_done(reader, holder, blocks) == 1
        victim = holder if side == "holder" else reader
        victim_daemon = holder_daemon if side == "holder" else reader_daemon
        old = worker_pid(victim.client)
        assert old and old != victim_daemon.process.pid
        os.kill(old, sig)
        took = wait_restarted(victim.client, old)
        assert victim_daemon.process.poll() is None, "the control process died with its worker"
        status = victim.client.get_status()
        assert status.dataplane_restarts == 1 and status.dataplane_last_restart == sig.name
        assert [e.engine_id for e in status.engines] == [victim.engine_id], "the engine lost its registration"
        text = scrape(victim_daemon.metrics)
        assert metric_value(text, "kvd_dataplane_restarts_total", reason=sig.name) == 1
        holder.fill_random(8)
        pull_until_done(reader, holder, blocks)
        print(f"restart seen after {took * 1000:.0f} ms")
    finally:
        holder.close()
        reader.close()
