"""`kvd bench`: kvd pulls against raw NIXL reads of the same bytes, side by side, in one run.

Starts two daemons on loopback (and, for first-contact samples, fresh holders), registers an
engine on one, and measures (see :mod:`kvd.bench.runs`): pull vs raw NIXL by size, the control
overhead distribution, engine steps of 8 and 32 pulls (StartPull each vs one StartPulls, each
step beside the same READs from a bare NIXL agent, and the control CPU per pull), 2 MiB
pulls with 1..64 in flight and every process's CPU per pull, a router's pulls at 32 in flight
waited on one WatchTransfers stream beside the engine's path, the same hops with no kvd logic in
them (the control path's floor, :mod:`kvd.bench.floor`: one message per pull, then one per step
of 32, on every hop), the cost of a first contact, the
daemons' CPU while idle, and the layout-conversion pairs
(:mod:`kvd.bench.convert`). Prints the tables (a progress bar meanwhile) and the goals table
(:mod:`kvd.bench.goals`), writes ``bench.json`` with every sample and PNG plots into ``--out``.
``--quick`` is the small configuration (under two minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the rig imports grpc, numpy, torch: loaded when the bench runs, not for `kvd --help`
    from kvd.bench import report


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    sizes_mb: tuple[int, ...]
    size_samples: int
    overhead_samples: int
    levels: tuple[int, ...]
    pulls_per_level: int
    fresh_peers: int
    later_pulls: int
    convert_tokens: int
    convert_repeat: int
    idle_s: float  # the idle daemons' sampling window (0: no idle section)
    idle_settle_s: float  # without a pull before the window opens
    batches: tuple[int, ...] = (8, 32)  # pulls per engine step in the batched section (empty: none)
    floor_pulls: int = 2000  # pulls through the floor's hops at 32 in flight (0: no floor section)
    router_pulls: int = 256  # pulls per path and round in the router section, 32 in flight (0: none)
    router_rounds: int = 3  # the router section's rounds (each path once per round, each first once)


QUICK = BenchConfig((2, 8, 32, 128), 9, 100, (1, 4, 16, 32, 64), 256, 1, 10, 128, 5, 3.0, 1.0)
FULL = BenchConfig(
    (2, 8, 32, 128, 512),
    10,
    300,
    (1, 2, 4, 8, 16, 32, 64),
    1000,
    2,
    20,
    1024,
    5,
    10.0,
    1.0,
    floor_pulls=6000,
    router_pulls=1000,
)
FLOOR_IN_FLIGHT = 32  # the level of the pulls/s goal
FLOOR_STEP = 32  # pulls per step in the floor's one-message-per-step mode: the step goal's (issue 40)
ROUTER_IN_FLIGHT = 32  # the level of the router path's goal (issue 40)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small configuration (< 2 min on 2 cores)")
    parser.add_argument(
        "--out", default="", help="directory for bench.json and the plots (default: ./kvd-bench-<time>)"
    )
    parser.add_argument("--sizes-mb", default="", help="pull sizes in MiB, comma-separated (multiples of 2)")
    parser.add_argument("--levels", default="", help="pulls in flight, comma-separated (default 1..64)")
    parser.add_argument(
        "--batch",
        default="",
        help="pulls per engine step for the batched section, comma-separated: B StartPull calls vs one "
        "StartPulls (default 8,32; 0: skip)",
    )
    parser.add_argument("--pulls-per-level", type=int, default=0, help="2 MiB pulls per concurrency level")
    parser.add_argument("--samples", type=int, default=0, help="pulls (and raw reads) per size")
    parser.add_argument("--overhead-samples", type=int, default=0, help="pull/raw pairs for the control overhead")
    parser.add_argument("--fresh-peers", type=int, default=-1, help="extra holders started for first-contact samples")
    parser.add_argument("--convert-tokens", type=int, default=-1, help="request size of the conversion pairs (0: skip)")
    parser.add_argument(
        "--idle-s",
        type=float,
        default=-1.0,
        help="seconds the idle daemons' CPU is sampled (0: skip; quick 3, full 10)",
    )
    parser.add_argument(
        "--floor-pulls",
        type=int,
        default=-1,
        help="pulls through the control path's hops with no kvd logic, 32 in flight, then as many in steps of 32 "
        "(one message per step on every hop), to show the path's floor beside the goals (0: skip; quick 2000, "
        "full 6000)",
    )
    parser.add_argument(
        "--router-pulls",
        type=int,
        default=-1,
        help="pulls per path and round in the router section (a router's pulls at 32 in flight waited on one "
        "WatchTransfers stream, beside the engine's path and a WatchTransfer stream per pull; 0: skip; "
        "quick 256, full 1000)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def config_from(args: argparse.Namespace) -> BenchConfig:
    base = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.sizes_mb:
        changes["sizes_mb"] = _ints(args.sizes_mb)
    if args.levels:
        changes["levels"] = _ints(args.levels)
    if args.batch:
        changes["batches"] = tuple(b for b in _ints(args.batch) if b)
    for flag, field in (
        ("pulls_per_level", "pulls_per_level"),
        ("samples", "size_samples"),
        ("overhead_samples", "overhead_samples"),
    ):
        if getattr(args, flag) > 0:
            changes[field] = getattr(args, flag)
    if args.fresh_peers >= 0:
        changes["fresh_peers"] = args.fresh_peers
    if args.convert_tokens >= 0:
        changes["convert_tokens"] = args.convert_tokens
    if args.idle_s >= 0:
        changes["idle_s"] = args.idle_s
    if args.floor_pulls >= 0:
        changes["floor_pulls"] = args.floor_pulls
    if args.router_pulls >= 0:
        changes["router_pulls"] = args.router_pulls
    config = dataclasses.replace(base, **changes)
    bad = [s for s in config.sizes_mb if s < 2 or s % 2 or s > 1024]
    if bad or any(n < 1 for n in config.levels) or any(b < 1 or b > 1024 for b in config.batches):
        raise ValueError(f"sizes must be even MiB in 2..1024, levels >= 1, batches in 1..1024 (got sizes {bad})")
    return config


def machine() -> dict[str, Any]:
    """What the figures were measured on: they mean little without it."""
    import torch  # noqa: PLC0415

    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = os.cpu_count() or 0
    load = os.getloadavg()
    # The daemons the bench starts take their config from this environment (KVD_*): the copy
    # threads change the large-pull figures, so they are part of what was measured.
    from kvd.config import load_config  # noqa: PLC0415

    daemon_config = load_config()
    copy_threads = daemon_config.copy_threads
    # Likewise the engine stream's transport: the framed socket, or gRPC (engine_stream_socket).
    engine_stream = "framed socket" if daemon_config.engine_stream_socket else "gRPC"
    summary = (
        f"{cores} cores ({cpu}), load {load[0]:.1f} at start, host memory, "
        f"{copy_threads} copy thread{'s' if copy_threads > 1 else ''} per READ, engine stream over {engine_stream}"
    )
    return {
        "summary": summary,
        "cpu": cpu,
        "cores": cores,
        "load_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": bool(torch.cuda.is_available()),
        "copy_threads": copy_threads,
        "engine_stream": engine_stream,
    }


async def _daemon_runs(config: BenchConfig, workdir: Path, bar: report.ProgressBar) -> dict[str, Any]:
    from kvd.bench import floor, report, runs  # noqa: PLC0415
    from kvd.bench.cpu import cpu_seconds  # noqa: PLC0415
    from kvd.bench.rig import BLOCK_BYTES, Engine, RawReader, start_daemons, wait_settled  # noqa: PLC0415
    from kvd_client.aio import AsyncKvdClient  # noqa: PLC0415

    result: dict[str, Any] = {}
    sections: dict[str, float] = result.setdefault("section_s", {})
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        sections[name] = now - mark
        mark = now

    with contextlib.ExitStack() as stack:
        daemons = start_daemons(stack, workdir, config.fresh_peers)
        lap("start daemons")
        waited_s, settled = await wait_settled(daemons)
        result["settle"] = {"waited_s": waited_s, "settled": settled}
        _show(bar, report.settle_line(waited_s, settled))
        lap("settle")
        largest = max((*config.sizes_mb, 2)) << 20
        router_blocks = ROUTER_IN_FLIGHT if config.router_pulls > 0 else 0
        capacity = max(largest // BLOCK_BYTES, max(config.levels), max(config.batches, default=0), router_blocks, 2)
        async with (
            AsyncKvdClient(daemons.local.unix_target, timeout_s=120) as local,
            AsyncKvdClient(daemons.peer.tcp, timeout_s=120) as peer,
            AsyncKvdClient(daemons.local.tcp, timeout_s=120) as router,
        ):
            engine = Engine(local, capacity)
            await engine.open()
            result["engine_stream_framed"] = engine.framed
            raw = RawReader(capacity * BLOCK_BYTES)  # a slot per block: a raw step of the largest batch
            logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL's import set it to INFO
            try:
                session = runs.Session(daemons, local, peer, engine, raw)
                # First contact first: the fresh holders have never been pulled from.
                if daemons.fresh:
                    result["first_contact"] = await runs.first_contact(session, daemons.fresh, config.later_pulls, bar)
                    _show(bar, report.first_contact_table(result["first_contact"]))
                    lap("first contact")
                result["overhead"] = await runs.overhead(session, config.overhead_samples, bar)
                _show(bar, report.overhead_table(result["overhead"]))
                lap("overhead")
                result["sizes"] = await runs.sizes(session, list(config.sizes_mb), config.size_samples, bar)
                _show(bar, report.size_table(result["sizes"]))
                lap("sizes")
                if config.batches:
                    result["batched"] = await runs.batched(session, list(config.batches), config.pulls_per_level, bar)
                    _show(bar, report.batched_table(result["batched"]))
                    lap("batched")
                if config.router_pulls > 0:  # a router's pulls, beside the engine's, in the same windows
                    result["router"] = await runs.router_path(
                        session, router, ROUTER_IN_FLIGHT, config.router_pulls, config.router_rounds, bar
                    )
                    _show(bar, report.router_table(result["router"]))
                    lap("router")
                result["concurrency"] = await runs.concurrency(
                    session, list(config.levels), config.pulls_per_level, bar
                )
                _show(bar, report.concurrency_table(result["concurrency"]))
                lap("concurrency")
                if config.floor_pulls > 0:  # the same hops with nothing of kvd in them (kvd.bench.floor)
                    try:
                        result["floor"] = await floor.measure(
                            workdir,
                            config.overhead_samples,
                            FLOOR_IN_FLIGHT,
                            config.floor_pulls,
                            cpu_seconds,
                            bar,
                            step_pulls=FLOOR_STEP,
                            steps=max(4, config.floor_pulls // FLOOR_STEP),
                        )
                        _show(bar, report.floor_table(result["floor"]))
                    except floor.FloorFailure as exc:  # kvd's figures stand without it
                        _show(bar, [f"the control path's floor: not measured ({exc})"])
                    lap("floor")
                if config.idle_s > 0:  # last: every pull of the run has finished
                    result["idle"] = await runs.idle(session, config.idle_s, config.idle_settle_s, bar)
                    _show(bar, report.idle_table(result["idle"]))
                    lap("idle")
            finally:
                await engine.close()
                raw.close()
    return result


def _show(bar: report.ProgressBar, lines: list[str]) -> None:
    bar.clear()
    print("\n".join(lines), flush=True)
    print(flush=True)


def run_bench(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"kvd bench: {exc}", file=sys.stderr)
        return 2
    from kvd.bench import goals, leftovers, report, runs  # noqa: PLC0415
    from kvd_client import errors  # noqa: PLC0415

    files, freed = leftovers.remove_dead_runs_files()
    if files:
        print(
            f"kvd bench: removed {files} shared-memory file(s) of earlier runs that ended without removing them "
            f"({freed / (1 << 30):.1f} GiB)",
            flush=True,
        )

    out = Path(args.out or f"kvd-bench-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    bar = report.ProgressBar()
    started = time.perf_counter()
    result: dict[str, Any] = {"machine": machine(), "config": dataclasses.asdict(config)}
    print(f"kvd bench{' --quick' if args.quick else ''} on {result['machine']['summary']}", flush=True)
    code = 0
    try:
        with tempfile.TemporaryDirectory(prefix="kvd-bench-") as workdir:
            result.update(asyncio.run(_daemon_runs(config, Path(workdir), bar)))
        if config.convert_tokens > 0:
            import torch  # noqa: PLC0415

            from kvd.bench import convert  # noqa: PLC0415

            t0 = time.perf_counter()
            result["conversions"] = convert.measure_pairs(
                config.convert_tokens, config.convert_repeat, 4096, torch.device("cpu"), convert.nixl_available(), bar
            )
            result["section_s"]["conversions"] = time.perf_counter() - t0
            _show(bar, report.conversion_table(result["conversions"]))
    except (runs.BenchFailure, errors.KvdError) as exc:
        bar.clear()
        print(f"kvd bench: FAIL: {exc}", file=sys.stderr)
        code = 1
    result["elapsed_s"] = time.perf_counter() - started
    result["machine"]["load_at_end"] = os.getloadavg()
    measured = goals.evaluate(result) if code == 0 else []  # a failed run's figures mean nothing
    if measured:
        result["goals"] = goals.as_json(measured)
    report.write_json(out / "bench.json", result)
    written = [] if args.no_plots or code else report.write_plots(out, result)
    if measured:
        print("\n".join(goals.table(measured)))
    print(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in written) + f" in {result['elapsed_s']:.0f} s")
    return code
