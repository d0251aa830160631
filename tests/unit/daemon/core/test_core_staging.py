"""kvd.core.staging: the bounded, first-fit staging pool (with a fake data plane: no NIXL)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from kvd.core.staging import ALIGN, StagingPool
from kvd.dataplane_protocol import MappedRegion
from kvd_client.errors import ResourceExhausted


class FakeDataPlane:
    """Records the worker calls StagingPool makes: allocate, register, deregister, close."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, int, str]] = []
        self.deregistered: list[Any] = []
        self.buffers: dict[int, torch.Tensor] = {}
        self.closed: list[int] = []

    async def open_staging(self, size: int, device: str) -> MappedRegion:
        buffer = torch.empty(size, dtype=torch.uint8, device=torch.device(device))
        region_id = len(self.buffers) + 1
        self.buffers[region_id] = buffer
        return MappedRegion(region_id, int(buffer.data_ptr()), size, 0, False)

    async def close_regions(self, region_ids: list[int], keep_readable_s: float = 0.0) -> None:
        self.closed.extend(region_ids)

    async def register(self, address: int, size: int, device_index: int, mem_type: str) -> object:
        self.registered.append((address, size, device_index, mem_type))
        return ("registration", address)

    async def deregister(self, registration: object) -> None:
        self.deregistered.append(registration)


def _pool(size: int = 8 * ALIGN) -> tuple[StagingPool, FakeDataPlane]:
    dp = FakeDataPlane()
    buffer = torch.empty(size, dtype=torch.uint8)
    dp.buffers[1] = buffer
    return StagingPool(dp, MappedRegion(1, int(buffer.data_ptr()), size, 0, False)), dp  # type: ignore[arg-type]


def test_pool_registers_its_buffer_once_and_deregisters_on_close() -> None:
    """The buffer is registered as DRAM once at creation, and deregistered by close()."""

    async def main() -> None:
        dp = FakeDataPlane()
        pool = await StagingPool.open(dp, 4096, "cpu")  # type: ignore[arg-type]
        assert dp.registered == [(pool.address, 4096, 0, "DRAM")]
        buffer = dp.buffers[pool.region_id]
        assert buffer.numel() == 4096 and buffer.data_ptr() == pool.address
        await pool.close()
        assert dp.deregistered == [("registration", pool.address)] and dp.closed == [pool.region_id]
        await pool.close()
        assert len(dp.deregistered) == 1, "a second close deregistered again"

    asyncio.run(main())


def test_chunks_are_aligned_views_of_the_buffer() -> None:
    """A request is rounded up to ALIGN; the chunk's offset and address point into the pool."""

    async def main() -> None:
        pool, _ = _pool()
        a = await pool.acquire(1, wait_s=0.1)
        b = await pool.acquire(ALIGN + 1, wait_s=0.1)
        assert (a.offset, a.size) == (0, ALIGN)
        assert (b.offset, b.size) == (ALIGN, 2 * ALIGN)
        assert b.address == pool.address + ALIGN
        assert b.region_id == pool.region_id
        assert (b.mem_type, b.device_index) == ("DRAM", 0)
        assert pool.in_use == 3 * ALIGN

    asyncio.run(main())


def test_first_fit_reuses_the_lowest_hole() -> None:
    """After freeing a chunk in the middle, a request that fits there is placed there."""

    async def main() -> None:
        pool, _ = _pool()
        a = await pool.acquire(ALIGN, 0.1)
        b = await pool.acquire(2 * ALIGN, 0.1)
        c = await pool.acquire(ALIGN, 0.1)
        assert [a.offset, b.offset, c.offset] == [0, ALIGN, 3 * ALIGN]
        b.release()
        d = await pool.acquire(ALIGN, 0.1)  # fits the hole left by b: lowest offset first
        assert d.offset == ALIGN
        e = await pool.acquire(2 * ALIGN, 0.1)  # the rest of b's hole is too small: goes after c
        assert e.offset == 4 * ALIGN
        f = await pool.acquire(ALIGN, 0.1)  # the rest of b's hole
        assert f.offset == 2 * ALIGN

    asyncio.run(main())


def test_release_coalesces_neighbouring_holes() -> None:
    """Chunks freed in any order merge back, so the whole pool can be taken in one piece again."""

    async def main() -> None:
        pool, _ = _pool(4 * ALIGN)
        chunks = [await pool.acquire(ALIGN, 0.1) for _ in range(4)]
        for i in (0, 2, 3, 1):  # free the middle last: it joins both sides
            chunks[i].release()
        assert pool.in_use == 0
        whole = await pool.acquire(4 * ALIGN, 0.1)
        assert (whole.offset, whole.size) == (0, 4 * ALIGN)

    asyncio.run(main())


def test_a_chunk_bigger_than_the_pool_fails_at_once() -> None:
    """A request larger than the whole pool is RESOURCE_EXHAUSTED immediately, without waiting."""

    async def main() -> None:
        pool, _ = _pool(4 * ALIGN)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ResourceExhausted, match="raise staging_pool_bytes"):
            await asyncio.wait_for(pool.acquire(4 * ALIGN + 1, wait_s=30.0), 2.0)
        assert loop.time() - start < 1.0
        assert pool.in_use == 0

    asyncio.run(main())


def test_acquire_waits_then_raises_resource_exhausted() -> None:
    """With the pool full, acquire waits wait_s and then fails with RESOURCE_EXHAUSTED."""

    async def main() -> None:
        pool, _ = _pool(2 * ALIGN)
        await pool.acquire(2 * ALIGN, 0.1)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ResourceExhausted, match=r"within 0.1s \(512/512 in use\)"):
            await pool.acquire(ALIGN, wait_s=0.1)
        assert loop.time() - start >= 0.09
        assert pool.in_use == 2 * ALIGN

    asyncio.run(main())


def test_acquire_waits_for_a_release() -> None:
    """A waiting acquire gets its chunk as soon as enough is released, within wait_s."""

    async def main() -> None:
        pool, _ = _pool(2 * ALIGN)
        held = await pool.acquire(2 * ALIGN, 0.1)
        waiter = asyncio.create_task(pool.acquire(ALIGN, wait_s=5.0))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        held.release()
        chunk = await asyncio.wait_for(waiter, 1.0)
        assert chunk.offset == 0 and pool.in_use == ALIGN

    asyncio.run(main())


def test_a_fragmented_pool_waits_for_a_contiguous_hole() -> None:
    """Free bytes in two separate holes do not satisfy a request needing them contiguous."""

    async def main() -> None:
        pool, _ = _pool(3 * ALIGN)
        a, b, c = [await pool.acquire(ALIGN, 0.1) for _ in range(3)]
        a.release()
        c.release()
        assert pool.in_use == ALIGN
        with pytest.raises(ResourceExhausted):
            await pool.acquire(2 * ALIGN, wait_s=0.05)
        b.release()
        whole = await pool.acquire(3 * ALIGN, 0.1)
        assert whole.offset == 0

    asyncio.run(main())


def test_several_waiters_are_served_as_memory_frees() -> None:
    """Two waiters on a full pool both get chunks when the holder releases."""

    async def main() -> None:
        pool, _ = _pool(2 * ALIGN)
        held = await pool.acquire(2 * ALIGN, 0.1)
        waiters = [asyncio.create_task(pool.acquire(ALIGN, wait_s=5.0)) for _ in range(2)]
        await asyncio.sleep(0.01)
        held.release()
        chunks = await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
        assert sorted(c.offset for c in chunks) == [0, ALIGN]

    asyncio.run(main())
