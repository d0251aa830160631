"""`kvd bench` end to end on a tiny configuration: real daemons, real NIXL, every section's samples
in the JSON, the plots written. Not a timed test: it checks the tool, not the figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_writes_every_sample_and_the_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = [
        "bench",
        "--quick",
        "--out", str(out),
        "--sizes-mb", "2,4",
        "--samples", "2",
        "--overhead-samples", "4",
        "--levels", "1,4",
        "--pulls-per-level", "8",
        "--batch", "4",
        "--fresh-peers", "1",
        "--convert-tokens", "16",
        "--idle-s", "1",
        "--floor-pulls", "64",
        "--router-pulls", "40",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", *args], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for table in (
        "pull vs raw NIXL read",
        "control overhead",
        "in flight",
        "engine steps of B 2 MiB pulls",
        "first pull to a new peer",
        "idle daemons",
        "the control path's floor",
        "by path, in turns",
        "goals",
        "against a raw read with a pull's descriptors",
        "against a raw read after the same pause",
    ):
        assert table in result.stdout, result.stdout

    data = json.loads((out / "bench.json").read_text())
    assert data["machine"]["cores"] >= 1 and data["config"]["sizes_mb"] == [2, 4]
    sizes = {row["size_bytes"]: row for row in data["sizes"]}
    assert set(sizes) == {2 << 20, 4 << 20}
    assert all(len(row["kvd_s"]) == len(row["raw_s"]) == 2 for row in sizes.values())
    assert all(s > 0 for row in sizes.values() for s in row["kvd_s"] + row["raw_s"])
    assert all(len(row["phase_s"]) == 2 for row in sizes.values())  # the post's share of each size's pulls
    assert all(p["prepared"] <= p["read"] for row in sizes.values() for p in row["phase_s"])
    overhead = data["overhead"]
    assert len(overhead["overhead_s"]) == 4
    assert len(overhead["phase_s"]) == 4  # where each pull's time went, from the daemon's TransferStatus
    assert all(p["planned"] <= p["prepared"] <= p["posted"] <= p["read"] <= p["done"] for p in overhead["phase_s"])
    assert overhead["overhead_s"] == pytest.approx(
        [k - r for k, r in zip(overhead["kvd_s"], overhead["raw_s"], strict=True)]
    )
    # Each pair also against a raw READ with a pull's descriptors (the layout's own cost)
    assert len(overhead["raw_layout_s"]) == 4 and all(r > 0 for r in overhead["raw_layout_s"])
    assert overhead["overhead_vs_layout_s"] == pytest.approx(
        [k - r for k, r in zip(overhead["kvd_s"], overhead["raw_layout_s"], strict=True)]
    )
    paused = overhead["paused"]  # the same pairs, each pull after a pause (as an engine's come)
    assert paused["pause_s"] > 0 and len(paused["overhead_s"]) == len(paused["kvd_s"]) == 4
    assert all(k > 0 and r > 0 for k, r in zip(paused["kvd_s"], paused["raw_s"], strict=True))
    # ... and against a raw READ after the same pause (what a pause costs the bytes themselves)
    assert len(paused["raw_after_pause_s"]) == 4 and all(r > 0 for r in paused["raw_after_pause_s"])
    assert paused["overhead_vs_paused_raw_s"] == pytest.approx(
        [k - r for k, r in zip(paused["kvd_s"], paused["raw_after_pause_s"], strict=True)]
    )
    assert any("with nothing moving" in line for line in result.stdout.splitlines())
    by_call = overhead["start_pull"]  # each pair followed by the same pull started by a StartPull call
    assert len(by_call["kvd_s"]) == len(by_call["overhead_s"]) == 4 and all(k > 0 for k in by_call["kvd_s"])
    assert by_call["overhead_s"] == pytest.approx(
        [k - r for k, r in zip(by_call["kvd_s"], overhead["raw_s"], strict=True)]
    )
    assert any("started by a StartPull call instead" in line for line in result.stdout.splitlines())
    levels = {row["in_flight"]: row for row in data["concurrency"]}
    assert set(levels) == {1, 4}
    for n, row in levels.items():
        assert len(row["latency_s"]) == row["pulls"] >= max(8, 4 * n)
        cpu = row["cpu_s"]
        # read from /proc: the daemons' control processes and their data-plane workers, apart
        assert cpu["reader"] > 0 and cpu["holder"] > 0 and cpu["reader worker"] > 0 and cpu["holder worker"] > 0
        assert cpu["client"] > 0  # this process's own CPU over the same window
        assert cpu["all"] == pytest.approx(
            cpu["reader"] + cpu["reader worker"] + cpu["holder"] + cpu["holder worker"] + cpu["client"]
        )
        assert all(math.isfinite(v) for v in cpu.values())
    # the same steps: StartPull each, one StartPulls, one message on the engine stream
    batched = {row["mode"]: row for row in data["batched"]}
    assert set(batched) == {"single", "batched", "stream"} and data["config"]["batches"] == [4]
    for row in batched.values():
        assert row["batch"] == 4 and len(row["latency_s"]) == row["pulls"] >= 16
        assert row["cpu_s"]["reader"] > 0 and row["cpu_s"]["client"] > 0
        # the same steps' READs from the bare NIXL agent, interleaved step by step
        raw = row["raw"]
        assert raw["pulls"] == row["pulls"] == len(raw["latency_s"]) and all(s > 0 for s in raw["latency_s"])
        assert set(raw["cpu_s"]) == {"holder", "client", "all"} and raw["cpu_s"]["client"] > 0
        assert raw["cpu_s"]["all"] == pytest.approx(raw["cpu_s"]["holder"] + raw["cpu_s"]["client"])
        assert row["vs_raw"] == pytest.approx((row["pulls"] / row["wall_s"]) / (raw["pulls"] / raw["wall_s"]))
        assert row["control_cpu_s"] == pytest.approx((row["cpu_s"]["all"] - raw["cpu_s"]["all"]) / row["pulls"])
        assert math.isfinite(row["vs_raw"]) and row["vs_raw"] > 0 and math.isfinite(row["control_cpu_s"])
        laid = row["raw_layout"]  # and with the pulls' own descriptors, the bytes' bound for the layout
        assert laid["pulls"] == row["pulls"] == len(laid["latency_s"]) and all(s > 0 for s in laid["latency_s"])
        assert row["vs_raw_layout"] == pytest.approx((row["pulls"] / row["wall_s"]) / (laid["pulls"] / laid["wall_s"]))
    steps = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("B "))
    assert steps.split()[-6:] == ["raw/s", "ratio", "raw-cpu", "ctrl", "lay/s", "of-lay"], steps
    header = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("N "))
    assert header.split()[-6:] == ["reader", "r-wkr", "holder", "h-wkr", "client", "all"], header
    sections = list(data["section_s"])
    router = data["router"]  # a router's pulls (one stream, a stream per pull) beside the engine's, in turns
    modes = ("engine", "one stream", "stream per pull")  # each round starts with the next path
    assert [(row["round"], row["mode"]) for row in router] == [
        (r, modes[(r + m) % 3]) for r in range(3) for m in range(3)
    ]
    for row in router:
        assert row["in_flight"] == 32 and row["pulls"] == len(row["latency_s"]) == 40
        assert row["cpu_s"]["reader"] > 0 and row["cpu_s"]["client"] > 0
    assert sections.index("router") == sections.index("concurrency") - 1
    first = data["first_contact"]
    assert len(first["first_s"]) == 1 and len(first["later_s"]) == data["config"]["later_pulls"]
    idle = data["idle"]  # the daemons with no engine pulling, after every other daemon section
    assert data["config"]["idle_s"] == 1 and idle["wall_s"] >= 1
    assert set(idle["core_percent"]) == {"reader", "holder", "fresh holder 0"}
    assert all(math.isfinite(v) and v >= 0 for v in [*idle["core_percent"].values(), idle["client_core_percent"]])
    floor = data["floor"]  # the same hops with no kvd logic: one at a time, then 32 in flight
    assert len(floor["one_at_a_time_s"]) == 4 and all(s > 0 for s in floor["one_at_a_time_s"])
    assert floor["in_flight"] == 32 and floor["pulls"] == len(floor["latency_s"]) == 64
    assert set(floor["cpu_s"]) == {"holder", "worker", "reader", "client", "all"}
    assert floor["cpu_s"]["reader"] > 0 and floor["cpu_s"]["holder"] > 0 and floor["cpu_s"]["worker"] > 0
    step = floor["step"]  # the same hops with one message per step of 32 on each: steps one after the other
    assert step["batch"] == 32 and step["steps"] == len(step["step_s"]) >= 4 and step["pulls"] == 32 * step["steps"]
    assert all(s > 0 for s in step["step_s"]) and step["wall_s"] > 0
    assert set(step["cpu_s"]) == {"holder", "worker", "reader", "client", "all"} and step["cpu_s"]["reader"] > 0
    assert "one message per step of 32 on every hop" in result.stdout
    assert sections.index("floor") == sections.index("concurrency") + 1
    assert sections.index("idle") == sections.index("floor") + 1  # the last section with daemons
    pairs = {row["pair"]: row for row in data["conversions"]}
    assert "same layout (baseline)" in pairs and any(row["mode"] == "staged" for row in pairs.values())
    assert all("vs_copy" in row for row in pairs.values() if row["mode"] == "staged")

    goals = {goal["key"]: goal for goal in data["goals"]}
    assert list(goals)[:6] == [  # issue 19's, in its order, then issue 11's
        "control_overhead_p50",
        "pulls_per_s_32",
        "pull_128mib_vs_raw",
        "cpu_per_pull_all",
        "first_contact_extra",
        "idle_daemon_cpu",
    ]
    assert [key for key, goal in goals.items() if goal["issue"] == 40] == [  # issue 40's, in its table's order
        "control_overhead_p50_40",
        "control_overhead_128mib",
        "pull_128mib_vs_raw_40",
        "step_32_vs_raw",
        "first_pull_keep",
        "idle_keep",
        "router_vs_engine_32",
    ]
    not_run = {
        "pulls_per_s_32",
        "pull_128mib_vs_raw",
        "pull_8mib_vs_raw",
        "pull_over_128mib_vs_raw",
        "control_overhead_128mib",
        "pull_128mib_vs_raw_40",
        "step_32_vs_raw",
    }
    # the tiny run has no 32 in flight, no 8 or 128 MiB size and no step of 32
    for key, goal in goals.items():
        if key in not_run:
            assert goal["value"] is None and goal["met"] is None and goal["figure"].startswith("not measured"), goal
        else:
            assert math.isfinite(goal["value"]) and isinstance(goal["met"], bool), goal
        assert goal["what"] in result.stdout, goal
    for key in ("cpu_per_pull_all", "idle_daemon_cpu", "staged_conversion_vs_copy", "pair_vs_same_layout"):
        assert goals[key]["value"] >= 0, goals[key]
    worst = max(row["cpu_s"]["all"] / row["pulls"] for row in data["concurrency"])
    assert goals["cpu_per_pull_all"]["value"] == pytest.approx(worst)
    assert goals["idle_daemon_cpu"]["value"] == pytest.approx(max(idle["core_percent"].values()))
    assert goals["control_overhead_p50_40"]["value"] == goals["control_overhead_p50"]["value"]
    assert goals["first_pull_keep"]["value"] == pytest.approx(first["first_s"][0])
    hops = {key for key, goal in goals.items() if goal["floor"]}
    assert hops == {
        "control_overhead_p50",
        "control_overhead_p50_40",
        "control_overhead_128mib",
        "pulls_per_s_32",
        "cpu_per_pull_all",
        "step_32_vs_raw",
    }, goals
    assert "by step" in goals["step_32_vs_raw"]["floor"]  # the floor of one message per step, beside the goal

    for name in ("throughput.png", "latency_cdf.png", "concurrency.png"):
        png = (out / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name


def test_bench_refuses_an_odd_size() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", "bench", "--sizes-mb", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "sizes must be even MiB" in result.stderr
