"""The server edge: kvd errors -> gRPC status codes, once, for every RPC.

A KvdError travels as its class's status code with its message, and the class name in the
trailing metadata (the client rebuilds the same class). Anything else is a bug: logged with
its traceback, and the caller gets INTERNAL with a generic message.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from kvd.core.metrics import Metrics
from kvd_client.errors import ErrorCode, Internal, KvdError
from kvd_client.grpc_errors import error_metadata, status_code

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

MAX_DETAILS = 2000
"""Longest printable-ASCII status message sent whole (grpc's default metadata limit is 8 KiB)."""
MAX_DETAILS_WIRE_BYTES = 4000
"""Longest status message on the wire, percent-encoded (see :func:`bounded`)."""


def as_kvd_error(metrics: Metrics | None, operation: str, exc: BaseException) -> KvdError:
    """The error a caller of ``operation`` gets for ``exc``, counted: itself if it is a kvd
    error; anything else is a bug, logged with its traceback, and the caller gets Internal."""
    if not isinstance(exc, KvdError):
        logger.exception("internal error in %s", operation, exc_info=exc)
        exc = Internal(f"internal error in {operation}; see the daemon's log")
    if metrics is not None:
        metrics.errors.labels(operation, exc.code.name).inc()
    return exc


async def _abort(
    context: grpc.aio.ServicerContext, metrics: Metrics | None, operation: str, exc: BaseException
) -> None:
    error = as_kvd_error(metrics, operation, exc)
    code: ErrorCode = error.code
    context.set_trailing_metadata(error_metadata(error))
    await context.abort(status_code(code), bounded(error.message))


def bounded(message: str) -> str:
    """A status message that fits grpc's metadata limit whatever it quotes.

    grpc sends it as the ``grpc-message`` header, percent-encoded: every UTF-8 byte outside
    printable ASCII costs three bytes there, so a message quoting a 4096-character id of
    non-ASCII characters would outgrow the caller's 8 KiB limit and arrive as RESOURCE_EXHAUSTED
    instead of its own status. Longer than MAX_DETAILS_WIRE_BYTES encoded, the middle is elided.
    """
    if len(message) <= MAX_DETAILS and message.isascii() and message.isprintable():
        return message  # at most MAX_DETAILS bytes on the wire
    costs = [_wire_bytes(ch) for ch in message]
    if sum(costs) <= MAX_DETAILS_WIRE_BYTES:
        return message
    head = _fitting(costs, MAX_DETAILS_WIRE_BYTES // 2)
    tail = _fitting(costs[::-1], MAX_DETAILS_WIRE_BYTES // 4)
    elided = len(message) - head - tail
    return message[:head] + f"...({elided} characters elided)..." + (message[-tail:] if tail else "")


def _wire_bytes(ch: str) -> int:
    """What one character costs percent-encoded in ``grpc-message`` (printable ASCII but '%': 1)."""
    if " " <= ch <= "~" and ch != "%":
        return 1
    return 3 * len(ch.encode("utf-8", "surrogatepass"))


def _fitting(costs: list[int], budget: int) -> int:
    """How many of ``costs``, taken from the start, fit in ``budget``."""
    total = 0
    for count, cost in enumerate(costs):
        total += cost
        if total > budget:
            return count
    return len(costs)


def rpc(method: F) -> F:
    """Wrap a servicer method (unary or streaming) so core errors become precise statuses."""
    operation = method.__name__

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in method(self, request, context):
                    yield item
            except (KvdError, Exception) as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, getattr(self, "metrics", None), operation, exc)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - this is the one mapping point
            await _abort(context, getattr(self, "metrics", None), operation, exc)

    return unary_wrapper  # type: ignore[return-value]
