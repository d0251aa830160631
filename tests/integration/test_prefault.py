"""Real daemons pre-fault their workers' mappings of engine memory (kvd.worker.prefault), while
pulls read and write it, and let go of a mapping whose engine leaves mid-way."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvtest import ShmEngine, llama_spec

from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration

BLOCKS = 96  # Llama-shaped blocks of 2 MiB: 192 MiB per engine, long enough to populate that pulls overlap it
WAIT_S = 60.0


def _mapped_kb(daemon_pid: int, shm_name: str) -> int | None:
    """Rss in KiB of the daemon's mapping of ``/dev/shm/<shm_name>``, in whichever of its processes
    maps it (its data-plane worker); None where none does. Rss counts the pages the mapping's page
    tables map: a fresh mapping of resident shared memory has none until it is touched."""
    pids = [daemon_pid]
    for task in Path(f"/proc/{daemon_pid}/task").iterdir():
        pids += [int(pid) for pid in (task / "children").read_text().split()]
    for pid in pids:
        try:
            smaps = Path(f"/proc/{pid}/smaps").read_text()
        except OSError:
            continue
        inside = False
        for line in smaps.splitlines():
            if "-" in line.split(" ", 1)[0] and ":" not in line.split(" ", 1)[0]:
                inside = line.endswith(f"/dev/shm/{shm_name}")
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    return None


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _pull(holder: ShmEngine, reader: ShmEngine, request: str, held: list[int], local: list[int]) -> None:
    tokens = 16 * len(held)
    params = holder.client.hold_blocks(
        engine_id=holder.engine_id, request_id=request, block_ids=held, num_tokens=tokens
    ).kv_transfer_params
    started = reader.client.start_pull(
        engine_id=reader.engine_id, tp_rank=0, request_id=request, local_block_ids=local, remote=params
    )
    status = reader.client.wait_transfer(started.transfer_id, timeout_s=60)
    assert status.state == common_pb2.TRANSFER_STATE_DONE
    assert reader.token_bytes(local, tokens).equal(holder.token_bytes(held, tokens)), request


@pytest.mark.parametrize("transport", ["default", "tcp"])
def test_engine_memory_is_prefaulted_while_pulls_move_exact_bytes_and_a_leaving_engine_is_let_go(
    spawn_daemon, transport: str
) -> None:
    env = {"UCX_TLS": "tcp"} if transport == "tcp" else None
    a, b = spawn_daemon(name="a", env=env), spawn_daemon(name="b", env=env)
    spec = llama_spec(num_blocks=BLOCKS)
    full_kb = spec.total_bytes // 1024
    holder, reader = ShmEngine(a.unix_target, "p", spec), ShmEngine(b.unix_target, "d", spec)
    leaving = ShmEngine(b.unix_target, "gone", spec)
    try:
        holder.fill_random(seed=11)
        reader.fill(0)
        holder.register()
        reader.register()
        # Pulls right away, while both workers may still be populating the two mappings.
        for i in range(4):
            _pull(holder, reader, f"early-{i}", [i * 8 + j for j in range(8)], [90 - i * 8 - j for j in range(8)])
        _wait_for(lambda: _mapped_kb(a.process.pid, holder.shm_name) == full_kb, "the holder's mapping stayed cold")
        _wait_for(lambda: _mapped_kb(b.process.pid, reader.shm_name) == full_kb, "the reader's mapping stayed cold")

        # An engine that registers and leaves at once: its mapping is let go, populated or not.
        leaving.register()
        leaving.client.unregister_kv_cache(engine_id="gone", tp_rank=0)
        leaving.registered = False
        _wait_for(lambda: _mapped_kb(b.process.pid, leaving.shm_name) is None, "the left engine stayed mapped")

        _pull(holder, reader, "after", list(range(40, 56)), list(range(16)))
    finally:
        leaving.close()
        holder.close()
        reader.close()


def test_with_prefault_off_a_registered_mapping_stays_as_the_kernel_made_it(spawn_daemon) -> None:
    a = spawn_daemon(name="a", env={"KVD_PREFAULT_HOST_MEMORY": "false"})
    engine = ShmEngine(a.unix_target, "e", llama_spec(num_blocks=16))
    try:
        engine.fill(7)
        engine.register()
        time.sleep(0.5)
        assert _mapped_kb(a.process.pid, engine.shm_name) == 0
    finally:
        engine.close()
