"""The kv_transfer_params a router forwards from the holder's engine to the puller's."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TransferParams:
    daemon_address: str
    daemon_incarnation: str
    engine_id: str
    tp_size: int
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    request_id: str
    lease_expires_unix_ms: int = 0
