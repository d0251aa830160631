"""What the daemon tells an engine on its stream (core-level; the server turns them into protos)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FinishedSending:
    """A lease on the engine's blocks ended: the engine may reuse them."""

    request_id: str
    lease_id: str
    expired: bool


@dataclasses.dataclass(frozen=True)
class FinishedRecving:
    """A pull into the engine's blocks finished: the blocks hold the remote KV."""

    request_id: str
    transfer_id: str


@dataclasses.dataclass(frozen=True)
class LoadFailed:
    """A pull into the engine's blocks failed: the blocks are not loaded, recompute them."""

    request_id: str
    transfer_id: str
    error_code: str
    error_message: str
    block_ids: tuple[int, ...]
    error_class: str = ""  # the KvdError subclass's name, so the engine sees the exact class


EngineEvent = FinishedSending | FinishedRecving | LoadFailed
