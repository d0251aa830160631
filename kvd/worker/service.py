"""The worker's side of the channel: runs the control process's calls on its NIXL agent and mappings.

One asyncio loop reads frames (kvd.dataplane_protocol) and runs each call as a task, so a slow
one (preparing a large list, a conversion: both in the thread pool) never holds up the others.
Replies, settled READs and notifications go back on the same channel, in the order they happen:
a READ's reply always precedes its ``SETTLED``.

**Ids and owners.** Everything the control process names lives here, keyed by ids:

* region ids -> mappings (:class:`~kvd.worker.regions.RegionTable`);
* registration ids -> NIXL registrations; table ids -> prepared lists;
* READ ids (chosen by the control process) -> posted transfers, until NIXL says DONE or ERR.

All are the worker's: when it exits, its mappings, registrations, lists and UCX endpoints go
with it. At end of channel (the control process closed it or died) the worker releases what it
holds and exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from kvd.dataplane_protocol import (
    CALL,
    HELLO,
    NOTIFS,
    REPLY,
    SETTLED,
    AgentIdentity,
    MappedRegion,
    ReadOrder,
    RegionRequest,
    WireError,
    XferState,
    encode_error,
    frame,
    read_frame,
)
from kvd.worker.nixl_agent import NixlAgent, NixlRead, Xfer
from kvd.worker.regions import RegionTable
from kvd_client.errors import FailedPrecondition, NotFound, Unavailable

logger = logging.getLogger(__name__)


class WorkerService:
    """Every call the control process may make; see the module docstring."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prefault: bool = True) -> None:
        self._reader = reader
        self._writer = writer
        self._agent: NixlAgent | None = None
        self._regions = RegionTable(prefault)
        self._registrations: dict[int, Any] = {}
        self._tables: dict[int, Any] = {}
        self._xfers: dict[int, Xfer] = {}
        self._ids = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvd-worker")
        self._tasks: set[asyncio.Task[None]] = set()
        self._ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "start": self.start,
            "ping": self.ping,
            "fast_poll": self.fast_poll,
            "open_regions": self.open_regions,
            "close_regions": self.close_regions,
            "duplicate_region": self.duplicate_region,
            "retire_region": self.retire_region,
            "open_staging": self.open_staging,
            "convert": self.convert,
            "register": self.register,
            "deregister": self.deregister,
            "add_remote": self.add_remote,
            "remove_remote": self.remove_remote,
            "prepare_table": self.prepare_table,
            "release_tables": self.release_tables,
            "reads": self.reads,
        }

    # --- the channel --------------------------------------------------------------------------

    def _send(self, *message: Any) -> None:
        if not self._writer.is_closing():
            self._writer.writelines(frame(message))

    async def serve(self) -> None:
        """Say hello, then run calls until the control process closes the channel."""
        self._send(HELLO, os.getpid())
        try:
            while True:
                try:
                    message = await read_frame(self._reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if message[0] != CALL:
                    logger.error("unexpected %r on the data-plane channel", message[0])
                    continue
                task = asyncio.get_running_loop().create_task(self._run(message[1], message[2], message[3]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self._close()

    async def _run(self, call_id: int, op: str, args: tuple[Any, ...]) -> None:
        handler = self._ops.get(op)
        try:
            if handler is None:
                raise NotFound(f"the data-plane worker has no operation {op!r}")
            value = await handler(*args)
        except Exception as exc:  # every failure goes back to the caller, typed
            if not isinstance(exc, Unavailable | FailedPrecondition | NotFound):
                logger.debug("data-plane call %s failed", op, exc_info=True)
            self._send(REPLY, call_id, None, encode_error(exc))
            return
        self._send(REPLY, call_id, value, None)

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._agent is not None:
            await self._agent.stop()
        self._regions.close_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def agent(self) -> NixlAgent:
        if self._agent is None:
            raise Unavailable("the data-plane worker's NIXL agent is not started")
        return self._agent

    # --- life ---------------------------------------------------------------------------------

    async def start(self, agent_name: str, backends: tuple[str, ...], progress_thread: bool) -> AgentIdentity:
        if self._agent is not None:
            raise FailedPrecondition("the data-plane worker is already started")
        agent = NixlAgent(agent_name, backends, progress_thread)
        await agent.start(self._notifications)
        self._agent = agent
        return agent.identity()

    def _notifications(self, notifications: dict[str, list[bytes]]) -> None:
        self._send(NOTIFS, notifications)

    async def ping(self) -> None:
        """Answered by the NIXL thread itself: a worker whose NIXL thread is stuck does not answer."""
        await self.agent.call(lambda: None, activity=False)

    async def fast_poll(self, deadline: float) -> None:
        self.agent.fast_poll_until = deadline

    # --- memory -------------------------------------------------------------------------------

    async def open_regions(self, requests: tuple[RegionRequest, ...]) -> list[MappedRegion]:
        return self._regions.open_all(requests)

    async def close_regions(self, region_ids: tuple[int, ...]) -> None:
        for region_id in region_ids:
            self._regions.close(region_id)

    async def duplicate_region(self, region_id: int) -> MappedRegion:
        return self._regions.duplicate(region_id)

    async def retire_region(self, region_id: int) -> None:
        self._regions.retire(region_id)

    async def open_staging(self, size: int, device: str) -> MappedRegion:
        return self._regions.staging(size, device)

    async def convert(
        self, postprocess: Any, staging_region: int, offset: int, size: int, engine_regions: tuple[int, ...]
    ) -> None:
        staging = self._regions.get(staging_region)[offset : offset + size]
        tensors = [self._regions.get(region_id) for region_id in engine_regions]
        await asyncio.get_running_loop().run_in_executor(
            self._pool, self._regions.convert, postprocess, staging, tensors
        )

    async def register(self, address: int, size: int, device_index: int, mem_type: str) -> tuple[int, AgentIdentity]:
        registration = await self.agent.register(address, size, device_index, mem_type)
        registration_id = next(self._ids)
        self._registrations[registration_id] = registration
        return registration_id, self.agent.identity()

    async def deregister(self, registration_id: int) -> AgentIdentity:
        registration = self._registrations.pop(registration_id, None)
        if registration is not None:
            await self.agent.deregister(registration)
        return self.agent.identity()

    # --- peers and lists ----------------------------------------------------------------------

    async def add_remote(self, metadata: bytes) -> str:
        return await self.agent.add_remote(metadata)

    async def remove_remote(self, agent_name: str, table_ids: tuple[int, ...]) -> None:
        tables = [self._tables.pop(t) for t in table_ids if t in self._tables]
        await self.agent.remove_remote(agent_name, tables)

    async def prepare_table(self, agent_name: str, rows: np.ndarray, mem_type: str) -> int:
        agent = self.agent
        table = await asyncio.get_running_loop().run_in_executor(
            self._pool, agent.prepare_table, agent_name, rows, mem_type
        )
        table_id = next(self._ids)
        self._tables[table_id] = table
        return table_id

    async def release_tables(self, table_ids: tuple[int, ...]) -> None:
        tables = [self._tables.pop(t) for t in table_ids if t in self._tables]
        await self.agent.release_tables(tables)

    # --- transfers ----------------------------------------------------------------------------

    async def reads(self, orders: tuple[ReadOrder, ...]) -> list[tuple[Any, ...]]:
        """Post READs, all in one hop to the NIXL thread (DataPlane sends a loop turn's together).

        Each READ's outcome on its own, in order: ("posted", state, error), its state DONE when
        it finished within the post (then no SETTLED follows) and its error if it was posted
        only in part (then it still settles later); or ("refused", error): nothing of it posted."""
        outcomes: list[tuple[Any, ...] | None] = [None] * len(orders)
        posts: list[tuple[int, NixlRead]] = []
        for index, order in enumerate(orders):
            local, remote = self._tables.get(order.local_table), self._tables.get(order.remote_table)
            if local is None or remote is None:
                error = NotFound(f"a READ from {order.peer} names a descriptor list this worker does not have")
                outcomes[index] = ("refused", encode_error(error))
                continue
            read = NixlRead(
                local_table=local,
                local_indices=order.local_indices,
                remote_table=remote,
                remote_indices=order.remote_indices,
                notif=order.notif,
                peer=order.peer,
                nbytes=order.nbytes,
            )
            posts.append((index, read))
        posted = await self.agent.read_many([read for _, read in posts])
        for (index, _), xfer in zip(posts, posted, strict=True):
            if isinstance(xfer, Exception):
                outcomes[index] = ("refused", encode_error(xfer))
                continue
            outcomes[index] = ("posted", *self._track(orders[index].xfer_id, xfer))
        return [outcome for outcome in outcomes if outcome is not None]

    def _track(self, xfer_id: int, xfer: Xfer) -> tuple[str, WireError | None]:
        """A posted READ's (state, error) for its caller; one not yet final is settled later."""
        error = encode_error(xfer.error) if xfer.error is not None else None
        if xfer.state is XferState.DONE:
            return xfer.state.value, error
        self._xfers[xfer_id] = xfer
        xfer.settled.add_done_callback(lambda _: self._settled(xfer_id))
        return XferState.IN_PROGRESS.value, error

    def _settled(self, xfer_id: int) -> None:
        xfer = self._xfers.pop(xfer_id)
        self._send(SETTLED, xfer_id, xfer.state.value, encode_error(xfer.error) if xfer.error is not None else None)
