"""A decode engine's soft holds: blocks lent to a reader without costing KV capacity.

A soft hold's blocks go back to the engine's prefix cache at finish; what is kept is each full
block's identity (vLLM's block hash). A read is admitted only after the daemon asked, over the
scheduler stream, and the blocks still carry those identities: they are then pinned (a reference
in the engine's block pool) until the read ends, when they are checked again and unpinned.

:class:`SoftHolds` keeps that book and answers the daemon's checks; it does no I/O (the
scheduler, :mod:`kvd_engine.scheduler`, polls the stream and sends the answers), so the rules
are tested without a daemon. Not thread-safe: vLLM's block pool belongs to the scheduler's
thread, and so does this.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvd_client.v1.schema import HoldCheckAction

if TYPE_CHECKING:
    from kvd_client.v1 import engine_pb2

logger = logging.getLogger(__name__)

__all__ = ["BlockIdentity", "SoftHolds"]


class BlockIdentity(Protocol):
    """The engine's block pool as soft holds see it (vLLM's ``BlockPool`` through the facade)."""

    def identities(self, block_ids: Sequence[int]) -> list[Hashable | None]:
        """Each block's identity now (vLLM: its block hash; None when it has none)."""
        ...

    def pin(self, block_ids: Sequence[int]) -> None:
        """Take a reference: the engine will not evict or reuse the blocks until unpinned."""

    def unpin(self, block_ids: Sequence[int]) -> None: ...


@dataclasses.dataclass(frozen=True)
class _SoftHold:
    lease_id: str
    block_ids: tuple[int, ...]
    identities: tuple[Hashable | None, ...]


class SoftHolds:
    """The soft holds of one scheduler and the pins of the reads in flight."""

    def __init__(self) -> None:
        self.identity: BlockIdentity | None = None
        self._holds: dict[str, _SoftHold] = {}  # request -> its soft hold (nothing pinned)
        self._pins: dict[str, tuple[tuple[int, ...], tuple[Hashable | None, ...]]] = {}  # pin id -> blocks
        self.evicted_checks = 0

    @property
    def pending(self) -> bool:
        """Whether a soft hold or a pin lives (its checks are answered between steps)."""
        return bool(self._holds or self._pins)

    @property
    def pinned_blocks(self) -> int:
        """Blocks pinned for soft reads in flight (0 when no read is under way)."""
        return sum(len(blocks) for blocks, _ in self._pins.values())

    def identities_of(self, block_ids: tuple[int, ...]) -> tuple[Hashable, ...] | None:
        """The blocks' identities now; None when a block has none (it is not in the prefix cache)
        or no block pool is bound."""
        if self.identity is None:
            return None
        identities = tuple(self.identity.identities(block_ids))
        if any(i is None for i in identities):
            return None
        return identities

    def add(self, request_id: str, lease_id: str, block_ids: tuple[int, ...], identities: tuple[Hashable, ...]) -> None:
        """The daemon granted ``lease_id`` softly over ``block_ids``, which carry ``identities``."""
        self._holds[request_id] = _SoftHold(lease_id, block_ids, identities)

    def on_command(self, command: engine_pb2.SchedulerCommand) -> tuple[int, bool, str] | None:
        """Apply one daemon command; the check result to send back (seq, ok, why), if any."""
        kind = command.WhichOneof("kind")
        if kind == "check":
            check = command.check
            ok, why = self._check(check.action, check.request_id, check.lease_id, check.pin_id)
            return None if check.action == HoldCheckAction.UNPIN else (check.seq, ok, why)
        if kind == "hold_ended":
            ended = command.hold_ended
            hold = self._holds.get(ended.request_id)
            if hold is not None and hold.lease_id == ended.lease_id:
                del self._holds[ended.request_id]
        return None

    def _check(self, action: int, request_id: str, lease_id: str, pin_id: str) -> tuple[bool, str]:
        identity = self.identity
        if identity is None:
            return False, "this engine has no block pool bound"
        if action == HoldCheckAction.PIN:
            hold = self._holds.get(request_id)
            if hold is None or hold.lease_id != lease_id:
                return False, f"no soft hold of request {request_id!r} under that lease here"
            if pin_id in self._pins:
                return True, ""
            if tuple(identity.identities(hold.block_ids)) != hold.identities:
                del self._holds[request_id]
                self.evicted_checks += 1
                return False, f"request {request_id!r}'s blocks were evicted or reused"
            identity.pin(hold.block_ids)
            self._pins[pin_id] = (hold.block_ids, hold.identities)
            return True, ""
        pinned = self._pins.pop(pin_id, None)
        if pinned is None:
            return False, "that read holds no pin here"
        blocks, expected = pinned
        same = tuple(identity.identities(blocks)) == expected
        identity.unpin(blocks)
        if action == HoldCheckAction.VERIFY_UNPIN and not same:
            self.evicted_checks += 1
            self._holds.pop(request_id, None)
            return False, f"request {request_id!r}'s blocks changed during the read"
        return True, ""

    def drop(self, why: str) -> None:
        """The daemon that knew our soft holds and pins is gone: forget them, give the pins back."""
        if self._holds or self._pins:
            logger.info("kvd: dropping %d soft holds and %d pins: %s", len(self._holds), len(self._pins), why)
        self._holds.clear()
        pins, self._pins = self._pins, {}
        if self.identity is not None:
            for blocks, _ in pins.values():
                self.identity.unpin(blocks)
