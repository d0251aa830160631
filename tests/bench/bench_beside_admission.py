"""Benchmark: a pull whose READ is posted beside the holder's admission against one that waits
for the admission first (``read_beside_admission`` on and off), in the same run.

    python tests/bench/bench_beside_admission.py [--samples 200] [--steps 20] [--batch 32]

Three real daemons on loopback: one holder (its scratch cache, a fresh lease per pull) and two
readers, identical but for ``read_beside_admission``, each with an engine registered the way an
engine registers. Samples are interleaved (beside, admission first, raw NIXL read of the same
bytes, ...) so that the machine's noise hits all three alike; every pull's bytes are checked.
Prints, per way: 2 MiB pull latency p50/p90 and its control overhead (pull - raw, pair by pair),
then batched engine steps of ``--batch`` 2 MiB pulls (one StartPulls each): pulls/s and p50.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvd.bench.rig import BLOCK_BYTES, Engine, RawReader, hold_many, scratch_engine_id
from kvd.spawn import child_env, launch_daemon, stop_launches, wait_ready
from kvd_client.aio import AsyncKvdClient

WAYS = {"beside": "true", "admission first": "false"}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kvd.core import scratch

    seed = 12345
    with contextlib.ExitStack() as stack:
        names = ["holder", *WAYS]
        envs = [None, *(child_env(KVD_READ_BESIDE_ADMISSION=v) for v in WAYS.values())]
        launches = [launch_daemon(workdir, f"d{i}", ["--log-level", "WARNING"], env=env) for i, env in enumerate(envs)]
        stack.callback(stop_launches, launches)
        daemons = dict(zip(names, (wait_ready(launch, ready_timeout_s=120.0) for launch in launches), strict=True))
        capacity = max(args.batch, 1)
        pattern = scratch.Pattern(BLOCK_BYTES, seed)
        async with contextlib.AsyncExitStack() as astack:
            holder = await astack.enter_async_context(AsyncKvdClient(daemons["holder"].tcp, timeout_s=120))
            engines: dict[str, Engine] = {}
            for way in WAYS:
                client = await astack.enter_async_context(AsyncKvdClient(daemons[way].unix_target, timeout_s=120))
                engines[way] = Engine(client, capacity)
                await engines[way].open()
                astack.push_async_callback(engines[way].close)
            raw = RawReader(BLOCK_BYTES)
            astack.callback(raw.close)
            first = await hold_many(holder, BLOCK_BYTES, seed, 1)
            await asyncio.get_running_loop().run_in_executor(
                None, raw.target, daemons["holder"].tcp, scratch_engine_id(first[0])
            )

            def check(engine: Engine, first_block: int, blocks: int) -> None:
                for b in range(first_block, first_block + blocks):
                    bad = pattern.mismatches(engine.blocks(b, 1))
                    if bad:
                        raise SystemExit(f"a pull delivered {bad} wrong bytes")

            latency: dict[str, list[float]] = {way: [] for way in WAYS}
            overhead: dict[str, list[float]] = {way: [] for way in WAYS}
            held = await hold_many(holder, BLOCK_BYTES, seed, 2 * (args.samples + 5))
            for i in range(args.samples + 5):  # the first 5 of each warm up
                for j, way in enumerate(WAYS):
                    engine = engines[way]
                    engine.zero_blocks(0, 1)
                    elapsed = await engine.pull(held[2 * i + j].kv_transfer_params, 0)
                    check(engine, 0, 1)
                    raw_s = raw.read()
                    if i >= 5:
                        latency[way].append(elapsed)
                        overhead[way].append(elapsed - raw_s)

            steps: dict[str, list[float]] = {way: [] for way in WAYS}
            step_latency: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(args.steps + 1):
                for way in WAYS:
                    engine = engines[way]
                    batch = await hold_many(holder, BLOCK_BYTES, seed, args.batch)
                    engine.zero_blocks(0, args.batch)
                    loop = asyncio.get_running_loop()
                    t0 = loop.time()
                    times = await engine.pull_step([h.kv_transfer_params for h in batch], 0, batched=True)
                    wall = loop.time() - t0
                    check(engine, 0, args.batch)
                    steps[way].append(args.batch / wall)
                    step_latency[way].extend(times)
    report: dict[str, Any] = {"samples": args.samples, "steps": args.steps, "batch": args.batch, "ways": {}}
    for way in WAYS:
        report["ways"][way] = {
            "pull_p50_ms": statistics.median(latency[way]) * 1e3,
            "pull_p90_ms": _pct(latency[way], 0.9) * 1e3,
            "overhead_p50_ms": statistics.median(overhead[way]) * 1e3,
            "step_pulls_per_s_median": statistics.median(steps[way][1:]),
            "step_pull_p50_ms": statistics.median(step_latency[way]) * 1e3,
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvd-beside-") as workdir:
        report = asyncio.run(_run(args, Path(workdir)))
    for way, row in report["ways"].items():
        print(
            f"{way:16s} 2 MiB pull p50 {row['pull_p50_ms']:.2f} ms (p90 {row['pull_p90_ms']:.2f}), "
            f"control overhead p50 {row['overhead_p50_ms']:.2f} ms; steps of {args.batch}: "
            f"{row['step_pulls_per_s_median']:.0f} pulls/s, p50 {row['step_pull_p50_ms']:.2f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
