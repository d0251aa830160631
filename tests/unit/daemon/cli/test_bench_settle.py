"""kvd bench measures settled daemons: it waits until every daemon's process tree is quiet (its
spare data-plane worker starts after the daemon is ready and imports torch and NIXL for seconds of
CPU, which doubled the measured control overhead on two cores), and measures anyway, saying so,
when one stays busy."""

from __future__ import annotations

import asyncio

import pytest

from kvd.bench import report, rig


class ScriptedDaemons:
    """Every daemon tree's CPU seconds so far: each call adds the next step's busy seconds."""

    def __init__(self, steps: list[float]) -> None:
        self.steps = steps
        self.total = 0.0
        self.calls = 0

    def every_cpu(self) -> dict[str, float]:
        self.total += self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        return {"reader": 0.0, "holder": self.total}


@pytest.fixture(autouse=True)
def fast_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rig, "SETTLE_WINDOW_S", 0.01)


def test_the_bench_waits_for_two_quiet_windows_after_the_busy_ones() -> None:
    # A spare importing (a core busy), a gap, busy again, then quiet: settled on the second quiet
    # window after the last busy one.
    daemons = ScriptedDaemons([0.0, 0.01, 0.01, 0.0, 0.01, 0.0, 0.0, 0.0])
    waited_s, settled = asyncio.run(rig.wait_settled(daemons, timeout_s=5.0))  # type: ignore[arg-type]
    assert settled
    assert daemons.calls == 7  # the first read, then windows: busy, busy, quiet, busy, quiet, quiet
    assert waited_s < 5.0


def test_a_daemon_that_stays_busy_is_measured_anyway_and_the_bench_says_so() -> None:
    daemons = ScriptedDaemons([0.0, 0.01])
    waited_s, settled = asyncio.run(rig.wait_settled(daemons, timeout_s=0.1))  # type: ignore[arg-type]
    assert not settled and waited_s >= 0.1
    assert "measuring anyway" in report.settle_line(waited_s, settled)[0]
    assert "settled" in report.settle_line(1.0, True)[0]
