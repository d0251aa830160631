"""`kvd bench`'s floor section (kvd.bench.floor): its three processes really play a pull's hops,
every message comes back to the caller that sent it, and a floor that cannot run is reported as
such and leaves nothing behind. The whole bench, floor included, runs in
tests/integration/test_bench.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvd.bench import floor
from kvd.bench.cpu import cpu_seconds


def _quiet(what: str, done: float) -> None:
    """Progress goes nowhere here."""


def test_the_hops_answer_every_pull_and_each_process_is_charged(tmp_path: Path) -> None:
    result = asyncio.run(floor.measure(tmp_path, 20, 8, 200, cpu_seconds, _quiet))
    assert len(result["one_at_a_time_s"]) == 20 and all(0 < s < 5 for s in result["one_at_a_time_s"])
    assert result["in_flight"] == 8 and result["pulls"] == len(result["latency_s"]) == 200
    assert result["wall_s"] > 0
    cpu = result["cpu_s"]
    # each hop did work for the pulls: the reader, the holder it asked, the worker it sent frames to
    assert cpu["reader"] > 0 and cpu["holder"] > 0 and cpu["worker"] > 0 and cpu["client"] > 0
    assert cpu["all"] == pytest.approx(cpu["reader"] + cpu["holder"] + cpu["worker"] + cpu["client"])
    assert "step" not in result  # no steps asked for


def test_steps_cross_each_hop_as_one_message_and_each_process_is_charged(tmp_path: Path) -> None:
    """The floor of a design with one message per step on every hop: each step of 8 pulls is one
    Start with 8 entries, answered once on the engine stream."""
    result = asyncio.run(floor.measure(tmp_path, 5, 4, 40, cpu_seconds, _quiet, step_pulls=8, steps=12))
    step = result["step"]
    assert step["batch"] == 8 and step["steps"] == len(step["step_s"]) == 12 and step["pulls"] == 96
    assert all(0 < s < 5 for s in step["step_s"]) and step["wall_s"] >= sum(step["step_s"]) * 0.99
    cpu = step["cpu_s"]
    assert cpu["reader"] > 0 and cpu["holder"] > 0 and cpu["worker"] > 0 and cpu["client"] > 0
    assert cpu["all"] == pytest.approx(cpu["reader"] + cpu["holder"] + cpu["worker"] + cpu["client"])
    assert result["pulls"] == len(result["latency_s"]) == 40  # the per-pull floor still ran beside it


def test_a_floor_that_cannot_start_is_a_floor_failure_and_leaves_no_process(tmp_path: Path) -> None:
    before = _floor_processes()
    missing = tmp_path / "no-such-directory"  # the worker cannot bind its socket there
    with pytest.raises(floor.FloorFailure, match="did not start"):
        asyncio.run(floor.measure(missing, 5, 2, 10, cpu_seconds, _quiet))
    assert _floor_processes() == before


def _floor_processes() -> set[int]:
    """Pids of running `kvd.bench.floor` roles."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvd.bench.floor" in cmdline and int(entry.name) != os.getpid():
            found.add(int(entry.name))
    return found
