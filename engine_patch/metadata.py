"""What the scheduler half hands the worker half each step (vLLM's KVConnectorMetadata).

Plain, picklable data: vLLM ships it from the engine core to every worker process. vLLM never
type-checks connector metadata, so this module does not import vLLM (the facade in
:mod:`kvd_engine.connector` subclasses it with vLLM's marker base).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KvdConnectorMetadata", "PullSpec"]


@dataclasses.dataclass(frozen=True)
class PullSpec:
    """Pull ``remote`` (KvTransferParams fields) into this engine's ``local_block_ids``."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote: dict[str, Any]
    deadline_ms: int = 0
    # Hybrid models: local block ids of the KV cache groups after group 0, one tuple per group.
    local_group_block_ids: tuple[tuple[int, ...], ...] = ()
    # Not pulled: the scheduler found it cannot be (why). The worker reports it failed at once,
    # so vLLM recomputes it rather than waiting for KV that no pull will bring.
    refused: str = ""


@dataclasses.dataclass
class KvdConnectorMetadata:
    """One step's instructions for every worker rank."""

    pulls: list[PullSpec] = dataclasses.field(default_factory=list)
    # Watermarks the host knows exactly (no speculative decoding): num_computed + num_scheduled.
    host_commits: dict[str, int] = dataclasses.field(default_factory=dict)
    # Requests that finished: their final KV token count (exact: the scheduler corrected it).
    final_watermarks: dict[str, int] = dataclasses.field(default_factory=dict)
    # Requests that finished since the last step (their KV will not be written again).
    finished_req_ids: frozenset[str] = frozenset()
    # Requests whose blocks are held for a remote reader -> lease expiry (unix ms, 0: unknown) as
    # granted at hold time. Informational only: reader heartbeats renew the lease at the daemon,
    # so the worker frees the blocks on the daemon's finished_sending, never at this expiry.
    held: dict[str, int] = dataclasses.field(default_factory=dict)
