"""The worker's side of the channel: runs the control process's calls on its NIXL agent and mappings.

One asyncio loop reads frames (kvd.dataplane_protocol) and runs each call as a task, so a slow
one (preparing a large list, a conversion: both in the thread pool) never holds up the others.
The two calls on every pull's path, ``reads`` and the heartbeat's ``ping``, skip the task: they
go to the NIXL thread at once, and it answers them itself, as it sends settled READs and
notifications (kvd.worker.channel: one hop less each way). Where the control process gave the
worker a second socket for READ orders (``--orders-fd``), the NIXL thread reads ``reads`` calls
from it itself (kvd.worker.nixl_thread's inbox): no event loop, no thread hand-off, on the way in
either.

**The two sockets' order.** A READ order on its own socket could overtake, or be overtaken by,
a call on the channel. Neither can reorder what matters: the control process sends a READ only
once the lists and memory it names are ready (their calls answered), and releases them only
once the READ is final (its answer came first). Besides, the NIXL thread takes every order
waiting on its socket before each command it runs. Everything goes back on the same
channel, whole frames in the order they happen: a READ's reply always precedes its ``SETTLED``.

**Ids and owners.** Everything the control process names lives here, keyed by ids:

* region ids -> mappings (:class:`~kvd.worker.regions.RegionTable`);
* registration ids -> NIXL registrations; table ids -> prepared lists;
* READ ids (chosen by the control process) -> posted transfers, until NIXL says DONE or ERR
  (the NIXL thread's own, :class:`~kvd.worker.nixl_agent.PostedRead`).

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
import socket
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
    CopySettings,
    FrameBuffer,
    MappedRegion,
    ReadOrder,
    RegionRequest,
    WireError,
    encode_error,
    read_frame,
)
from kvd.worker.channel import ChannelWriter
from kvd.worker.nixl_agent import NixlAgent, NixlRead, PostedRead
from kvd.worker.regions import RegionTable
from kvd_client.errors import FailedPrecondition, KvdError, NotFound, Unavailable

logger = logging.getLogger(__name__)


class WorkerService:
    """Every call the control process may make; see the module docstring."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        prefault: bool = True,
        orders: socket.socket | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        # READ orders, read by the NIXL thread itself (the module docstring); None: on the channel.
        self._orders = orders
        self._order_frames = FrameBuffer()
        self._order_bytes = bytearray(1 << 16)  # what one recv of the orders takes (NIXL thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: ChannelWriter | None = None  # made when serving starts (it needs the loop)
        self._agent: NixlAgent | None = None
        self._regions = RegionTable(prefault)
        self._registrations: dict[int, Any] = {}
        self._tables: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvd-worker")
        self._tasks: set[asyncio.Task[None]] = set()
        self._ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "start": self.start,
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
        }
        # Calls answered by the NIXL thread itself (see the module docstring): run on the loop,
        # without a task, they only hand the work to it.
        self._direct: dict[str, Callable[..., None]] = {"reads": self.reads, "ping": self.ping}

    # --- the channel --------------------------------------------------------------------------

    def _send(self, *message: Any) -> None:
        """Send one message (any thread: the NIXL thread sends too)."""
        if self._channel is not None:
            self._channel.send(message)

    def _answer(self, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        """Answer a call (any thread); an answer that cannot be framed becomes its error."""
        if error is not None:
            self._send(REPLY, call_id, None, encode_error(error))
            return
        try:
            self._send(REPLY, call_id, value, None)
        except Exception as exc:  # noqa: BLE001 - not framed (nothing was sent): the caller gets why
            self._send(REPLY, call_id, None, encode_error(exc))

    async def serve(self) -> None:
        """Say hello, then run calls until the control process closes the channel."""
        loop = self._loop = asyncio.get_running_loop()
        self._channel = ChannelWriter(self._writer.get_extra_info("socket"), loop)
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
                call_id, op, args = message[1], message[2], message[3]
                direct = self._direct.get(op)
                if direct is not None:
                    self._run_direct(call_id, direct, args)
                    continue
                task = loop.create_task(self._run(call_id, op, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await self._close()

    def _run_direct(self, call_id: int, direct: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Run a call answered by the NIXL thread (the event loop's or the NIXL thread's own
        caller); one refused before it reaches that thread is answered here, with why."""
        try:
            direct(call_id, *args)
        except Exception as exc:  # noqa: BLE001 - refused before the NIXL thread: the caller gets why
            self._answer(call_id, error=exc)

    async def _run(self, call_id: int, op: str, args: tuple[Any, ...]) -> None:
        handler = self._ops.get(op)
        try:
            if handler is None:
                raise NotFound(f"the data-plane worker has no operation {op!r}")
            value = await handler(*args)
        except Exception as exc:  # every failure goes back to the caller, typed
            if not isinstance(exc, Unavailable | FailedPrecondition | NotFound):
                logger.debug("data-plane call %s failed", op, exc_info=True)
            self._answer(call_id, error=exc)
            return
        self._answer(call_id, value)

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._agent is not None:
            await self._agent.stop()
        if self._orders is not None:
            self._orders.close()  # after the NIXL thread stopped: it reads it
        self._regions.close_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._channel is not None:
            self._channel.close()

    @property
    def agent(self) -> NixlAgent:
        if self._agent is None:
            raise Unavailable("the data-plane worker's NIXL agent is not started")
        return self._agent

    # --- life ---------------------------------------------------------------------------------

    async def start(
        self, agent_name: str, backends: tuple[str, ...], progress_thread: bool, copying: CopySettings
    ) -> AgentIdentity:
        if self._agent is not None:
            raise FailedPrecondition("the data-plane worker is already started")
        agent = NixlAgent(
            agent_name,
            backends,
            progress_thread,
            max_post_bytes=copying.max_post_bytes,
            copy_threads=copying.copy_threads,
            parallel_min_bytes=copying.parallel_read_min_bytes,
        )
        if self._orders is not None:
            self._orders.setblocking(False)
            agent.attach_inbox(self._orders, self._take_orders)
        await agent.start(self._notifications, self._settled)
        self._agent = agent
        return agent.identity()

    def _take_orders(self) -> bool:
        """Every READ order waiting on the orders socket, posted now (NIXL thread; never
        blocks). Once the socket has ended (the control process closed it), broke or is
        corrupt, or if anything else fails here, the worker ends (False: no longer watched):
        READs that nobody reads would leave their pulls waiting while the heartbeat passes."""
        try:
            if self._read_orders():
                return True
        except BaseException:
            logger.exception("reading READ orders failed: the worker ends")
        self._end_soon()
        return False

    def _read_orders(self) -> bool:
        """True once the socket has nothing more to read now; False at its end."""
        assert self._orders is not None
        view = memoryview(self._order_bytes)
        while True:
            try:
                received = self._orders.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:
                logger.debug("the data-plane orders socket broke: %s", exc)
                return False
            if not received:
                return False
            for message in self._order_frames.feed(view[:received]):  # raises where corrupt
                self._take_order(message)
            if received < len(view):
                return True

    def _take_order(self, message: tuple[Any, ...]) -> None:
        if message[0] != CALL or message[2] != "reads":
            logger.error("unexpected %r on the data-plane orders socket", message[:3])
            if message[0] == CALL:
                self._answer(message[1], error=NotFound(f"the orders socket takes no {message[2]!r} call"))
            return
        self._run_direct(message[1], self.reads, message[3])

    def _end_soon(self) -> None:
        """End serving (any thread): the channel's end, as if the control process closed it."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._writer.transport.abort)

    def _notifications(self, notifications: dict[str, list[bytes]]) -> None:
        """A poll's notifications (NIXL thread)."""
        self._send(NOTIFS, notifications)

    def _settled(self, xfer: PostedRead) -> None:
        """A READ final after its post (NIXL thread, always after the READ's reply)."""
        self._send(SETTLED, xfer.xfer_id, xfer.state.value, encode_error(xfer.error) if xfer.error else None)

    def ping(self, call_id: int) -> None:
        """Answered by the NIXL thread itself: a worker whose NIXL thread is stuck does not answer."""
        answered = self.agent.submit(lambda: self._answer(call_id), activity=False)
        if answered.done() and answered.exception() is not None:  # the NIXL thread is stopped
            raise Unavailable("the data-plane worker's NIXL agent is stopped")

    async def fast_poll(self, deadline: float) -> None:
        self.agent.fast_poll_until = deadline

    # --- memory -------------------------------------------------------------------------------

    async def open_regions(self, requests: tuple[RegionRequest, ...]) -> list[MappedRegion]:
        return self._regions.open_all(requests)

    async def close_regions(self, region_ids: tuple[int, ...], keep_readable_s: float = 0.0) -> None:
        for region_id in region_ids:
            self._regions.close(region_id, keep_readable_s)

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

    def reads(self, call_id: int, orders: tuple[ReadOrder, ...]) -> None:
        """Post READs, all in one hop to the NIXL thread (DataPlane sends a loop turn's together),
        which answers at once, before it polls any of them.

        Each READ's outcome on its own, in order: ("posted", state, error), its state DONE when
        it finished within the post (then no SETTLED follows) and its error if it was posted
        only in part (then it still settles later); or ("refused", error): nothing of it posted."""
        agent = self.agent
        refused: dict[int, WireError] = {}
        posts: list[NixlRead] = []
        for index, order in enumerate(orders):
            local, remote = self._tables.get(order.local_table), self._tables.get(order.remote_table)
            if local is None or remote is None:
                error = NotFound(f"a READ from {order.peer} names a descriptor list this worker does not have")
                refused[index] = encode_error(error)
                continue
            posts.append(
                NixlRead(
                    xfer_id=order.xfer_id,
                    local_table=local,
                    local_indices=order.local_indices,
                    remote_table=remote,
                    remote_indices=order.remote_indices,
                    notif=order.notif,
                    peer=order.peer,
                    nbytes=order.nbytes,
                )
            )

        def answer(posted: list[PostedRead | KvdError]) -> None:  # on the NIXL thread
            outcomes: list[tuple[Any, ...]] = []
            results = iter(posted)
            for index in range(len(orders)):
                if index in refused:
                    outcomes.append(("refused", refused[index]))
                    continue
                result = next(results)
                if isinstance(result, PostedRead):
                    error = encode_error(result.error) if result.error is not None else None
                    outcomes.append(("posted", result.state.value, error))
                else:
                    outcomes.append(("refused", encode_error(result)))
            self._answer(call_id, outcomes)

        agent.post_reads(posts, answer)
