"""The bench's output: a progress bar while it runs, the tables, the JSON of every sample, the plots.

Plots use matplotlib's Agg backend (files only, no display), imported only when plots are written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from kvd.bench.runs import median, percentile, router_rates

GB = 1e9


class ProgressBar:
    """One line on a terminal (``\\r``), redrawn at most every 0.1 s; nothing when not a tty."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._tty = stream.isatty()
        self._last = 0.0
        self._started = time.monotonic()

    def __call__(self, what: str, done: float) -> None:
        now = time.monotonic()
        if not self._tty or (now - self._last < 0.1 and done < 1.0):
            return
        self._last = now
        filled = int(self._width * max(0.0, min(1.0, done)))
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r[{bar}] {now - self._started:5.0f}s {what[:48]:<48}")
        self._stream.flush()

    def clear(self) -> None:
        if self._tty:
            self._stream.write("\r" + " " * (self._width + 60) + "\r")
            self._stream.flush()


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def size_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "pull vs raw NIXL read of the same bytes (medians, interleaved samples); post ms: from the holder's "
        "admission to the READ done (the hop to the data-plane worker, the post, NIXL's copy: a raw read pays "
        "the copy); other ms: the rest (planning, the admission, the report, the client's RPCs)",
        f"{'MiB':>6} {'kvd ms':>9} {'kvd GB/s':>9} {'raw ms':>9} {'raw GB/s':>9} {'ratio':>6} "
        f"{'post ms':>9} {'other ms':>9}",
    ]
    for row in rows:
        kvd, raw, size = median(row["kvd_s"]), median(row["raw_s"]), row["size_bytes"]
        phases = row.get("phase_s") or []
        spans = [p["read"] - p["prepared"] for p in phases if "read" in p and "prepared" in p]
        moving = median(spans) if spans else math.nan
        out.append(
            f"{size >> 20:6d} {_ms(kvd):>9} {size / kvd / GB:9.2f} {_ms(raw):>9} {size / raw / GB:9.2f} "
            f"{raw / kvd:6.2f} {_ms(moving):>9} {_ms(kvd - moving):>9}"
        )
    return out


PHASES = ("planned", "prepared", "posted", "read", "done")


def phase_line(result: dict[str, Any]) -> str:
    """Median time of each phase of a pull inside the reader daemon (each from the previous one's
    end), and what is left for the client's two hops (the pull's start, its FinishedRecving)."""
    phases = result.get("phase_s") or []
    if not phases:
        return ""
    parts, previous = [], [0.0] * len(phases)
    for name in PHASES:
        spans = [p[name] - prev for p, prev in zip(phases, previous, strict=True) if name in p]
        previous = [p.get(name, prev) for p, prev in zip(phases, previous, strict=True)]
        if spans:
            parts.append(f"{name} +{_ms(median(spans))}")
    outside = [k - p["done"] for k, p in zip(result["kvd_s"], phases, strict=True) if "done" in p]
    return (
        "inside the reader daemon, median ms per phase (handshake+plan = planned, holder's PreparePull = prepared, "
        f"post = posted, NIXL = read, report = done): {', '.join(parts)}; outside (the engine stream's two messages) "
        f"{_ms(median(outside))}"
    )


def settle_line(waited_s: float, settled: bool) -> list[str]:
    """How long the bench waited for its daemons to go quiet (their spare workers start after ready)."""
    if settled:
        return [f"daemons settled {waited_s:.1f} s after ready (their spare workers started): measuring"]
    return [f"daemons still busy {waited_s:.0f} s after ready: measuring anyway (figures include their start-up)"]


def overhead_table(result: dict[str, Any]) -> list[str]:
    over = result["overhead_s"]
    line = phase_line(result)
    return [
        *([line] if line else []),
        f"control overhead of one {result['size_bytes'] >> 20} MiB pull (pull - raw read, pair by pair, "
        f"{len(over)} pairs): p50 {_ms(median(over))} ms, p90 {_ms(percentile(over, 90))} ms, "
        f"p99 {_ms(percentile(over, 99))} ms; pull p50 {_ms(median(result['kvd_s']))} ms, "
        f"raw p50 {_ms(median(result['raw_s']))} ms (each pull started on the engine stream, as the engine "
        "patch starts them)",
        *_layout_line(result),
        *_by_call_line(result.get("start_pull")),
        *_paused_line(result.get("paused")),
    ]


def _layout_line(result: dict[str, Any]) -> list[str]:
    """The same pairs against a raw READ with a pull's descriptors: the layout's share taken out."""
    over = result.get("overhead_vs_layout_s")
    if not over:
        return []
    return [
        f"  against a raw read with a pull's descriptors (64 of 32 KiB, each pair): overhead p50 "
        f"{_ms(median(over))} ms; that raw read p50 {_ms(median(result['raw_layout_s']))} ms (the layout's "
        "own cost, which any reader of these blocks pays)"
    ]


def _by_call_line(by_call: dict[str, Any] | None) -> list[str]:
    """The same pulls started by a StartPull call, each right after a pair (the path before)."""
    if not by_call or not by_call["overhead_s"]:
        return []
    over = by_call["overhead_s"]
    return [
        f"  started by a StartPull call instead, each right after a pair ({len(over)}): overhead p50 "
        f"{_ms(median(over))} ms, p90 {_ms(percentile(over, 90))} ms; pull p50 {_ms(median(by_call['kvd_s']))} ms"
    ]


def _paused_line(paused: dict[str, Any] | None) -> list[str]:
    """The same pairs, each pull after a pause (as an engine's pulls come: one per request)."""
    if not paused or not paused["overhead_s"]:
        return []
    over = paused["overhead_s"]
    return [
        f"  each after {paused['pause_s'] * 1e3:.0f} ms with nothing moving ({len(over)} pairs): overhead p50 "
        f"{_ms(median(over))} ms, p90 {_ms(percentile(over, 90))} ms; pull p50 {_ms(median(paused['kvd_s']))} ms",
        *_paused_raw_line(paused),
    ]


def _paused_raw_line(paused: dict[str, Any]) -> list[str]:
    """The paused pulls against a raw read after the same pause: what a pause costs the bytes."""
    over = paused.get("overhead_vs_paused_raw_s")
    if not over:
        return []
    return [
        f"  against a raw read after the same pause: overhead p50 {_ms(median(over))} ms; that raw read p50 "
        f"{_ms(median(paused['raw_after_pause_s']))} ms (back to back: {_ms(median(paused['raw_s']))} ms)"
    ]


def concurrency_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "2 MiB pulls with N in flight (started on the engine stream -> FinishedRecving on it); "
        "CPU ms per pull of each process over the level's window (reader, holder: the daemons' control "
        "processes; r-wkr, h-wkr: their data-plane workers; client: the bench process; all: their sum)",
        f"{'N':>4} {'pulls':>6} {'pulls/s':>8} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'reader':>7} {'r-wkr':>7} {'holder':>7} {'h-wkr':>7} {'client':>7} {'all':>7}",
    ]
    for row in rows:
        pulls, wall = row["pulls"], row["wall_s"]
        out.append(
            f"{row['in_flight']:4d} {pulls:6d} {pulls / wall:8.0f} {pulls * (2 << 20) / wall / GB:6.2f} "
            + _latency_and_cpu(row)
        )
    return out


def _latency_and_cpu(row: dict[str, Any]) -> str:
    """The p50, p99 and CPU-per-pull columns the concurrency and batched tables share."""
    lat, pulls = row["latency_s"], row["pulls"]
    cpu = {k: f"{v / pulls * 1e3:7.2f}" for k, v in row["cpu_s"].items()}
    return (
        f"{_ms(median(lat)):>8} {_ms(percentile(lat, 99)):>8} "
        f"{cpu['reader']} {cpu.get('reader worker', '      -')} {cpu['holder']} "
        f"{cpu.get('holder worker', '      -')} {cpu['client']} {cpu['all']}"
    )


def batched_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "engine steps of B 2 MiB pulls started at once, waited for together (single: B StartPull calls; "
        "batched: one StartPulls; stream: one message on the engine stream, the engine patch's way); "
        "latency from the step's start to each FinishedRecving; CPU ms per pull "
        "as in the concurrency table",
        "  each step followed by a raw step: the same B READs of 2 MiB posted together from one bare NIXL agent "
        "and waited for together (raw/s; ratio: kvd's pulls/s over raw's; raw-cpu: the raw READs' CPU ms per READ, "
        "this process and the holder over the raw steps); ctrl: control CPU ms per pull, kvd's all less raw-cpu",
        "  then the same raw step with each READ as a pull's descriptors (64 of 32 KiB, one per plane, as the "
        "layout makes anyone read a block): lay/s, and kvd's pulls/s over it (of-lay)",
        f"{'B':>4} {'mode':>8} {'pulls':>6} {'pulls/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'reader':>7} {'r-wkr':>7} {'holder':>7} {'h-wkr':>7} {'client':>7} {'all':>7} "
        f"{'raw/s':>7} {'ratio':>6} {'raw-cpu':>7} {'ctrl':>7} {'lay/s':>7} {'of-lay':>6}",
    ]
    for row in rows:
        pulls, wall = row["pulls"], row["wall_s"]
        line = f"{row['batch']:4d} {row['mode']:>8} {pulls:6d} {pulls / wall:8.0f} " + _latency_and_cpu(row)
        raw = row.get("raw")
        if raw:
            line += (
                f" {raw['pulls'] / raw['wall_s']:7.0f} {row['vs_raw']:6.2f} "
                f"{raw['cpu_s']['all'] / raw['pulls'] * 1e3:7.2f} {row['control_cpu_s'] * 1e3:7.2f}"
            )
        laid = row.get("raw_layout")
        if laid:
            line += f" {laid['pulls'] / laid['wall_s']:7.0f} {row['vs_raw_layout']:6.2f}"
        out.append(line)
    for row in rows:
        if row["mode"] == "stream" and row.get("raw_layout") and row.get("raw"):
            laid, raw = row["raw_layout"], row["raw"]
            ceiling = (raw["wall_s"] / raw["pulls"]) / (laid["wall_s"] / laid["pulls"])
            out.append(
                f"  steps of {row['batch']}: the bytes alone, read with the pulls' descriptors, reach {ceiling:.2f}x "
                "raw's one-descriptor READs: the ceiling here of any path that reads these blocks (they do not adjoin)"
            )
    return out


def router_table(rows: list[dict[str, Any]]) -> list[str]:
    """The router section: each path's pulls/s, p50/p99 and CPU per pull, over its rounds."""
    in_flight = rows[0]["in_flight"] if rows else 0
    out = [
        f"2 MiB pulls with {in_flight} in flight, by path, in turns (engine: started on its engine stream, "
        "FinishedRecving on the engine stream; one stream: a router's pull over TCP, started and waited on the "
        "client's one WatchTransfers stream; stream per pull: a StartPull and a WatchTransfer stream per pull, the "
        "path before 0.2.0); "
        "CPU ms per pull as in the concurrency table; ratio: pulls/s over the engine path's",
        f"{'path':>16} {'pulls':>6} {'pulls/s':>8} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'reader':>7} {'r-wkr':>7} {'holder':>7} {'h-wkr':>7} {'client':>7} {'all':>7}",
    ]
    rates = router_rates(rows)
    engine = rates.get("engine", math.nan)
    for mode, rate in rates.items():
        mine = [row for row in rows if row["mode"] == mode]
        merged = {
            "pulls": sum(row["pulls"] for row in mine),
            "latency_s": [s for row in mine for s in row["latency_s"]],
            "cpu_s": {k: sum(row["cpu_s"][k] for row in mine) for k in mine[0]["cpu_s"]},
        }
        out.append(f"{mode:>16} {merged['pulls']:6d} {rate:8.0f} {rate / engine:6.2f} " + _latency_and_cpu(merged))
    return out


def floor_table(result: dict[str, Any]) -> list[str]:
    """The hops alone (kvd.bench.floor): the least any control path of this shape costs here."""
    one, lat, pulls, wall = result["one_at_a_time_s"], result["latency_s"], result["pulls"], result["wall_s"]
    cpu = ", ".join(f"{name} {seconds / pulls * 1e3:.2f}" for name, seconds in result["cpu_s"].items())
    out = [
        "the control path's floor: a pull's hops (client -> reader -> holder -> reader -> worker -> reader -> "
        "engine stream) as framed sockets between Python asyncio processes, with no kvd logic, no bytes, no TLS",
        f"  one message per pull on every hop, one at a time: p50 {_ms(median(one))} ms ({len(one)} pulls); "
        f"{result['in_flight']} in flight: "
        f"{pulls / wall:.0f} pulls/s, p50 {_ms(median(lat))} ms, p99 {_ms(percentile(lat, 99))} ms; "
        f"CPU ms per pull: {cpu}",
    ]
    step = result.get("step")
    if step:  # the hops with one message per engine step on each, beside one per pull
        per_pull = ", ".join(f"{name} {seconds / step['pulls'] * 1e3:.3f}" for name, seconds in step["cpu_s"].items())
        out.append(
            f"  one message per step of {step['batch']} on every hop, steps one after the other: "
            f"{step['pulls'] / step['wall_s']:.0f} pulls/s ({step['steps']} steps, p50 {_ms(median(step['step_s']))} "
            f"ms a step, p99 {_ms(percentile(step['step_s'], 99))} ms); CPU ms per pull: {per_pull}"
        )
    return out


def idle_table(result: dict[str, Any]) -> list[str]:
    percent = result["core_percent"]
    return [
        f"idle daemons (no engine pulling; {result['wall_s']:.1f} s sampled after {result['settle_s']:.1f} s "
        "without a pull), % of one core: "
        + ", ".join(f"{name} {value:.2f} %" for name, value in percent.items())
        + f"; the client beside them {result['client_core_percent']:.2f} %"
    ]


def first_contact_table(result: dict[str, Any]) -> list[str]:
    first, later = result["first_s"], result["later_s"]
    return [
        f"first pull to a new peer: {', '.join(_ms(s) for s in first)} ms; later pulls p50 {_ms(median(later))} ms; "
        f"extra {_ms(median(first) - median(later))} ms (median)"
    ]


def conversion_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "layout pairs (in-process NIXL loopback, plan as the daemon plans; conversion vs copy_ of the same bytes)",
        f"{'pair':30} {'mode':>6} {'descs':>6} {'MiB':>5} {'conv GB/s':>9} {'copy GB/s':>9} {'÷copy_':>6} "
        f"{'pull GB/s':>9} {'÷same':>6}",
    ]
    for row in rows:
        conv = (
            f"{row['convert_gbs']:9.1f} {row['copy_gbs']:9.1f} {row['vs_copy']:6.2f}"
            if "vs_copy" in row
            else (f"{'-':>9} {'-':>9} {'-':>6}")
        )
        pull = f"{row['pull_gbs']:9.1f} {row['vs_same_layout']:6.2f}" if "pull_gbs" in row else f"{'-':>9} {'-':>6}"
        out.append(
            f"{row['pair'][:30]:30} {row['mode']:>6} {row['descriptors']:6d} {row['bytes'] >> 20:5d} {conv} {pull}"
        )
    return out


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")


def write_plots(directory: Path, result: dict[str, Any]) -> list[Path]:
    """throughput vs size (raw NIXL beside it), latency CDFs, scaling with concurrency."""
    import matplotlib  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written: list[Path] = []
    machine = result.get("machine", {}).get("summary", "")
    sizes = result.get("sizes") or []
    if sizes:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        mib = [row["size_bytes"] >> 20 for row in sizes]
        ax.plot(mib, [row["size_bytes"] / median(row["kvd_s"]) / GB for row in sizes], "o-", label="kvd pull")
        ax.plot(mib, [row["size_bytes"] / median(row["raw_s"]) / GB for row in sizes], "s--", label="raw NIXL read")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("pull size (MiB)")
        ax.set_ylabel("GB/s (median)")
        ax.set_title(f"throughput vs size\n{machine}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, directory / "throughput.png"))
    levels = result.get("concurrency") or []
    overhead = result.get("overhead")
    if levels or overhead:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for row in levels:
            lat = sorted(row["latency_s"])
            ax.plot(
                [s * 1e3 for s in lat],
                [(i + 1) / len(lat) for i in range(len(lat))],
                label=f"{row['in_flight']} in flight",
            )
        if overhead:
            over = sorted(overhead["overhead_s"])
            ax.plot(
                [s * 1e3 for s in over],
                [(i + 1) / len(over) for i in range(len(over))],
                "k--",
                label="control overhead (1)",
            )
        ax.set_xscale("log")
        ax.set_xlabel("ms (2 MiB pulls)")
        ax.set_ylabel("fraction of pulls")
        ax.set_title(f"latency CDF\n{machine}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        written.append(_save(fig, directory / "latency_cdf.png"))
    if levels:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        n = [row["in_flight"] for row in levels]
        ax.plot(n, [row["pulls"] / row["wall_s"] for row in levels], "o-", label="pulls/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("pulls in flight")
        ax.set_ylabel("pulls/s (2 MiB)")
        ax2 = ax.twinx()
        ax2.plot(n, [percentile(row["latency_s"], 99) * 1e3 for row in levels], "r^--", label="p99 ms")
        ax2.set_ylabel("p99 latency (ms)", color="r")
        ax.set_title(f"scaling with concurrency\n{machine}", fontsize=9)
        ax.grid(True, alpha=0.3)
        written.append(_save(fig, directory / "concurrency.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
