"""kvd.bench.runs: the batched section holds its leases a chunk at a time, ahead of the steps
that pull them, so a long run's later leases do not expire before their step."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from kvd.bench import runs


class _Session:
    """Records each hold and each step's leases (what the batched section asks of a Session)."""

    def __init__(self) -> None:
        self.holds: list[int] = []
        self.next_lease = 0
        self.stepped: list[list[int]] = []
        self.engine = types.SimpleNamespace(
            capacity_blocks=64,
            buffer=types.SimpleNamespace(zero_=lambda: None),
            pull_step=self._pull_step,
        )
        self.raw = types.SimpleNamespace(read_step=lambda batch, layout=False: [0.001] * batch)
        self.daemons = types.SimpleNamespace(cpu=dict, holder_cpu=lambda: 0.0)

    async def hold(self, size: int, count: int = 1) -> list[Any]:
        self.holds.append(count)
        first, self.next_lease = self.next_lease, self.next_lease + count
        return [types.SimpleNamespace(kv_transfer_params=i) for i in range(first, first + count)]

    async def _pull_step(self, held: list[int], first_block: int, mode: str) -> list[float]:
        self.stepped.append(list(held))
        return [0.001] * len(held)

    def verify(self, block: int, size: int) -> None:
        pass


def test_a_long_batched_run_holds_each_chunk_just_before_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs, "HOLD_AHEAD_PULLS", 64)
    monkeypatch.setattr(runs, "_cpu_since", lambda session, cpu0, client0: {"all": 0.0})
    monkeypatch.setattr(runs, "own_cpu_seconds", lambda: 0.0)
    session: Any = _Session()

    rows = asyncio.run(runs.batched(session, [32], 32 * 5, lambda *args: None))

    assert [row["mode"] for row in rows] == ["single", "batched", "stream"]
    # Five steps of 32 per mode, held 64 (two steps) at a time: 64, 64, 32 per mode.
    assert session.holds == [64, 64, 32] * 3
    # Every step pulls leases of its own, in order, none twice.
    pulled = [lease for step in session.stepped for lease in step]
    assert pulled == list(range(32 * 5 * 3))
    assert all(len(step) == 32 for step in session.stepped)
