"""`kvd bench`: kvd pulls against raw NIXL reads of the same bytes, side by side, in one run.

Starts two daemons, then for each size pulls a checksummed scratch cache from one into an
engine registered on the other (every byte verified) and reads the same bytes with a bare NIXL
agent. Prints GB/s of both, their ratio, and the descriptors kvd posted.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
from pathlib import Path

from kvd.cli.selftest import PatternMismatch, measure_pull
from kvd.cli.spawn import start_owned
from kvd_client import KvdClient

SIZES_MB = (8, 32, 128, 512)


def run_bench(args: argparse.Namespace) -> int:
    sizes = [s for s in SIZES_MB if s <= max(args.size_mb, SIZES_MB[0])]
    print(f"kvd pull vs raw NIXL read, same bytes, same peer, {args.iterations} pulls each (median)")
    print(f"{'MiB':>6} {'descs':>6} {'kvd ms':>9} {'kvd GB/s':>9} {'raw ms':>9} {'raw GB/s':>9} {'ratio':>6}")
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-bench-")))
        local, peer = start_owned(stack, workdir, "local", "peer")
        local_client = stack.enter_context(KvdClient(local.unix_target, timeout_s=60))
        peer_client = stack.enter_context(KvdClient(peer.tcp, timeout_s=120))
        for size_mb in sizes:
            with contextlib.ExitStack() as per_size:
                try:
                    m = measure_pull(
                        per_size,
                        local_client,
                        peer_client,
                        peer.tcp,
                        size_mb << 20,
                        random.randrange(1, 1 << 30),
                        args.iterations,
                    )
                except PatternMismatch as exc:
                    print(f"FAIL: {exc}")
                    return 1
                print(
                    f"{m.nbytes / 2**20:6.0f} {m.descriptors:6d} {statistics.median(m.kvd_times) * 1e3:9.2f} "
                    f"{m.kvd_gbs:9.2f} {statistics.median(m.raw_times) * 1e3:9.2f} {m.raw_gbs:9.2f} {m.ratio:6.2f}"
                )
    return 0
