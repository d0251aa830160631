"""Prepared NIXL descriptor lists, cached by (registration, geometry) for one owner.

A local engine mapping (:class:`kvd.core.local_memory.LocalMemory`) and a peer's agent
(:class:`kvd.core.peers.RemoteAgent`) each own one cache. A list is prepared once, on first
use, in the worker pool (large lists take long), and released only on the data plane's thread
when its owner is released: never while a transfer built on it may be in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Hashable, Sequence
from typing import Any

from kvd.core.dataplane import DataPlane
from kvd.core.read_batches import ignore_outcome
from kvd.layout.geometry import DescGeometry
from kvd_client.errors import Unavailable

logger = logging.getLogger(__name__)


class TableCache:
    """Prepared lists of one owner. Event-loop only (preparation itself runs in the pool)."""

    def __init__(self, dataplane: DataPlane, agent_name: str) -> None:
        self._dataplane = dataplane
        self._agent_name = agent_name
        self._tables: dict[tuple[Hashable, DescGeometry], Any] = {}
        self._preparing: dict[tuple[Hashable, DescGeometry], asyncio.Future[Any]] = {}
        self._closed = False

    def __len__(self) -> int:
        return len(self._tables)

    async def get(
        self,
        key: Hashable,
        geometry: DescGeometry,
        region_addresses: Sequence[int],
        device_index: int,
        mem_type: str,
        executor: concurrent.futures.Executor,
    ) -> Any:
        """The list of ``geometry`` over the regions named by ``key``, prepared on first use.

        The preparation is a task of the cache's, not of the caller's: a caller cancelled while
        it waits (a pull cancelled, an RPC whose client gave up) leaves it to finish, and the
        owner's release waits for it (:meth:`release`), so no list is ever prepared over memory
        the owner has already deregistered, and none is left unreleased."""
        full_key = (key, geometry)
        table = self._tables.get(full_key)
        if table is not None:
            return table
        if self._closed:
            raise Unavailable(f"the memory of {key} was released during the pull")
        pending = self._preparing.get(full_key)
        if pending is None:
            pending = asyncio.get_running_loop().create_task(
                self._prepare_and_keep(full_key, geometry, list(region_addresses), device_index, mem_type, executor),
                name=f"kvd-table-{self._agent_name}",
            )
            pending.add_done_callback(ignore_outcome)  # its waiters may all have been cancelled
            self._preparing[full_key] = pending
        return await asyncio.shield(pending)

    def ready(self, key: Hashable, geometry: DescGeometry) -> Any | None:
        """The list of ``geometry`` over ``key`` if it is prepared already (None otherwise: :meth:`get`)."""
        return None if self._closed else self._tables.get((key, geometry))

    async def _prepare_and_keep(
        self,
        full_key: tuple[Hashable, DescGeometry],
        geometry: DescGeometry,
        addresses: list[int],
        device_index: int,
        mem_type: str,
        executor: concurrent.futures.Executor,
    ) -> Any:
        loop = asyncio.get_running_loop()
        try:
            table = await loop.run_in_executor(executor, self._prepare, geometry, addresses, device_index, mem_type)
        finally:
            self._preparing.pop(full_key, None)
        if self._closed:  # the owner was released while this list was being prepared
            await self._dataplane.release_tables([table])
            raise Unavailable(f"the memory of {full_key[0]} was released during the pull")
        self._tables[full_key] = table
        logger.debug("prepared %d descriptors for %s/%s", geometry.table_size, self._agent_name, full_key[0])
        return table

    def _prepare(self, geometry: DescGeometry, addresses: list[int], device_index: int, mem_type: str) -> Any:
        rows = geometry.strided(addresses, device_index)  # compressed: a few rows per plane
        return self._dataplane.prepare_table(self._agent_name, rows, mem_type)

    def take(self, keep: set[Hashable] | None = None) -> list[Any]:
        """Remove and return every list (or those whose key is not in ``keep``) for release."""
        doomed = [k for k in self._tables if keep is None or k[0] not in keep]
        return [self._tables.pop(k) for k in doomed]

    def close(self) -> list[Any]:
        """Take every list for release, for good: a list still being prepared (the background
        warm-up after a handshake holds no pin) is released when it is ready, never cached."""
        self._closed = True
        return self.take()

    async def settle(self) -> None:
        """Wait for the lists still being prepared (each released by its own task once closed)."""
        while self._preparing:
            await asyncio.gather(*list(self._preparing.values()), return_exceptions=True)

    async def release(self, keep: set[Hashable] | None = None) -> None:
        """Release the lists (all of them, for good, when ``keep`` is None: then only once none
        is still being prepared, so the owner may deregister its memory right after)."""
        if keep is None:
            self._closed = True
            await self.settle()
        await self._dataplane.release_tables(self.take(keep))
