"""A bounded, reused, NIXL-registered staging pool for pulls that need a layout conversion.

Allocated in the data-plane worker and registered once per device at first use; a pull takes
one contiguous chunk (an offset into the worker's buffer) and gives it back.
A pull that cannot get a chunk waits (bounded) and then fails with RESOURCE_EXHAUSTED: the
pool never grows.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging

from kvd.core.dataplane import DataPlane
from kvd.dataplane_protocol import MappedRegion
from kvd_client.errors import ResourceExhausted

logger = logging.getLogger(__name__)

ALIGN = 256


@dataclasses.dataclass(eq=False)
class StagingChunk:
    pool: StagingPool
    offset: int
    size: int

    @property
    def region_id(self) -> int:
        """The worker's staging buffer this chunk is part of."""
        return self.pool.region_id

    @property
    def address(self) -> int:
        return self.pool.address + self.offset

    @property
    def device_index(self) -> int:
        return self.pool.device_index

    @property
    def mem_type(self) -> str:
        return self.pool.mem_type

    def release(self) -> None:
        self.pool.release(self)


class StagingPool:
    """First-fit allocator over one registered buffer. Event-loop only."""

    def __init__(self, dataplane: DataPlane, region: MappedRegion) -> None:
        """Over a buffer the worker allocated; :meth:`open` allocates and registers it."""
        self.region_id = region.region_id
        self.address = region.address
        self.device_index = region.device_index
        self.mem_type = region.mem_type
        self.size = region.size_bytes
        self._registration: object = None
        self._dataplane = dataplane
        self._free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, size)
        self._changed = asyncio.Condition()
        self.in_use = 0
        self.lost = False  # its worker died: a new pool replaces it

    @classmethod
    async def open(cls, dataplane: DataPlane, size: int, device: str) -> StagingPool:
        region = await dataplane.open_staging(size, device)
        pool = cls(dataplane, region)
        try:
            pool._registration = await dataplane.register(pool.address, size, pool.device_index, pool.mem_type)
        except BaseException:
            await dataplane.close_regions([region.region_id])
            raise
        return pool

    def _take(self, size: int) -> StagingChunk | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.in_use += size
                return StagingChunk(self, offset, size)
        return None

    async def acquire(self, nbytes: int, wait_s: float) -> StagingChunk:
        size = min(-(-nbytes // ALIGN) * ALIGN, self.size)
        if nbytes > self.size:
            raise ResourceExhausted(
                f"a pull needs {nbytes} staging bytes but the pool has {self.size}: raise staging_pool_bytes"
            )
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self._fits(size)), wait_s)
            except TimeoutError as exc:
                raise ResourceExhausted(
                    f"no {nbytes} bytes of staging memory free within {wait_s}s ({self.in_use}/{self.size} in use)"
                ) from exc
            chunk = self._take(size)
            assert chunk is not None
            return chunk

    def _fits(self, size: int) -> bool:
        return any(free >= size for _, free in self._free)

    def release(self, chunk: StagingChunk) -> None:
        self.in_use -= chunk.size
        i = bisect.bisect_left(self._free, (chunk.offset, 0))
        self._free.insert(i, (chunk.offset, chunk.size))
        merged: list[tuple[int, int]] = []
        for offset, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        self._free = merged
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """Deregister the buffer (shutdown; chunks still held by stale reads keep it mapped)."""
        if self._registration is not None:
            await self._dataplane.deregister(self._registration)
            self._registration = None
            await self._dataplane.close_regions([self.region_id])
