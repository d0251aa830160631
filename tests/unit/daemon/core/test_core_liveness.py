"""The daemon's engine liveness watch: an engine process that exits without unregistering is
unregistered (through a pidfd at once; by polling every LIVENESS_S where there is no pidfd)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from kvtest import small_spec
from lifetime_fakes import Fabric, Node

import kvd.core.engines as engines_module
from kvd.core.memory import MemoryKind, RegionRequest
from kvd.core.registry import EngineRank
from kvd.layout.spec import contiguous_placements
from kvd_client.shm import create_shm_tensor


async def _register(fabric: Fabric, node: Node, engine_pid: int) -> EngineRank:
    spec = small_spec(8)
    name = f"kvdlv-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    fabric.shm_names.append(name)
    create_shm_tensor(name, spec.total_bytes)
    return await node.daemon.register_engine(
        "eng",
        spec,
        [RegionRequest(MemoryKind.SHM, spec.total_bytes, shm_name=name)],
        contiguous_placements(spec),
        engine_pid=engine_pid,
    )


async def _unregistered_within(node: Node, seconds: float) -> bool:
    deadline = asyncio.get_running_loop().time() + seconds
    while list(node.daemon.registry):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.mark.parametrize(
    ("pidfd", "reaped"), [(True, True), (True, False), (False, True)], ids=["pidfd", "pidfd-zombie", "polled"]
)
def test_an_engine_process_that_exits_is_unregistered(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch, pidfd: bool, reaped: bool
) -> None:
    """Killed (and reaped, or left a zombie by its parent): its rank leaves the registry, without
    any other event to wake the daemon. Polled, a zombie would still count as alive (kill(pid, 0)
    succeeds on it), so the polled path is checked with a reaped engine only."""
    monkeypatch.setattr(engines_module, "LIVENESS_S", 0.02)
    if not pidfd:
        monkeypatch.setattr(engines_module, "_open_pidfd", lambda _pid: None)

    async def main() -> None:
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            node = await fabric.start_node("10.0.0.9:1")
            await _register(fabric, node, engine.pid)
            await asyncio.sleep(0.1)
            assert [rank.engine_id for rank in node.daemon.registry] == ["eng"]  # alive: watched, kept
            engine.kill()
            if reaped:
                engine.wait()
            assert await _unregistered_within(node, 5.0)
        finally:
            engine.kill()
            engine.wait()
            await fabric.close()

    asyncio.run(main())
