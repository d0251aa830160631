"""The scheduler process's connection to its node's daemon (the worker's is :mod:`kvd_engine.worker_link`).

Blocking ``hold_blocks`` calls with a short deadline and a circuit breaker, so a dead daemon
costs one timeout, not one per request; and the scheduler stream (soft-hold checks down,
heartbeats and releases up), reopened from the step path (never blocking) after it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvd_client import errors
from kvd_client.records import as_fields, from_message
from kvd_client.v1.schema import KvTransferParams

from . import link_client
from .link_client import ClientFactory

if TYPE_CHECKING:
    from kvd_client import KvdClient, SchedulerStream
    from kvd_client.v1 import engine_pb2

logger = logging.getLogger(__name__)

__all__ = ["SchedulerLink", "held_fields"]

StreamFactory = Callable[["KvdClient", str], "SchedulerStream"]
"""(the link's client, engine id) -> that engine's scheduler stream."""


def _default_scheduler_stream(client: KvdClient, engine_id: str) -> SchedulerStream:
    from kvd_client import SchedulerStream  # noqa: PLC0415 - grpc loads with the first stream, not the import

    return SchedulerStream.over(client.channel, engine_id)


def held_fields(response: engine_pb2.HoldBlocksResponse) -> dict[str, Any]:
    """The KvTransferParams fields of a HoldBlocksResponse, as plain Python values."""
    return as_fields(from_message(KvTransferParams, response.kv_transfer_params))


class SchedulerLink:
    """Holds blocks for the scheduler process; fails fast while the daemon is known down."""

    def __init__(
        self,
        target: str,
        *,
        rpc_timeout_s: float = 2.0,
        retry_after_s: float = 2.0,
        client_factory: ClientFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream_factory: StreamFactory | None = None,
    ) -> None:
        self.target = target
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_after_s = retry_after_s
        self._client_factory = client_factory or link_client.default_client  # looked up now: tests replace it
        self._client: KvdClient | None = None
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._engine_id = ""
        self._stream: SchedulerStream | None = None
        self._stream_retry_at = 0.0
        self._stream_lost = False
        self._stream_factory = stream_factory or _default_scheduler_stream
        self.stream_opens = 0

    def available(self) -> bool:
        """False while a recent failure says the daemon is down (no call is made)."""
        return self._clock() >= self._down_until

    def hold_blocks(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ttl_ms: int = 0,
        group_block_ids: Sequence[Sequence[int]] = (),
        soft: bool = False,
    ) -> dict[str, Any]:
        """The KvTransferParams fields of a new lease; raises a KvdError when it cannot be had."""
        if not self.available():
            raise errors.Unavailable(f"kvd daemon at {self.target} is down (retrying later)")
        with self._lock:
            if self._client is None:
                self._client = self._client_factory(self.target, self._rpc_timeout_s)
            client = self._client
        try:
            fields: dict[str, Any] = {
                "engine_id": engine_id,
                "request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
                "ttl_ms": ttl_ms,
            }
            if soft:
                fields["soft"] = True
            if group_block_ids:  # a hybrid model: every group's blocks
                from kvd_client.v1 import engine_pb2  # noqa: PLC0415 - protobuf loads with the first hold

                fields = {
                    "request": engine_pb2.HoldBlocksRequest(
                        **fields,
                        group_block_ids=[int(b) for ids in group_block_ids for b in ids],
                        group_block_counts=[len(ids) for ids in group_block_ids],
                    )
                }
            response = client.hold_blocks(**fields, timeout_s=self._rpc_timeout_s)
        except (errors.Unavailable, errors.DeadlineExceeded):
            self._down_until = self._clock() + self._retry_after_s
            raise
        return held_fields(response)

    # -- the scheduler stream ------------------------------------------------------------------

    def start_stream(self, engine_id: str) -> None:
        """Open the engine's scheduler stream now (soft holds need it before the first hold)."""
        self._engine_id = engine_id
        self._ensure_stream()

    @property
    def stream_connected(self) -> bool:
        stream = self._stream
        return stream is not None and not stream.closed

    def _ensure_stream(self) -> SchedulerStream | None:
        """The open stream, or None; opens one (a non-blocking call) when due."""
        stream = self._stream
        if stream is not None and not stream.closed:
            return stream
        if stream is not None:
            self._stream = None
            self._stream_lost = True
            self._stream_retry_at = self._clock() + self._retry_after_s
            logger.info("kvd scheduler stream of %s ended: %s", self._engine_id, stream.error)
            try:
                stream.close(timeout_s=0.1)
            except Exception:  # a dead stream must not break the step path
                logger.debug("closing a dead scheduler stream failed", exc_info=True)
        if not self._engine_id or self._clock() < self._stream_retry_at:
            return None
        with self._lock:
            if self._client is None:
                self._client = self._client_factory(self.target, self._rpc_timeout_s)
            client = self._client
        try:
            self._stream = self._stream_factory(client, self._engine_id)
        except Exception:  # never let the step path fail on the daemon
            logger.exception("kvd scheduler stream of %s could not open", self._engine_id)
            self._stream_retry_at = self._clock() + self._retry_after_s
            return None
        self.stream_opens += 1
        return self._stream

    def poll_commands(self) -> tuple[list[engine_pb2.SchedulerCommand], bool]:
        """The daemon's commands since the last poll, and whether the stream was lost meanwhile
        (then every soft hold and pin of the old stream is void). Never blocks."""
        stream = self._ensure_stream()
        lost, self._stream_lost = self._stream_lost, False
        return (stream.poll() if stream is not None else []), lost

    def send_check_result(self, seq: int, ok: bool, reason: str = "") -> bool:
        stream = self._stream
        return stream is not None and stream.send_check_result(seq, ok, reason)

    def renew(self, leases: Sequence[tuple[str, str]]) -> bool:
        """Heartbeat for ``(holder daemon address, lease id)`` leases (best effort)."""
        stream = self._ensure_stream()
        return stream is not None and stream.send_renew(leases)

    def release(self, leases: Sequence[tuple[str, str]], reason: str) -> bool:
        """Nobody here will read these leases (best effort: unreleased ones expire)."""
        stream = self._ensure_stream()
        return stream is not None and stream.send_release(leases, reason)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        self._engine_id = ""
        if stream is not None:
            stream.close(timeout_s=1.0)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
