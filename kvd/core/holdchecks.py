"""Soft holds' verification: the daemon's side of each engine's scheduler stream.

A *soft hold* pins nothing: the engine gave its blocks back to its prefix cache when the request
finished, and the daemon only remembers the lease. Whether those blocks still hold the request's
KV is known to one party only, the engine's scheduler (vLLM's block pool: each cached block
carries the hash of its tokens and of every token before it). So the daemon asks it, over the
scheduler stream (``EngineService.SchedulerStream``), around each read:

* ``PIN`` before admitting a read: the scheduler checks the blocks still carry the hashes it
  recorded at finish, and takes a reference on them (vLLM will not evict or reuse them) — or
  answers no, and the read is refused before anything moved (NOT_FOUND, recompute);
* ``VERIFY_UNPIN`` once the reader's READs are final (its FinishRead): the hashes again, then
  the reference goes. A mismatch fails the pull: never DONE with someone else's KV;
* ``UNPIN`` when a pinned read ends otherwise (abandoned, timed out, replaced).

The scheduler answers between its steps (it owns the block pool and is single-threaded), so an
answer takes up to one engine step; a scheduler that does not answer within the timeout counts
as "not verified". A PIN that timed out is followed by an UNPIN of the same pin, which the stream
delivers after it, so a late PIN never leaks a reference.

Event-loop only; no gRPC here (the servicer moves the commands and answers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging

from kvd_client.v1.schema import HoldCheckAction

logger = logging.getLogger(__name__)

__all__ = ["HoldCheckCommand", "HoldChecks", "HoldEndedCommand", "SchedulerChannel", "SchedulerCommandItem"]


@dataclasses.dataclass(frozen=True)
class HoldCheckCommand:
    seq: int
    request_id: str
    lease_id: str
    pin_id: str
    action: HoldCheckAction


@dataclasses.dataclass(frozen=True)
class HoldEndedCommand:
    """A soft lease ended: the scheduler forgets the hold (its blocks were never kept)."""

    request_id: str
    lease_id: str
    reason: str


SchedulerCommandItem = HoldCheckCommand | HoldEndedCommand


@dataclasses.dataclass(eq=False)
class SchedulerChannel:
    """One open scheduler stream: commands queued for it, checks waiting for its answers."""

    engine_id: str
    outbox: asyncio.Queue[SchedulerCommandItem | None] = dataclasses.field(default_factory=asyncio.Queue)
    pending: dict[int, asyncio.Future[tuple[bool, str]]] = dataclasses.field(default_factory=dict)
    closed: bool = False

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        for future in self.pending.values():
            if not future.done():
                future.set_result((False, why))
        self.pending.clear()
        self.outbox.put_nowait(None)  # wakes the servicer's writer, which then ends


class HoldChecks:
    """The scheduler streams of this daemon's engines, one per engine (the newest wins)."""

    def __init__(self) -> None:
        self._channels: dict[str, SchedulerChannel] = {}
        self._seq = itertools.count(1)

    def attach(self, engine_id: str) -> SchedulerChannel:
        """A new stream supersedes an open one (a scheduler that reconnected)."""
        previous = self._channels.get(engine_id)
        channel = SchedulerChannel(engine_id)
        self._channels[engine_id] = channel
        if previous is not None:
            previous.close("superseded by a new scheduler stream")
        return channel

    def detach(self, channel: SchedulerChannel) -> bool:
        """The stream ended; True if it was the engine's current one."""
        channel.close("the engine's scheduler stream ended")
        if self._channels.get(channel.engine_id) is channel:
            del self._channels[channel.engine_id]
            return True
        return False

    def connected(self, engine_id: str) -> bool:
        return engine_id in self._channels

    def answer(self, channel: SchedulerChannel, seq: int, ok: bool, reason: str) -> None:
        future = channel.pending.pop(seq, None)
        if future is not None and not future.done():
            future.set_result((ok, reason))

    async def check(
        self, engine_id: str, action: HoldCheckAction, request_id: str, lease_id: str, pin_id: str, timeout_s: float
    ) -> tuple[bool, str]:
        """Ask the engine's scheduler; (False, why) when it says no, is not connected or is silent."""
        channel = self._channels.get(engine_id)
        if channel is None:
            return False, f"engine {engine_id!r} has no scheduler stream: its blocks cannot be verified"
        seq = next(self._seq)
        future: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        channel.pending[seq] = future
        channel.outbox.put_nowait(HoldCheckCommand(seq, request_id, lease_id, pin_id, action))
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            if action is HoldCheckAction.PIN:
                self.unpin(engine_id, request_id, lease_id, pin_id)
            return False, f"engine {engine_id!r}'s scheduler did not answer within {timeout_s}s (is it stepping?)"
        except asyncio.CancelledError:
            # The asker gave up (its reader withdrew the PreparePull, its stream ended): the PIN is
            # on its way to the engine or taken already, and nobody will end it. The UNPIN follows
            # it on the same stream, so the engine drops what it pins.
            if action is HoldCheckAction.PIN:
                self.unpin(engine_id, request_id, lease_id, pin_id)
            raise
        finally:
            channel.pending.pop(seq, None)

    def unpin(self, engine_id: str, request_id: str, lease_id: str, pin_id: str) -> None:
        """Drop a pin without waiting for the answer (the read is over either way)."""
        channel = self._channels.get(engine_id)
        if channel is not None:
            channel.outbox.put_nowait(
                HoldCheckCommand(next(self._seq), request_id, lease_id, pin_id, HoldCheckAction.UNPIN)
            )

    def tell_ended(self, engine_id: str, request_id: str, lease_id: str, reason: str) -> None:
        channel = self._channels.get(engine_id)
        if channel is not None:
            channel.outbox.put_nowait(HoldEndedCommand(request_id, lease_id, reason))
