"""The reference engine's requests and blocks, named as vLLM's ``Request`` and block pool see them."""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from kvd_engine.cache_layout import NULL_BLOCK

__all__ = [
    "BlockAllocator",
    "EngineRequest",
    "KvReadMismatch",
    "OutOfBlocks",
    "RequestStatus",
    "StepResult",
]


class OutOfBlocks(RuntimeError):
    """The engine's cache has no free block left."""


class KvReadMismatch(AssertionError):
    """Attention read KV bytes from the cache that are not what the tokens say they must be."""


class BlockAllocator:
    """Free list of block ids; block 0 is the null block and is never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        self._free.extend(block_ids)


class RequestStatus(enum.Enum):
    WAITING = "WAITING"
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    RUNNING = "RUNNING"
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"
    FINISHED_ABORTED = "FINISHED_ABORTED"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """One request, with the attributes the connector reads (named as vLLM's ``Request``)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_external_tokens: int = 0
    load_failed: bool = False
    output_kv_transfer_params: dict[str, Any] | None = None
    released_block_ids: list[int] = dataclasses.field(default_factory=list)  # for inspection after finish

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclasses.dataclass
class StepResult:
    """What one :meth:`~kvd.demo.reference_engine.ReferenceEngine.step` did."""

    step: int
    num_scheduled_tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    finished: list[str] = dataclasses.field(default_factory=list)
    attention: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # rank 0, last layer
