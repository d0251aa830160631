"""Where a front end's background work runs: a task of the running event loop, or a thread.

The asyncio sources that tools/gen_sync.py turns into the blocking front ends call the asyncio
helpers here (:class:`AsyncBackground`, :func:`wait_event_async`); the generator rewrites each
name to its thread twin (:class:`Background`, :func:`wait_event`). So the one real difference
between the twins, a task or a thread, lives here once instead of in two copies of a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class AsyncBackground:
    """``target()`` running as a task of the running event loop (create it inside that loop)."""

    def __init__(self, target: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(target(), name=name)

    async def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the task to end, without cancelling it; whether it
        ended (an exception it ended with is raised here)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            return False
        return True


class Background:
    """``target()`` running on a daemon thread (the process may exit while it runs)."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the thread to end; whether it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


async def wait_event_async(event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set, or ``timeout_s`` seconds passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


def wait_event(event: threading.Event, timeout_s: float) -> None:
    """Wait until ``event`` is set, or ``timeout_s`` seconds passed."""
    event.wait(timeout_s)
