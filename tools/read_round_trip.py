"""A READ's round trip through real data-plane workers: orders on their own socket against orders
on the channel, alternated READ by READ in one run (the machine's noise hits both alike).

One holder worker and two reader workers (one per way, ``dataplane_orders_socket`` on and off),
each behind its own :class:`kvd.core.dataplane.DataPlane`, real NIXL over the default UCX
transports. Each READ is 2 MiB as 64 descriptors of 32 KiB (the bench's 2 MiB pull); its time runs
from ``DataPlane.read`` to the READ final, bytes checked at the end. ``--fast`` keeps the holder's
worker polling fast throughout, as an admission does (it then takes CPU beside the readers).

    .venv/bin/python tools/read_round_trip.py --reads 400 [--fast]

Figures: docs/performance.md, "READ orders read by the NIXL thread itself".
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import torch

from kvd.core.dataplane import LOCAL, DataPlane, XferState
from kvd.core.workers import WorkerLauncher
from kvd.dataplane_protocol import MappedRegion, MemoryKind, RegionRequest
from kvd_client.shm import create_shm_tensor, new_shm_name, unlink_shm

BLOCK = 32 << 10
BLOCKS = 64
SIZE = BLOCK * BLOCKS
WAYS = {"orders socket": True, "orders on the channel": False}


async def _plane(name: str, orders_socket: bool) -> tuple[DataPlane, WorkerLauncher]:
    launcher = WorkerLauncher(name, ("UCX",), False, "WARNING", 0.0002, spare=False, orders_socket=orders_socket)
    plane = DataPlane(launcher=launcher, heartbeat_timeout_s=30.0)
    await plane.start(lambda _: None)
    return plane, launcher


async def _expose(plane: DataPlane, shm_name: str) -> MappedRegion:
    (region,) = await plane.open_regions([RegionRequest(MemoryKind.SHM, SIZE, shm_name=shm_name)])
    await plane.register(region.address, SIZE, 0, "DRAM")
    return region


def _rows(region: MappedRegion) -> np.ndarray:
    addresses = region.address + BLOCK * np.arange(BLOCKS, dtype=np.int64)
    return np.stack([addresses, np.full(BLOCKS, BLOCK, np.int64), np.zeros(BLOCKS, np.int64)], axis=1)


async def _run(reads: int, fast: bool) -> None:
    names = [new_shm_name("kvd-rtt") for _ in range(1 + len(WAYS))]
    memory = [create_shm_tensor(name, SIZE) for name in names]
    memory[0].copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8))
    started: list[tuple[DataPlane, WorkerLauncher]] = []
    try:
        holder, launcher = await _plane("rtt-holder", True)
        started.append((holder, launcher))
        held = await _expose(holder, names[0])
        if fast:
            holder.fast_poll_until = time.monotonic() + 3600.0
        readers = {}
        for index, (way, orders_socket) in enumerate(WAYS.items()):
            plane, launcher = await _plane(f"rtt-reader-{index}", orders_socket)
            started.append((plane, launcher))
            landed = await _expose(plane, names[1 + index])
            await plane.add_remote(holder.identity().metadata)
            remote = await asyncio.to_thread(plane.prepare_table, holder.name, _rows(held), "DRAM")
            local = await asyncio.to_thread(plane.prepare_table, LOCAL, _rows(landed), "DRAM")
            readers[way] = (plane, local, remote)
        indices = np.arange(BLOCKS, dtype=np.int32)
        times: dict[str, list[float]] = {way: [] for way in readers}
        for _ in range(reads):
            for way, (plane, local, remote) in readers.items():
                began = time.perf_counter()
                xfer = await plane.read(local, indices, remote, indices, b"", holder.name, SIZE)
                await plane.wait([xfer])
                times[way].append(time.perf_counter() - began)
                if xfer.state is not XferState.DONE:
                    raise SystemExit(f"a READ ({way}) ended {xfer.state}: {xfer.error}")
                await asyncio.sleep(0.002)  # one READ at a time, as one pull at a time
        for index, way in enumerate(readers):
            if not torch.equal(memory[1 + index], memory[0]):
                raise SystemExit(f"the bytes read ({way}) differ from the holder's")
            ordered = sorted(times[way])
            p10, p90 = ordered[len(ordered) // 10], ordered[9 * len(ordered) // 10]
            print(
                f"{way:22} p50 {statistics.median(ordered) * 1e3:.3f} ms "
                f"(p10 {p10 * 1e3:.3f}, p90 {p90 * 1e3:.3f}) over {len(ordered)} READs"
            )
    finally:
        for plane, launcher in reversed(started):
            await plane.stop()
            await launcher.close()
        for name in names:
            unlink_shm(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=400, help="READs per way")
    parser.add_argument("--fast", action="store_true", help="the holder's worker polls fast throughout")
    args = parser.parse_args()
    asyncio.run(_run(args.reads, args.fast))


if __name__ == "__main__":
    main()
