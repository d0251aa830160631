"""Peers over their life: holders re-registering (same or another TP), dead peers, fds.

Real daemons, real NIXL. A reader's cached view of a holder must be refreshed, not believed,
and learning a holder's new memory must not cost a connection (the NIXL agent is kept and its
metadata reloaded, never removed and added again).
"""

from __future__ import annotations

import os

import pytest
from kvtest import ShmEngine, small_spec

from kvd_client import errors
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration


def _pull(reader: ShmEngine, holder: ShmEngine, request: str, held: list[int], local: list[int]) -> None:
    params = holder.client.hold_blocks(
        engine_id=holder.engine_id, request_id=request, block_ids=held, num_tokens=len(held) * 16
    ).kv_transfer_params
    started = reader.client.start_pull(
        engine_id=reader.engine_id, tp_rank=0, request_id=request, local_block_ids=local, remote=params
    )
    assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_holder_re_registered_with_another_tp_is_re_handshaken(spawn_daemon) -> None:
    """The reader's cached view says TP 1; the holder comes back as TP 2 under the same id: the
    next pull refreshes the view (no NOT_FOUND for a rank the cache invented) and gathers both ranks."""
    holder_daemon, reader_daemon = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    reader = ShmEngine(reader_daemon.unix_target, "d", small_spec())
    tp1 = ShmEngine(holder_daemon.unix_target, "p", small_spec())
    try:
        reader.register()
        tp1.register()
        tp1.fill_random(1)
        _pull(reader, tp1, "first", [0, 1], [2, 3])
        tp1.close()
        ranks = [
            ShmEngine(
                holder_daemon.unix_target, "p", small_spec(num_kv_heads=2, total_num_kv_heads=4, tp_rank=r, tp_size=2)
            )
            for r in range(2)
        ]
        try:
            for rank in ranks:
                rank.register()
                rank.fill_random(10 + rank.spec.tp_rank)
            params = (
                ranks[0]
                .client.hold_blocks(engine_id="p", request_id="second", block_ids=[4, 5], num_tokens=32)
                .kv_transfer_params
            )
            started = reader.client.start_pull(
                engine_id="d", tp_rank=0, request_id="second", local_block_ids=[6, 7], remote=params
            )
            done = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert done.state == common_pb2.TRANSFER_STATE_DONE
            # The TP-1 reader's heads 0-1 come from rank 0, heads 2-3 from rank 1 (NHD, fp16, 64 dims).
            got = reader.token_bytes([6, 7], 32).view(-1, 4, 128)
            for r, rank in enumerate(ranks):
                want = rank.token_bytes([4, 5], 32).view(-1, 2, 128)
                assert bool(got[:, 2 * r : 2 * r + 2].equal(want)), f"heads of rank {r} differ"
        finally:
            for rank in ranks:
                rank.close()
    finally:
        reader.close()


def test_re_handshakes_cost_no_connection(spawn_daemon) -> None:
    """Fifteen holder re-registrations, each followed by a pull (each a re-handshake): the fd
    counts of both daemons do not grow, and the reader keeps one agent for the holder."""
    holder_daemon, reader_daemon = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    reader = ShmEngine(reader_daemon.unix_target, "d", small_spec())
    reader.register()
    holder = ShmEngine(holder_daemon.unix_target, "p", small_spec())
    try:
        holder.register()
        _pull(reader, holder, "warm", [0], [0])
        before = _fds(holder_daemon.process.pid), _fds(reader_daemon.process.pid)
        for i in range(15):
            holder.close()
            holder = ShmEngine(holder_daemon.unix_target, "p", small_spec())
            holder.register()
            holder.fill_random(i)
            _pull(reader, holder, f"r{i}", [1, 2], [3, 4])
            assert bool(reader.token_bytes([3, 4], 32).equal(holder.token_bytes([1, 2], 32)))
        after = _fds(holder_daemon.process.pid), _fds(reader_daemon.process.pid)
        assert after[0] <= before[0] + 2 and after[1] <= before[1] + 2, f"fds grew: {before} -> {after}"
        status = reader.client.get_status()
        assert status.remote_agents == 1 and [p.address for p in status.peers] == [holder_daemon.tcp]
    finally:
        holder.close()
        reader.close()


def test_an_unreachable_peer_is_dropped(spawn_daemon) -> None:
    """A pull from a daemon that is gone fails UNAVAILABLE naming it, and the peer is not kept."""
    holder_daemon, reader_daemon = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    reader = ShmEngine(reader_daemon.unix_target, "d", small_spec())
    holder = ShmEngine(holder_daemon.unix_target, "p", small_spec())
    try:
        reader.register()
        holder.register()
        _pull(reader, holder, "ok", [0], [0])
        params = holder.client.hold_blocks(engine_id="p", request_id="gone", block_ids=[1], num_tokens=16)
        holder.registered = False
        holder_daemon.kill()
        started = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="gone", local_block_ids=[1], remote=params.kv_transfer_params
        )
        with pytest.raises(errors.Unavailable) as caught:
            reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert holder_daemon.tcp in caught.value.message
        status = reader.client.get_status()
        assert list(status.peers) == [] and status.remote_agents == 0, "a dead peer is still listed"
    finally:
        holder.close()
        reader.close()
