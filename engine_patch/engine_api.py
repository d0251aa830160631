"""The connector hooks an engine calls, without vLLM's types.

vLLM's ``KVConnectorBase_V1`` splits a connector into a scheduler half and a worker half and
calls them in a fixed order each step. The reference engine calls the *same* hooks in the
*same* order, so the kvd logic (:mod:`kvd_engine.scheduler`, :mod:`kvd_engine.worker`) is
written once against these protocols and wrapped for vLLM by :mod:`kvd_engine.connector`.

Per step, in order (vLLM 0.33's runner with ``defer_finalize`` under speculative decoding)::

    scheduler: get_num_new_matched_tokens / update_state_after_alloc (new requests)
               build_connector_meta(step)
    worker:    bind_connector_metadata -> start_load_kv
               forward: per layer wait_for_layer_load, KV write, save_kv_layer
               get_transfer_results(finished) / get_block_ids_with_load_errors
               sample -> NWOR commit -> propose drafts
               wait_for_save -> clear_connector_metadata
    scheduler: update_connector_output, request_finished (finished requests)

Differences from vLLM's signatures, kept deliberately small: block ids are a plain
``list[int]`` (one KV cache group) and the scheduler output is a :class:`StepView`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "ConnectorRequest",
    "NullSchedulerConnector",
    "NullWorkerConnector",
    "ScheduledRequest",
    "SchedulerConnector",
    "StepView",
    "TransferResults",
    "WorkerConnector",
]


class ConnectorRequest(Protocol):
    """What the scheduler half reads of a request (vLLM's ``Request`` has all of these)."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_computed_tokens: int

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as the scheduler planned it."""

    request_id: str
    num_computed_tokens: int  # before this step (optimistic under async spec decoding)
    num_scheduled_tokens: int
    num_draft_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class StepView:
    """The parts of a scheduler output the connector needs."""

    scheduled: Sequence[ScheduledRequest] = ()
    finished_req_ids: frozenset[str] = frozenset()


@dataclasses.dataclass
class TransferResults:
    """A worker's transfer completions for one step (vLLM's KVConnectorTransferResults)."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    failed_recving: set[str] = dataclasses.field(default_factory=set)


@runtime_checkable
class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, step: StepView) -> Any: ...

    def update_connector_output(self, results: TransferResults) -> None: ...

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class WorkerConnector(Protocol):
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None: ...

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None: ...

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def set_step_watermarks(self, request_ids: Sequence[str], watermarks: torch.Tensor) -> None: ...

    def wait_for_save(self) -> None: ...

    def clear_connector_metadata(self) -> None: ...

    def shutdown(self) -> None: ...


class NullSchedulerConnector:
    """A scheduler half that does nothing: the engine runs alone."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, step: StepView) -> Any:
        return None

    def update_connector_output(self, results: TransferResults) -> None:
        return None

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def shutdown(self) -> None:
        return None


class NullWorkerConnector:
    """A worker half that does nothing."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        return TransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def set_step_watermarks(self, request_ids: Sequence[str], watermarks: torch.Tensor) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def clear_connector_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
