"""kvd.bench.runs: the batched, concurrency and router sections hold their leases a chunk at a
time, ahead of the steps or pulls that use them, so a long run's later leases do not expire
before their pull."""

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


class _PullSession(_Session):
    """Also records each pull's lease and the order of holds and pulls (the concurrency and
    router sections pull one lease at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.pulled: list[int] = []
        self.engine.pull = self._pull

    async def hold(self, size: int, count: int = 1) -> list[Any]:
        self.events.append(f"hold {count}")
        return await super().hold(size, count)

    async def _pull(self, params: int, block: int) -> float:
        self.events.append("pull")
        self.pulled.append(params)
        await asyncio.sleep(0)
        return 0.001


def test_a_long_concurrency_level_holds_each_chunk_just_before_its_pulls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs, "HOLD_AHEAD_PULLS", 64)
    monkeypatch.setattr(runs, "_cpu_since", lambda session, cpu0, client0: {"all": 0.5})
    monkeypatch.setattr(runs, "own_cpu_seconds", lambda: 0.0)
    session: Any = _PullSession()

    rows = asyncio.run(runs.concurrency(session, [4], 150, lambda *args: None))

    # 150 pulls held 64 at a time, each chunk held only once the one before was pulled.
    assert session.holds == [64, 64, 22]
    holds_at = [i for i, event in enumerate(session.events) if event.startswith("hold")]
    assert holds_at == [0, 65, 130]
    assert session.pulled == list(range(150))
    (row,) = rows
    assert row["pulls"] == 150 and len(row["latency_s"]) == 150
    assert row["cpu_s"] == {"all": 1.5}  # the three windows' CPU, summed


def test_the_router_section_holds_its_windows_leases_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs, "HOLD_AHEAD_PULLS", 64)
    monkeypatch.setattr(runs, "_cpu_since", lambda session, cpu0, client0: {"all": 0.0})
    monkeypatch.setattr(runs, "own_cpu_seconds", lambda: 0.0)
    session: Any = _PullSession()
    session.engine.engine_id = "engine"
    router: Any = types.SimpleNamespace()  # only the engine path runs below
    monkeypatch.setattr(runs, "ROUTER_MODES", ("engine",))

    rows = asyncio.run(runs.router_path(session, router, 4, 100, 1, lambda *args: None))

    # The untimed window (2 x 4 in flight), then the timed one's 100 held 64 at a time.
    assert session.holds == [8, 64, 36]
    (row,) = rows
    assert row["pulls"] == 100 and len(row["latency_s"]) == 100
