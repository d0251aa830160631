"""Committed-token watermarks: what a holder rank may serve of a request.

With speculative decoding an engine writes KV for draft tokens before it knows which are
accepted. It reports, per request, how many tokens are final; a pull never reads past that.
A pull that arrives before the commit it needs waits for it, bounded.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, defaultdict

from kvd_client.errors import Aborted

Key = tuple[str, int, str]  # (engine_id, tp_rank, request_id)

# Watermarks of requests nobody holds are forgotten oldest-first beyond this many: an engine
# commits every request it runs, most are never held, and a daemon runs for months.
MAX_WATERMARKS = 1 << 18


class CommitTracker:
    """Watermarks per (engine, rank, request), with waiters. Event-loop only."""

    def __init__(self, max_watermarks: int = MAX_WATERMARKS) -> None:
        self._max = max_watermarks
        self._marks: OrderedDict[Key, int] = OrderedDict()
        self._waiters: dict[Key, list[tuple[int, asyncio.Future[None]]]] = defaultdict(list)

    def watermark(self, engine_id: str, tp_rank: int, request_id: str) -> int:
        return self._marks.get((engine_id, tp_rank, request_id), 0)

    def commit(self, engine_id: str, tp_rank: int, request_id: str, tokens: int) -> None:
        """Raise the watermark (never lowers it) and wake the waiters it satisfies."""
        key = (engine_id, tp_rank, request_id)
        mark = max(self._marks.get(key, 0), tokens)
        self._marks[key] = mark
        self._marks.move_to_end(key)
        while len(self._marks) > self._max:
            self._marks.popitem(last=False)
        waiters = self._waiters.get(key)
        if not waiters:
            return
        still = []
        for need, fut in waiters:
            if need <= mark:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((need, fut))
        if still:
            self._waiters[key] = still
        else:
            del self._waiters[key]

    async def wait_for(self, engine_id: str, tp_rank: int, request_id: str, tokens: int, timeout_s: float) -> bool:
        """True once ``tokens`` are committed; False if that did not happen within ``timeout_s``."""
        key = (engine_id, tp_rank, request_id)
        if self._marks.get(key, 0) >= tokens:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[key].append((tokens, fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            remaining = [(n, f) for n, f in self._waiters.get(key, []) if f is not fut]
            if remaining:
                self._waiters[key] = remaining
            else:
                self._waiters.pop(key, None)

    def forget_request(self, engine_id: str, request_id: str) -> None:
        for key in [k for k in self._marks if k[0] == engine_id and k[2] == request_id]:
            del self._marks[key]

    def forget_engine(self, engine_id: str, tp_rank: int) -> None:
        for key in [k for k in self._marks if k[0] == engine_id and k[1] == tp_rank]:
            del self._marks[key]
        for key in [k for k in self._waiters if k[0] == engine_id and k[1] == tp_rank]:
            for _, fut in self._waiters.pop(key):
                if not fut.done():
                    fut.set_exception(
                        Aborted(f"engine {engine_id!r} rank {tp_rank} went away while a read waited for its commit")
                    )

    def __len__(self) -> int:
        return len(self._marks)
