"""Work that, once started, runs to its end whoever stops waiting for it.

An RPC's handler is cancelled when its client gives up (a deadline, a closed channel). Work that
changes NIXL or the worker's mappings in several awaited steps (map, register, prepare lists; or
release lists, deregister, unmap) must not stop between two of them: a registration whose reply
was dropped would stay registered over memory unmapped right after, a release cut short would
leave a fenced mapping neither freed nor quarantined. Such work runs as a task of its own that
the caller awaits through :func:`asyncio.shield`; a caller that is cancelled leaves it running
and may say what to do with its result (``abandoned``: undo a registration nobody will use).
Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvd.core.read_batches import ignore_outcome

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Finishing:
    """The tasks started by one owner that are still running (awaited at its shutdown)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._running: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    async def run(self, coro: Coroutine[Any, Any, T], abandoned: Callable[[T], None] | None = None) -> T:
        """Await ``coro`` run as its own task; if this caller is cancelled the task goes on, and
        ``abandoned`` gets its result if it succeeds (called on the loop, from a done callback)."""
        task = self.start(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                task.add_done_callback(lambda done: self._after_abandoned(done, abandoned))
            raise

    def start(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a task nobody need await (its error, if any, is retrieved)."""
        task = asyncio.get_running_loop().create_task(coro, name=f"kvd-{self._name}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        task.add_done_callback(ignore_outcome)
        return task

    def _after_abandoned(self, task: asyncio.Task[T], abandoned: Callable[[T], None] | None) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.info("%s whose caller gave up failed: %s", self._name, error)
        elif abandoned is not None:
            abandoned(task.result())

    async def settle(self, timeout_s: float) -> None:
        """Wait until every task started so far (and any they start) has ended, or ``timeout_s``
        has passed (a hung worker's call never ends: shutdown goes on without it)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._running:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                logger.warning("%d %s tasks still running at shutdown", len(self._running), self._name)
                return
            await asyncio.wait(list(self._running), timeout=left)
