"""What a pull into engine blocks no pull has touched costs, with the worker's pre-fault on and off.

``python tests/bench/bench_fresh_blocks.py [--blocks 64] [--rounds 3] [--repeat 2]`` starts two
real daemons per setting (``prefault_host_memory`` true, then false, alternating ``--repeat``
times so both see the same machine), registers a Llama-shaped shm engine on each (2 MiB blocks;
the engines write their whole cache first, as an engine's is resident), makes one pull to get
past first contact, waits for the pre-fault to finish, then per round pulls ``--blocks`` blocks
into blocks no pull has touched ("fresh") and the same blocks again ("again"). Prints the
medians per setting; every pull's bytes are checked. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtest import ShmEngine, llama_spec

from kvd.spawn import start_daemon
from kvd_client.v1 import common_pb2


def _pull(holder: ShmEngine, reader: ShmEngine, request: str, blocks: list[int]) -> float:
    tokens = 16 * len(blocks)
    params = holder.client.hold_blocks(
        engine_id=holder.engine_id, request_id=request, block_ids=blocks, num_tokens=tokens
    ).kv_transfer_params
    started_at = time.perf_counter()
    started = reader.client.start_pull(
        engine_id=reader.engine_id, tp_rank=0, request_id=request, local_block_ids=blocks, remote=params
    )
    status = reader.client.wait_transfer(started.transfer_id, timeout_s=120)
    elapsed = time.perf_counter() - started_at
    if status.state != common_pb2.TRANSFER_STATE_DONE:
        raise SystemExit(f"pull {request} ended {status.state}")
    if not reader.token_bytes(blocks, tokens).equal(holder.token_bytes(blocks, tokens)):
        raise SystemExit(f"pull {request} delivered wrong bytes")
    return elapsed * 1e3


def _measure(prefault: bool, blocks: int, rounds: int, settle_s: float) -> tuple[float, float]:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-fresh-"))
    env = {"KVD_PREFAULT_HOST_MEMORY": "true" if prefault else "false"}
    daemons = [start_daemon(workdir, "holder", env=env), start_daemon(workdir, "reader", env=env)]
    spec = llama_spec(num_blocks=blocks * (rounds + 1))
    holder = ShmEngine(daemons[0].unix_target, "p", spec)
    reader = ShmEngine(daemons[1].unix_target, "d", spec)
    try:
        holder.fill_random(seed=1)
        reader.fill(0)
        holder.register()
        reader.register()
        _pull(holder, reader, "contact", list(range(blocks)))
        time.sleep(settle_s)
        fresh, again = [], []
        for r in range(1, rounds + 1):
            ids = list(range(r * blocks, (r + 1) * blocks))
            fresh.append(_pull(holder, reader, f"fresh-{r}", ids))
            again.append(_pull(holder, reader, f"again-{r}", ids))
        return statistics.median(fresh), statistics.median(again)
    finally:
        holder.close()
        reader.close()
        for daemon in daemons:
            daemon.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64, help="blocks of 2 MiB per pull (default 64: 128 MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="times each setting runs, alternating")
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait after the first pull (the pre-fault)")
    args = parser.parse_args()
    print(f"{args.blocks * 2} MiB per pull, median of {args.rounds} rounds; ms")
    print(f"{'prefault':>9} {'fresh':>8} {'again':>8}")
    for _ in range(args.repeat):
        for prefault in (True, False):
            fresh, again = _measure(prefault, args.blocks, args.rounds, args.settle_s)
            print(f"{'on' if prefault else 'off':>9} {fresh:8.1f} {again:8.1f}", flush=True)


if __name__ == "__main__":
    main()
