"""What an engine of many blocks costs kvd at registration and at first contact.

``python tests/bench/bench_large_engine.py [--blocks 20000] [--pulls 5]`` starts a holder and a
reader daemon and registers on each a Llama-8B-shaped engine of 32 layers cut to one KV head of
8 dims (so ``--blocks`` blocks fit in little memory while the descriptor tables are those of a
real engine of that many blocks: 64 planes). It prints:

* each registration's time (mapping, NIXL registration, the engine's whole-block table), beside
  a bare NIXL agent in this process registering the same shared memory (the baseline: what
  NIXL alone needs for the bytes);
* the first pull of 64 blocks from the holder (handshake, the holder's metadata, the reader's
  list over the holder's engine) and the median of ``--pulls`` later ones, bytes checked.

The tables are what grows with the number of blocks (docs/performance.md, "First contact with
real engine sizes"); the bytes moved do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_fresh_blocks import _pull
from kvtest import ShmEngine, llama_spec

from kvd.spawn import start_daemon

PULL_BLOCKS = 64


def _raw_registration_ms(engine: ShmEngine, agent: object) -> float:
    """A bare NIXL agent registering the engine's shared memory (this process maps it too)."""
    started = time.perf_counter()
    registration = agent.register_memory(  # type: ignore[attr-defined]
        [(engine.buffer.data_ptr(), engine.spec.total_bytes, 0, "")], "DRAM"
    )
    elapsed = (time.perf_counter() - started) * 1e3
    agent.deregister_memory(registration)  # type: ignore[attr-defined]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--pulls", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvd-large-"))
    daemons = [start_daemon(workdir, "holder"), start_daemon(workdir, "reader")]
    spec = llama_spec(num_blocks=args.blocks, num_kv_heads=1, head_dim=8)
    holder = ShmEngine(daemons[0].unix_target, "p", spec)
    reader = ShmEngine(daemons[1].unix_target, "d", spec)
    try:
        holder.fill_random(seed=1)
        reader.fill(0)
        from nixl import _api as api

        raw = api.nixl_agent(f"raw-{os.getpid()}", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        print(f"engine: {args.blocks} blocks, {spec.total_bytes >> 20} MiB, 64 planes")
        for name, engine in (("holder", holder), ("reader", reader)):
            started = time.perf_counter()
            engine.register()
            took = (time.perf_counter() - started) * 1e3
            print(
                f"{name} registration: {took:8.1f} ms; a bare NIXL registration of the same memory "
                f"{_raw_registration_ms(engine, raw):6.1f} ms"
            )
        first = _pull(holder, reader, "first", list(range(PULL_BLOCKS)))
        later = [
            _pull(holder, reader, f"later-{i}", list(range(PULL_BLOCKS * (i + 1), PULL_BLOCKS * (i + 2))))
            for i in range(args.pulls)
        ]
        print(
            f"pull of {PULL_BLOCKS} blocks: first {first:8.1f} ms, later p50 {statistics.median(later):6.1f} ms "
            f"(first contact +{first - statistics.median(later):.1f} ms)"
        )
    finally:
        for engine in (holder, reader):
            engine.close()
        for daemon in daemons:
            daemon.terminate()


if __name__ == "__main__":
    main()
