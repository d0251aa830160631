"""An engine that unregisters while a pull is reading into it: once UnregisterKvCache has
answered, no byte of that pull lands in the engine's memory (the engine may reuse it at once),
over both UCX transports; the daemon serves on, and the engine registered again pulls exact
bytes into the same memory."""

from __future__ import annotations

import os
import time

import pytest
from kvtest import ShmEngine, llama_spec, wait_reading

from kvd_client import errors
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration

BLOCKS = list(range(64))  # 128 MiB of Llama-8B-shaped KV: a READ that lasts long enough to catch
SENTINEL = 0x5A


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_no_byte_lands_after_unregister_answers(spawn_daemon, transports: str) -> None:
    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    holder_daemon, reader_daemon = spawn_daemon(name="holder", env=env), spawn_daemon(name="reader", env=env)
    spec = llama_spec(num_blocks=len(BLOCKS))
    holder = ShmEngine(holder_daemon.unix_target, "p", spec)
    reader = ShmEngine(reader_daemon.unix_target, "d", spec)
    try:
        holder.register()
        holder.fill_random(7)
        reader.register()
        reader.fill(0)
        caught = 0
        for round_ in range(3):
            params = holder.client.hold_blocks(
                engine_id="p", request_id=f"r{round_}", block_ids=BLOCKS, num_tokens=len(BLOCKS) * spec.block_size
            )
            started = reader.client.start_pull(
                engine_id="d",
                tp_rank=0,
                request_id=f"r{round_}",
                local_block_ids=BLOCKS,
                remote=params.kv_transfer_params,
                deadline_ms=30000,
            )
            wait_reading(reader.client, started.transfer_id)
            reader.client.unregister_kv_cache(engine_id="d", tp_rank=0)
            reader.fill(SENTINEL)  # the engine reuses its memory the moment unregister answered
            try:
                state = reader.client.wait_transfer(started.transfer_id, timeout_s=30).state
            except (errors.Aborted, errors.Unavailable, errors.DeadlineExceeded, errors.NotFound):
                caught += 1
            else:
                assert state == common_pb2.TRANSFER_STATE_DONE  # it ended before the unregister
            time.sleep(0.2)
            landed = int((reader.buffer != SENTINEL).sum())
            assert landed == 0, f"round {round_}: {landed} bytes landed after UnregisterKvCache answered"
            with_lease = holder.client.get_status()
            assert with_lease.serving
            reader.register()  # the same memory, registered again: the daemon serves on
            reader.fill(0)
        assert caught, "no round caught a pull mid-read: the test proves nothing"
        params = holder.client.hold_blocks(engine_id="p", request_id="last", block_ids=[0, 1], num_tokens=32)
        again = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="last", local_block_ids=[5, 6], remote=params.kv_transfer_params
        )
        assert reader.client.wait_transfer(again.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes([5, 6], 32).equal(holder.token_bytes([0, 1], 32)))
    finally:
        reader.close()
        holder.close()
