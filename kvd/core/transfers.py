"""Transfers (pulls) and their state machine.

planned -> reading -> postprocessing -> done, or (fencing ->) failed | aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvd.core.params import TransferParams
from kvd_client.errors import KvdError, UnknownTransfer

RequestKey = tuple[str, int, str]
"""(local engine id, local rank, request id): whose pull a transfer is."""

# Finished transfers kept for GetTransfer / WatchTransfer after they end.
KEEP_FINISHED = 4096


class _TransferIds:
    """Transfer ids as ``uuid.uuid4().hex`` makes them (122 random bits, version 4, RFC 4122
    variant), drawn from one ``os.urandom`` call per 256 ids: ``uuid4`` (a syscall and a UUID
    object per id) showed in a profile of batched pulls, about 4 % of the reader's CPU."""

    BATCH = 256
    _CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
    _SET = (0x8000 << 48) | (4 << 76)

    def __init__(self) -> None:
        self._random = b""
        self._at = 0

    def next(self) -> str:
        if self._at >= len(self._random):
            self._random, self._at = os.urandom(16 * self.BATCH), 0
        value = int.from_bytes(self._random[self._at : self._at + 16], "big")
        self._at += 16
        return f"{value & self._CLEAR | self._SET:032x}"


class TransferState(enum.Enum):
    PLANNED = "PLANNED"
    READING = "READING"
    POSTPROCESSING = "POSTPROCESSING"
    FENCING = "FENCING"  # failed; waiting until no byte of it can land (then FAILED or ABORTED)
    DONE = "DONE"
    FAILED = "FAILED"
    ABORTED = "ABORTED"

    @property
    def final(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


_ENDS = {TransferState.FENCING, TransferState.FAILED, TransferState.ABORTED}
_NEXT = {
    TransferState.PLANNED: {TransferState.READING} | _ENDS,
    TransferState.READING: {TransferState.POSTPROCESSING, TransferState.DONE} | _ENDS,
    TransferState.POSTPROCESSING: {TransferState.DONE} | _ENDS,
    TransferState.FENCING: {TransferState.FAILED, TransferState.ABORTED},
}


@dataclasses.dataclass(eq=False)
class Transfer:
    """One pull into a local engine rank's blocks."""

    transfer_id: str
    request_id: str
    engine_id: str
    tp_rank: int
    peer_address: str
    local_block_ids: tuple[int, ...]
    deadline_s: float
    # Local block ids of the KV cache groups after group 0 (hybrid models), one tuple per group.
    local_group_block_ids: tuple[tuple[int, ...], ...] = ()
    state: TransferState = TransferState.PLANNED
    nbytes: int = 0
    descriptors: int = 0
    direct: bool = True
    error: KvdError | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    finished: float = 0.0
    task: asyncio.Task[None] | None = None
    # Whether the pull's task began: one cancelled before its first step never runs its body
    # (asyncio drops a coroutine that never started), so its end is run for it (Puller._never_ran).
    began: bool = False
    # Every READ the pull asked its data plane to post, as its PullResources records them (the same
    # list): which READs are the pull's, final or not, for as long as the transfer is kept.
    posts: list[asyncio.Future[Any]] = dataclasses.field(default_factory=list, repr=False)
    # Seconds since start at which each phase ended (planned, prepared, posted, read, converted):
    # logged at DEBUG when the transfer ends, to see where a slow pull spent its time.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    _changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # The holder's params it reads (without the lease's expiry, which a renewal changes): with the
    # local block ids, what a StartPull asking for the same pull again repeats (Puller._repeated_pull).
    remote: TransferParams | None = None
    # Called once, when the transfer ends: its table keeps the live ones apart (TransferTable).
    _on_final: Callable[[Transfer], None] | None = dataclasses.field(default=None, repr=False)

    @property
    def request_key(self) -> RequestKey:
        return (self.engine_id, self.tp_rank, self.request_id)

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def mark(self, phase: str) -> None:
        self.phases[phase] = time.monotonic() - self.started

    def advance(self, state: TransferState, error: KvdError | None = None) -> None:
        """Move to ``state``; a transfer that has ended never moves again."""
        if self.state.final:
            return
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"transfer {self.transfer_id}: {self.state.value} -> {state.value} is not allowed")
        self.state = state
        if error is not None:
            self.error = error
        if state.final:
            self.finished = time.monotonic()
            if self._on_final is not None:
                self._on_final(self)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def changes(self) -> AsyncIterator[Transfer]:
        """Yield the transfer now and after every state change, until it ends."""
        while True:
            waiter = self._changed
            yield self
            if self.state.final:
                return
            await waiter.wait()


class TransferTable:
    """Live and recently finished transfers by id, and the latest pull of each request.

    The live ones are also kept apart, in start order: the sweeper asks whether any is in flight
    on every round, and a pass over the finished ones kept (up to KEEP_FINISHED) cost about a
    millisecond each time none was (it showed in profiles of one pull at a time).
    """

    def __init__(self) -> None:
        self._transfers: dict[str, Transfer] = {}
        self._live: dict[str, Transfer] = {}
        self._latest: dict[RequestKey, Transfer] = {}
        self._final_listeners: list[Callable[[Transfer], None]] = []
        self._ids = _TransferIds()

    def on_final(self, listener: Callable[[Transfer], None]) -> None:
        """Call ``listener`` with each transfer as it ends (final, its error set), in the call that
        ended it: how one stream waits on many transfers (kvd.core.watches) without a task each.
        A listener must not raise: it runs inside the pull's state change."""
        self._final_listeners.append(listener)

    def new(self, **fields: object) -> Transfer:
        transfer = Transfer(transfer_id=self._ids.next(), _on_final=self._ended, **fields)  # type: ignore[arg-type]
        self._transfers[transfer.transfer_id] = transfer
        self._live[transfer.transfer_id] = transfer
        if transfer.request_id:
            self._latest[transfer.request_key] = transfer
        self._trim()
        return transfer

    def latest_pull(self, key: RequestKey) -> Transfer | None:
        """The last pull started for ``key`` while it is still kept (live or among the finished)."""
        return self._latest.get(key)

    def _ended(self, transfer: Transfer) -> None:
        self._live.pop(transfer.transfer_id, None)
        for listener in self._final_listeners:
            listener(transfer)

    def get(self, transfer_id: str) -> Transfer:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            raise UnknownTransfer(f"no transfer {transfer_id!r} is known here (finished long ago, or never started)")
        return transfer

    def in_flight(self) -> list[Transfer]:
        """The transfers not ended yet, oldest first."""
        return list(self._live.values())

    def any_in_flight(self) -> bool:
        return bool(self._live)

    def _trim(self) -> None:
        if len(self._transfers) <= KEEP_FINISHED:
            return
        # Oldest first, stopping once enough are found: the front is almost all finished, so this
        # touches a few entries per new transfer rather than all of them (it showed in profiles).
        excess = len(self._transfers) - KEEP_FINISHED
        doomed = []
        for tid, transfer in self._transfers.items():
            if transfer.state.final:
                doomed.append(tid)
                if len(doomed) == excess:
                    break
        for tid in doomed:
            transfer = self._transfers.pop(tid)
            if self._latest.get(transfer.request_key) is transfer:
                del self._latest[transfer.request_key]
