"""`kvd bench`'s goals table, from a run's samples: each goal's figure, met or not, and "not
measured" (neither met nor missed) where its section did not run. The bench itself runs in
tests/integration/test_bench.py; here, samples are written out so each threshold is exact."""

from __future__ import annotations

from typing import Any

import pytest

from kvd.bench import goals
from kvd.bench.cpu import cpu_seconds

MIB = 1 << 20


def _router_row(mode: str, round_: int, wall_s: float, in_flight: int = 32) -> dict[str, Any]:
    """One window of the router section: 256 pulls of one path."""
    return {
        "mode": mode,
        "round": round_,
        "in_flight": in_flight,
        "pulls": 256,
        "wall_s": wall_s,
        "latency_s": [0.04] * 256,
        "cpu_s": {"reader": 0.1, "holder": 0.1, "client": 0.1, "all": 0.3},
    }


def _step_row(batch: int, wall_s: float, raw_wall_s: float, mode: str = "batched") -> dict[str, Any]:
    """One mode of a batch size in the batched section: 8 steps, and the raw steps beside them."""
    pulls = 8 * batch
    return {
        "batch": batch,
        "mode": mode,
        "pulls": pulls,
        "wall_s": wall_s,
        "latency_s": [0.02] * pulls,
        "cpu_s": {"reader": 0.1, "holder": 0.1, "client": 0.1, "all": 0.3},
        "raw": {"pulls": pulls, "wall_s": raw_wall_s, "latency_s": [0.01] * pulls, "cpu_s": {"all": 0.1}},
        "vs_raw": raw_wall_s / wall_s,
        "control_cpu_s": 0.2 / pulls,
    }


def _run(**changes: Any) -> dict[str, Any]:
    """A run's samples where every goal of issues 19, 40 and 11 is met."""
    result: dict[str, Any] = {
        "overhead": {"overhead_s": [0.0002, 0.0003, 0.0004]},
        "sizes": [
            {"size_bytes": 8 * MIB, "kvd_s": [0.010], "raw_s": [0.009]},
            {"size_bytes": 128 * MIB, "kvd_s": [0.100, 0.101], "raw_s": [0.0996, 0.1007]},
        ],
        "batched": [_step_row(32, 0.2, 0.19, "single"), _step_row(32, 0.2, 0.19), _step_row(8, 0.1, 0.05)],
        "concurrency": [
            {
                "in_flight": n,
                "pulls": 1000,
                "wall_s": 0.4,
                "latency_s": [0.010] * 1000,
                "cpu_s": {"reader": 0.1, "holder": 0.1, "client": 0.1, "all": 0.3},
            }
            for n in (1, 32)
        ],
        "router": [
            _router_row(mode, r, wall)
            for r in range(2)
            for mode, wall in (("engine", 0.4), ("one stream", 0.45), ("stream per pull", 0.9))
        ],
        "first_contact": {"first_s": [0.012], "later_s": [0.004, 0.005]},
        "idle": {"core_percent": {"reader": 0.2, "holder": 0.1}},
        "conversions": [
            {"pair": "same layout (baseline)", "vs_same_layout": 1.0},
            {"pair": "NHD -> HND", "vs_copy": 0.9, "vs_same_layout": 0.7},
        ],
    }
    result.update(changes)
    return result


def _by_key(result: dict[str, Any]) -> dict[str, goals.Goal]:
    return {goal.key: goal for goal in goals.evaluate(result)}


def test_every_goal_has_its_row_and_a_run_that_meets_them_all_says_so() -> None:
    table = goals.evaluate(_run(sizes=[*_run()["sizes"], {"size_bytes": 512 * MIB, "kvd_s": [1.0], "raw_s": [0.97]}]))
    assert [goal.key for goal in table] == [key for key, *_ in goals.GOALS]
    assert [goal.issue for goal in table][:6] == [19] * 6
    assert all(goal.met is True for goal in table), table
    by_key = {goal.key: goal for goal in table}
    assert by_key["cpu_per_pull_all"].value == pytest.approx(0.3e-3)
    assert by_key["pulls_per_s_32"].value == pytest.approx(2500)
    assert by_key["idle_daemon_cpu"].figure.endswith("(reader)")
    lines = goals.table(table)
    assert all(any(goal.what in line for line in lines) for goal in table)


def test_each_threshold_of_issue_19() -> None:
    slow = _run(overhead={"overhead_s": [0.001, 0.001, 0.001]})
    assert _by_key(slow)["control_overhead_p50"].met is False
    assert _by_key(_run(overhead={"overhead_s": [0.0009]}))["control_overhead_p50"].met is True
    level = _run()["concurrency"][1]
    late = _run(concurrency=[{**level, "latency_s": [0.010] * 980 + [0.060] * 20}])
    assert _by_key(late)["pulls_per_s_32"].met is False  # 2,500/s, but p99 60 ms
    few = _run(concurrency=[{**level, "wall_s": 0.6}])
    assert _by_key(few)["pulls_per_s_32"].met is False  # 1,667/s
    assert (
        _by_key(_run(sizes=[{"size_bytes": 128 * MIB, "kvd_s": [0.1], "raw_s": [0.094]}]))["pull_128mib_vs_raw"].met
        is False
    )
    one_costly = _run(concurrency=[level, {**level, "in_flight": 1, "cpu_s": {**level["cpu_s"], "all": 0.5}}])
    cpu = _by_key(one_costly)["cpu_per_pull_all"]
    assert cpu.met is False and cpu.value == pytest.approx(0.5e-3) and "1 in flight" in cpu.figure  # the worst level
    assert _by_key(_run(first_contact={"first_s": [0.016], "later_s": [0.005]}))["first_contact_extra"].met is False
    idle = _by_key(_run(idle={"core_percent": {"reader": 0.2, "holder": 0.5}}))["idle_daemon_cpu"]
    assert idle.met is False and idle.figure.endswith("(holder)")


def test_the_router_path_against_the_engine_path_issue_40() -> None:
    """A router's pulls/s (one WatchTransfers stream) over the engine path's, both over every round
    of the router section: at least 0.8x is met; the stream-per-pull path stands in the figure."""
    met = _by_key(_run())["router_vs_engine_32"]
    assert met.issue == 40 and met.met is True and met.value == pytest.approx(0.4 / 0.45)
    assert met.figure == "0.89x (569 vs 640/s; per pull 0.44x)"
    slow = [_router_row(mode, 0, wall) for mode, wall in (("engine", 0.4), ("one stream", 0.51))]
    missed = _by_key(_run(router=slow))["router_vs_engine_32"]
    assert missed.met is False and missed.value == pytest.approx(0.4 / 0.51)
    assert missed.figure.endswith("/s)")  # no stream-per-pull path in this run
    other_level = [_router_row(mode, 0, 0.4, in_flight=8) for mode in ("engine", "one stream")]
    for router in ([], other_level):
        goal = _by_key(_run(router=router))["router_vs_engine_32"]
        assert goal.met is None and goal.figure == "not measured (no router section at 32 in flight)"


def test_the_goals_of_issue_40() -> None:
    """Issue 40's table: a 2 MiB pull's control overhead <= 0.3 ms, a 128 MiB pull's <= 0.5 ms (pair
    by pair from the sizes section), 128 MiB >= 0.98x raw, a step of 32 >= 0.9x raw NIXL's 32 READs
    (the batched mode's row, not the single one's), first contact and idle kept."""
    table = _by_key(_run())
    mine = [goal.key for goal in table.values() if goal.issue == 40]
    assert mine == [
        "control_overhead_p50_40",
        "control_overhead_128mib",
        "pull_128mib_vs_raw_40",
        "step_32_vs_raw",
        "first_pull_keep",
        "idle_keep",
        "router_vs_engine_32",
    ]
    assert table["control_overhead_p50_40"].value == pytest.approx(0.0003)
    assert _by_key(_run(overhead={"overhead_s": [0.0003]}))["control_overhead_p50_40"].met is True  # at most
    over = _by_key(_run(overhead={"overhead_s": [0.00031]}))
    assert over["control_overhead_p50_40"].met is False and over["control_overhead_p50"].met is True
    large = table["control_overhead_128mib"]
    assert large.value == pytest.approx(0.00035) and large.figure == "0.35 ms (2 pairs)"  # p50 of 0.4 and 0.3 ms
    slow = [{"size_bytes": 128 * MIB, "kvd_s": [0.100], "raw_s": [0.0994]}]
    assert _by_key(_run(sizes=slow))["control_overhead_128mib"].met is False  # 0.6 ms
    assert _by_key(_run(sizes=slow))["pull_128mib_vs_raw_40"].met is True  # 0.994x
    under = _by_key(_run(sizes=[{"size_bytes": 128 * MIB, "kvd_s": [0.100], "raw_s": [0.097]}]))
    assert under["pull_128mib_vs_raw_40"].met is False and under["pull_128mib_vs_raw"].met is True
    step = table["step_32_vs_raw"]
    assert step.met is True and step.value == pytest.approx(0.95) and step.figure == "0.95x (1280 vs 1347/s)"
    behind = _by_key(_run(batched=[_step_row(32, 0.2, 0.9 * 0.2 - 0.001)]))["step_32_vs_raw"]
    assert behind.met is False and behind.value < 0.9
    for batched in ([], [_step_row(8, 0.1, 0.05)], [_step_row(32, 0.2, 0.19, "single")]):
        goal = _by_key(_run(batched=batched))["step_32_vs_raw"]
        assert goal.met is None and goal.figure == "not measured (no step of 32)"
    first = table["first_pull_keep"]
    assert first.met is True and first.value == pytest.approx(0.012) and first.figure == "12.0 ms (1 holders)"
    assert _by_key(_run(first_contact={"first_s": [0.023], "later_s": [0.02]}))["first_pull_keep"].met is False
    idle = _by_key(_run(idle={"core_percent": {"reader": 0.6}}))
    assert idle["idle_keep"].met is False and idle["idle_keep"].value == idle["idle_daemon_cpu"].value


def test_a_section_that_did_not_run_is_not_measured_rather_than_a_number() -> None:
    bare = _by_key({"overhead": {"overhead_s": [0.002]}})
    assert bare["control_overhead_p50"].met is False and bare["control_overhead_p50_40"].met is False
    for key, goal in bare.items():
        if key not in ("control_overhead_p50", "control_overhead_p50_40"):
            assert goal.met is None and goal.value is None and goal.figure.startswith("not measured ("), goal
    only_one = _by_key(_run(concurrency=[_run()["concurrency"][0]]))
    assert only_one["pulls_per_s_32"].figure == "not measured (no level of 32 in flight)"
    assert only_one["cpu_per_pull_all"].met is True  # measured at the levels that ran
    assert goals.as_json(list(bare.values()))[1]["figure"].startswith("not measured")


def test_the_hops_alone_stand_beside_their_three_goals_when_the_floor_ran() -> None:
    floor = {
        "one_at_a_time_s": [0.0011, 0.0012, 0.0013],
        "in_flight": 32,
        "pulls": 2000,
        "wall_s": 1.25,
        "latency_s": [0.019] * 1960 + [0.030] * 40,
        "cpu_s": {"holder": 0.36, "worker": 0.14, "reader": 1.04, "client": 0.64, "all": 2.18},
    }
    with_floor = _by_key(_run(floor=floor))
    assert with_floor["control_overhead_p50"].floor == "1.20 ms"  # the hops' latency, one at a time
    assert with_floor["control_overhead_p50_40"].floor == with_floor["control_overhead_128mib"].floor == "1.20 ms"
    assert with_floor["step_32_vs_raw"].floor == ""  # no steps in this floor
    step = {"batch": 32, "steps": 50, "pulls": 1600, "wall_s": 0.1, "step_s": [0.002] * 50, "cpu_s": {"all": 0.1}}
    by_step = _by_key(_run(floor={**floor, "step": step}))["step_32_vs_raw"]
    assert by_step.floor == "16000/s by step, 1600 by pull"  # one message per step on every hop, and per pull
    assert with_floor["pulls_per_s_32"].floor == "1600/s, p99 30 ms"
    assert with_floor["cpu_per_pull_all"].floor == "1.09 ms (32 in flight)"
    others = [goal for key, goal in with_floor.items() if key not in goals.FLOORS]
    assert others and all(goal.floor == "" for goal in others)
    # the floor changes no figure and no verdict: it stands beside them
    without = _by_key(_run())
    assert all(without[key].figure == goal.figure and without[key].met == goal.met for key, goal in with_floor.items())
    assert all(goal.floor == "" for goal in without.values())
    lines = goals.table(list(with_floor.values()))
    assert "the hops alone" in lines[1] and any("1600/s, p99 30 ms" in line for line in lines)


def test_cpu_seconds_counts_a_process_and_grows_with_its_work() -> None:
    import os
    import time

    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.04
    assert cpu_seconds(2**22 + 12345) == 0.0  # no such process
