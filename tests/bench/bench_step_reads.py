"""Benchmark: an engine step's pulls as one NIXL transfer per holder engine (``step_reads``) against
a transfer per pull, in the same run, from a holder engine whose leases hold distinct blocks.

    python tests/bench/bench_step_reads.py [--steps 30] [--batch 32]

Three real daemons on loopback: one holder, with a Llama-8B-shaped shm engine registered and
filled with random bytes, and two readers identical but for ``step_reads``, each with an engine
of its own. Every step holds ``--batch`` one-block requests on the holder (HoldBlocks, as a
prefill engine holds finished requests) and pulls them with one StartPulls into consecutive
local blocks; the ways take turns step by step, so the machine's noise hits both. Two patterns
of holder blocks: ``adjacent`` (the step's requests in consecutive blocks, as a fresh block
allocator hands them out) and ``scattered`` (a random choice). Every pulled block is compared
with the holder's. Prints, per pattern and way: pulls/s (median over steps), p50 step time, and
the reader's CPU per pull (control process and its worker together).

(``kvd bench``'s batched section reads one scratch block per lease, the same block for every
pull of a step: nothing there is adjacent, so it shows the one transfer per step but not merged
blocks.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvd.bench.cpu import cpu_seconds
from kvd.bench.rig import Engine
from kvd.spawn import child_env, launch_daemon, stop_launches, wait_ready
from kvd_client.aio import AsyncKvdClient

WAYS = {"step reads": "true", "a transfer per pull": "false"}
PATTERNS = ("adjacent", "scattered")


async def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(7)
    holder_blocks = max(4 * args.batch, 64)
    with contextlib.ExitStack() as stack:
        names = ["holder", *WAYS]
        envs = [None, *(child_env(KVD_STEP_READS=v) for v in WAYS.values())]
        launches = [launch_daemon(workdir, f"d{i}", ["--log-level", "WARNING"], env=env) for i, env in enumerate(envs)]
        stack.callback(stop_launches, launches)
        daemons = dict(zip(names, (wait_ready(launch, ready_timeout_s=120.0) for launch in launches), strict=True))
        async with contextlib.AsyncExitStack() as astack:
            holder_client = await astack.enter_async_context(
                AsyncKvdClient(daemons["holder"].unix_target, timeout_s=120)
            )
            holder = Engine(holder_client, holder_blocks)
            await holder.open()
            astack.push_async_callback(holder.close)
            holder.buffer.copy_(torch.from_numpy(rng.integers(0, 256, holder.buffer.numel(), dtype=np.uint8)))
            engines: dict[str, Engine] = {}
            for way in WAYS:
                client = await astack.enter_async_context(AsyncKvdClient(daemons[way].unix_target, timeout_s=120))
                engines[way] = Engine(client, args.batch)
                await engines[way].open()
                astack.push_async_callback(engines[way].close)
            rates: dict[tuple[str, str], list[float]] = {}
            step_s: dict[tuple[str, str], list[float]] = {}
            cpu: dict[tuple[str, str], float] = {}
            serial = 0
            for step in range(args.steps + 1):  # the first step of each warms up
                for pattern in PATTERNS:
                    if pattern == "adjacent":
                        start = int(rng.integers(0, holder_blocks - args.batch + 1))
                        blocks = list(range(start, start + args.batch))
                    else:
                        blocks = [int(b) for b in rng.choice(holder_blocks, args.batch, replace=False)]
                    for way, engine in engines.items():
                        params = []
                        for block in blocks:
                            serial += 1
                            held = await holder_client.hold_blocks(
                                engine_id=holder.engine_id, request_id=f"r{serial}", block_ids=[block], num_tokens=16
                            )
                            params.append(held.kv_transfer_params)
                        engine.zero_blocks(0, args.batch)
                        pid = daemons[way].process.pid
                        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                        await engine.pull_step(params, 0, batched=True)
                        wall, used = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
                        for i, block in enumerate(blocks):
                            if not torch.equal(engine.blocks(i, 1), holder.blocks(block, 1)):
                                raise SystemExit(f"{way}: local block {i} is not holder block {block}")
                        if step:
                            key = (pattern, way)
                            rates.setdefault(key, []).append(args.batch / wall)
                            step_s.setdefault(key, []).append(wall)
                            cpu[key] = cpu.get(key, 0.0) + used
    pulls = args.steps * args.batch
    return {
        "batch": args.batch,
        "steps": args.steps,
        "rows": [
            {
                "pattern": pattern,
                "way": way,
                "pulls_per_s_median": statistics.median(rates[(pattern, way)]),
                "step_p50_ms": statistics.median(step_s[(pattern, way)]) * 1e3,
                "reader_cpu_ms_per_pull": cpu[(pattern, way)] / pulls * 1e3,
            }
            for pattern in PATTERNS
            for way in WAYS
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvd-step-reads-") as workdir:
        report = asyncio.run(_run(args, Path(workdir)))
    print(f"steps of {args.batch} one-block (2 MiB) pulls, {args.steps} per pattern and way, bytes checked")
    print(f"{'pattern':10s} {'way':20s} {'pulls/s':>8s} {'step p50 ms':>12s} {'reader CPU ms/pull':>19s}")
    for row in report["rows"]:
        print(
            f"{row['pattern']:10s} {row['way']:20s} {row['pulls_per_s_median']:8.0f} {row['step_p50_ms']:12.2f} "
            f"{row['reader_cpu_ms_per_pull']:19.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
