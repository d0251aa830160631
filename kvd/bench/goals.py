"""The bench's goals table: each goal of issue 19, those of issue 11 that still apply and issue
40's (the control path below the bytes), with this run's figure and whether it is met.

Every figure comes from the run's own samples (``result``: what ``bench.json`` holds); a goal
whose section did not run in this configuration (no level of 32 in flight, no 128 MiB size, no
step of 32, no fresh holder, no idle window, no conversion pairs) is reported "not measured",
with why, and counts as neither met nor missed.

Beside the control path's goals the table shows the same figure for the control path's hops
with no kvd logic in them (``floor``, :mod:`kvd.bench.floor`), measured in the same run: where
that floor is itself past the target, no work inside those processes can meet the goal; only a
path with fewer or cheaper hops could.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from kvd.bench.runs import median, percentile, router_rates

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Goal:
    """One row: what is asked, this run's figure, met or not (None: not measured)."""

    key: str
    issue: int
    what: str
    target: str
    figure: str
    value: float | None
    met: bool | None
    floor: str = ""  # the same figure for the hops alone (kvd.bench.floor); "" where not measured


@dataclasses.dataclass(frozen=True)
class _Measured:
    figure: str
    value: float
    met: bool


_Check = Callable[[dict[str, Any]], "_Measured | str"]


def _overhead_below(limit_s: float, inclusive: bool = False) -> _Check:
    """The goal that a 2 MiB pull's control overhead (pull - raw, pair by pair), p50, is below
    ``limit_s`` (issue 19: < 1 ms) or at most it (issue 40: <= 0.3 ms)."""

    def check(result: dict[str, Any]) -> _Measured | str:
        over = (result.get("overhead") or {}).get("overhead_s") or []
        if not over:
            return "no overhead samples"
        p50 = median(over)
        met = p50 <= limit_s if inclusive else p50 < limit_s
        return _Measured(f"{p50 * 1e3:.2f} ms ({len(over)} pairs)", p50, met)

    return check


def _size_overhead(size_mb: int, at_most_s: float) -> _Check:
    """Issue 40: a ``size_mb`` pull's control overhead, p50 of pull - raw read pair by pair (the
    sizes section interleaves them), at most ``at_most_s``."""

    def check(result: dict[str, Any]) -> _Measured | str:
        row = next((r for r in result.get("sizes") or [] if r["size_bytes"] == size_mb * MIB), None)
        if row is None:
            return f"no {size_mb} MiB size"
        over = [k - r for k, r in zip(row["kvd_s"], row["raw_s"], strict=True)]
        if not over:
            return f"no {size_mb} MiB samples"
        p50 = median(over)
        return _Measured(f"{p50 * 1e3:.2f} ms ({len(over)} pairs)", p50, p50 <= at_most_s)

    return check


def _step_row(result: dict[str, Any], batch: int) -> dict[str, Any] | None:
    """The steps of ``batch`` started as the engine patch starts them: one message on the engine
    stream (``stream``), or one StartPulls in a bench.json from before it (``batched``)."""
    rows = [r for r in result.get("batched") or [] if r["batch"] == batch and "raw" in r]
    return next((r for mode in ("stream", "batched") for r in rows if r["mode"] == mode), None)


def _step_vs_raw(result: dict[str, Any]) -> _Measured | str:
    """Issue 40: steps of 32 x 2 MiB pulls (one engine stream message each) against the same 32 READs from
    one bare NIXL agent, interleaved step by step in the batched section."""
    row = _step_row(result, 32)
    if row is None:
        return "no step of 32"
    kvd, raw = row["pulls"] / row["wall_s"], row["raw"]["pulls"] / row["raw"]["wall_s"]
    ratio = kvd / raw
    return _Measured(f"{ratio:.2f}x ({kvd:.0f} vs {raw:.0f}/s)", ratio, ratio >= 0.9)


def _first_pull_keep(result: dict[str, Any]) -> _Measured | str:
    """Issue 40, "keep": the first pull to a never-contacted holder, its own time (median), no
    slower than kvd's before issue 40 (13-22 ms here; vLLM's connector 35-166 ms)."""
    first = (result.get("first_contact") or {}).get("first_s") or []
    if not first:
        return "no fresh holder"
    p50 = median(first)
    return _Measured(f"{p50 * 1e3:.1f} ms ({len(first)} holders)", p50, p50 <= 0.022)


def _level(result: dict[str, Any], in_flight: int) -> dict[str, Any] | None:
    return next((row for row in result.get("concurrency") or [] if row["in_flight"] == in_flight), None)


def _rate_and_p99(row: dict[str, Any]) -> tuple[float, float, str]:
    """Pulls/s and p99 latency of a window of pulls (a concurrency level, or the floor's), and
    their figure."""
    rate, p99 = row["pulls"] / row["wall_s"], percentile(row["latency_s"], 99)
    return rate, p99, f"{rate:.0f}/s, p99 {p99 * 1e3:.0f} ms"


def _pulls_per_s(result: dict[str, Any]) -> _Measured | str:
    row = _level(result, 32)
    if row is None:
        return "no level of 32 in flight"
    rate, p99, figure = _rate_and_p99(row)
    return _Measured(figure, rate, rate >= 2000 and p99 < 0.05)


def _router_vs_engine(result: dict[str, Any]) -> _Measured | str:
    """Issue 40: a router's pulls (started and waited on one WatchTransfers stream, over TCP) at 32
    in flight against the engine's path, measured in turns in the router section."""
    rows = [row for row in result.get("router") or [] if row["in_flight"] == 32]
    rates = router_rates(rows)
    if "engine" not in rates or "one stream" not in rates:
        return "no router section at 32 in flight"
    ratio = rates["one stream"] / rates["engine"]
    figure = f"{ratio:.2f}x ({rates['one stream']:.0f} vs {rates['engine']:.0f}/s"
    if "stream per pull" in rates:  # the path before 0.2.0, beside it
        figure += f"; per pull {rates['stream per pull'] / rates['engine']:.2f}x"
    return _Measured(figure + ")", ratio, ratio >= 0.8)


def _size_ratio(result: dict[str, Any], size_mb: int) -> float | None:
    row = next((r for r in result.get("sizes") or [] if r["size_bytes"] == size_mb * MIB), None)
    return None if row is None else median(row["raw_s"]) / median(row["kvd_s"])


def _size_vs_raw(size_mb: int, at_least: float) -> Callable[[dict[str, Any]], _Measured | str]:
    """The goal that a ``size_mb`` pull takes at most 1/``at_least`` of a raw NIXL read's time."""

    def measure(result: dict[str, Any]) -> _Measured | str:
        ratio = _size_ratio(result, size_mb)
        if ratio is None:
            return f"no {size_mb} MiB size"
        return _Measured(f"{ratio:.2f}x", ratio, ratio >= at_least)

    return measure


def _cpu_per_pull(result: dict[str, Any]) -> _Measured | str:
    rows = result.get("concurrency") or []
    if not rows:
        return "no concurrency level"
    worst = max(rows, key=lambda row: row["cpu_s"]["all"] / row["pulls"])
    per_pull = worst["cpu_s"]["all"] / worst["pulls"]
    return _Measured(f"{per_pull * 1e3:.2f} ms (worst: {worst['in_flight']} in flight)", per_pull, per_pull < 0.5e-3)


def _first_contact(result: dict[str, Any]) -> _Measured | str:
    first = result.get("first_contact") or {}
    if not first.get("first_s") or not first.get("later_s"):
        return "no fresh holder"
    extra = median(first["first_s"]) - median(first["later_s"])
    return _Measured(f"+{extra * 1e3:.1f} ms", extra, extra < 0.01)


def _idle(result: dict[str, Any]) -> _Measured | str:
    percent = (result.get("idle") or {}).get("core_percent") or {}
    if not percent:
        return "no idle window"
    name, worst = max(percent.items(), key=lambda item: item[1])
    return _Measured(f"{worst:.2f} % ({name})", worst, worst < 0.5)


def _larger_pulls(result: dict[str, Any]) -> _Measured | str:
    ratios = [
        (row["size_bytes"] // MIB, median(row["raw_s"]) / median(row["kvd_s"]))
        for row in result.get("sizes") or []
        if row["size_bytes"] > 128 * MIB
    ]
    if not ratios:
        return "no size above 128 MiB"
    mib, worst = min(ratios, key=lambda item: item[1])
    return _Measured(f"{worst:.2f}x ({mib} MiB)", worst, worst >= 0.95)


def _worst_pair(key: str, floor: float) -> _Check:
    def check(result: dict[str, Any]) -> _Measured | str:
        rows = [row for row in result.get("conversions") or [] if key in row]
        if not rows:
            return "no conversion pairs" if not result.get("conversions") else "no such pair in this run"
        worst = min(rows, key=lambda row: row[key])
        return _Measured(f"{worst[key]:.2f}x ({worst['pair'][:18]})", worst[key], worst[key] >= floor)

    return check


GOALS: tuple[tuple[str, int, str, str, _Check], ...] = (
    (
        "control_overhead_p50",
        19,
        "control overhead of one 2 MiB pull, p50 (pull - raw)",
        "< 1 ms",
        _overhead_below(1e-3),
    ),
    ("pulls_per_s_32", 19, "2 MiB pulls/s at 32 in flight", ">= 2000/s, p99 < 50 ms", _pulls_per_s),
    ("pull_128mib_vs_raw", 19, "128 MiB pull / raw NIXL read", ">= 0.95x", _size_vs_raw(128, 0.95)),
    ("cpu_per_pull_all", 19, "CPU per pull, all processes together", "< 0.5 ms", _cpu_per_pull),
    ("first_contact_extra", 19, "first pull to a new peer, over later pulls", "< 10 ms", _first_contact),
    ("idle_daemon_cpu", 19, "CPU of an idle daemon (worst daemon)", "< 0.5 % of a core", _idle),
    (
        "control_overhead_p50_40",
        40,
        "2 MiB pull's control overhead, p50 (pull - raw)",
        "<= 0.3 ms",
        _overhead_below(0.3e-3, inclusive=True),
    ),
    (
        "control_overhead_128mib",
        40,
        "128 MiB pull's control overhead, p50 (pull - raw)",
        "<= 0.5 ms",
        _size_overhead(128, 0.5e-3),
    ),
    ("pull_128mib_vs_raw_40", 40, "128 MiB pull / raw NIXL read (issue 40)", ">= 0.98x", _size_vs_raw(128, 0.98)),
    ("step_32_vs_raw", 40, "step of 32 x 2 MiB pulls / raw NIXL's 32 READs", ">= 0.9x", _step_vs_raw),
    ("first_pull_keep", 40, "first pull to a new peer, its own time (keep)", "<= 22 ms", _first_pull_keep),
    ("idle_keep", 40, "CPU of an idle daemon (keep)", "< 0.5 % of a core", _idle),
    ("router_vs_engine_32", 40, "router pulls/s / engine pulls/s, 32 in flight", ">= 0.8x", _router_vs_engine),
    ("pull_8mib_vs_raw", 11, "8 MiB pull / raw NIXL read", ">= 0.8x", _size_vs_raw(8, 0.8)),
    ("pull_over_128mib_vs_raw", 11, "pulls above 128 MiB / raw NIXL (worst)", ">= 0.95x", _larger_pulls),
    ("staged_conversion_vs_copy", 11, "staged conversion / copy_ (worst pair)", ">= 0.8x", _worst_pair("vs_copy", 0.8)),
    (
        "pair_vs_same_layout",
        11,
        "layout pair pull / same-layout pull (worst)",
        ">= 0.5x",
        _worst_pair("vs_same_layout", 0.5),
    ),
)


def _floor_one_at_a_time(floor: dict[str, Any]) -> str:
    return f"{median(floor['one_at_a_time_s']) * 1e3:.2f} ms"


def _floor_rate(floor: dict[str, Any]) -> str:
    return _rate_and_p99(floor)[2]


def _floor_cpu(floor: dict[str, Any]) -> str:
    return f"{floor['cpu_s']['all'] / floor['pulls'] * 1e3:.2f} ms ({floor['in_flight']} in flight)"


def _floor_step(floor: dict[str, Any]) -> str:
    """The hops with one message per step of 32: pulls/s, beside the hops with one per pull."""
    step = floor.get("step")
    if not step:
        return ""
    return f"{step['pulls'] / step['wall_s']:.0f}/s by step, {floor['pulls'] / floor['wall_s']:.0f} by pull"


# The floor's figure for a goal: the control overhead against the hops' latency one at a time
# (the overhead is what a pull adds to its bytes; the hops carry none), pulls/s and CPU per pull
# against the hops' own at 32 in flight (the hops' exclude the bytes' copy, which kvd's include),
# a step of 32 against the hops with one message per step (and per pull).
FLOORS: dict[str, Callable[[dict[str, Any]], str]] = {
    "control_overhead_p50": _floor_one_at_a_time,
    "control_overhead_p50_40": _floor_one_at_a_time,
    "control_overhead_128mib": _floor_one_at_a_time,
    "pulls_per_s_32": _floor_rate,
    "cpu_per_pull_all": _floor_cpu,
    "step_32_vs_raw": _floor_step,
}


def evaluate(result: dict[str, Any]) -> list[Goal]:
    """Every goal, in the table's order, against this run's samples."""
    out = []
    floor = result.get("floor")
    for key, issue, what, target, check in GOALS:
        measured = check(result)
        hops = FLOORS[key](floor) if floor and key in FLOORS else ""
        if isinstance(measured, str) or not math.isfinite(measured.value):
            why = measured if isinstance(measured, str) else "no finite figure"
            out.append(Goal(key, issue, what, target, f"not measured ({why})", None, None, hops))
        else:
            out.append(Goal(key, issue, what, target, measured.figure, measured.value, measured.met, hops))
    return out


def table(goals: list[Goal]) -> list[str]:
    out = [
        "goals (issue 19; issue 11's that still apply; issue 40's), this run's figures; "
        "'the hops alone': the same figure for the control path's hops with no kvd logic (the floor section)",
        f"  {'goal':52} {'target':22} {'this run':40} {'met':8} {'the hops alone':22}",
    ]
    for goal in goals:
        mark = "-" if goal.met is None else ("met" if goal.met else "NOT met")
        out.append(
            f"  {goal.what[:52]:52} {goal.target:22} {goal.figure:40} {mark:8} {goal.floor or '-':22} (#{goal.issue})"
        )
    return out


def as_json(goals: list[Goal]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(goal) for goal in goals]
