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
"""Longest status message the daemon sends (grpc's default metadata limit is 8 KiB)."""


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
    """At most MAX_DETAILS characters: a message quoting a huge input must not outgrow grpc's
    metadata limit (it would arrive as RESOURCE_EXHAUSTED instead of its own status)."""
    if len(message) <= MAX_DETAILS:
        return message
    return (
        message[: MAX_DETAILS // 2]
        + f"...({len(message) - MAX_DETAILS} characters elided)..."
        + message[-MAX_DETAILS // 4 :]
    )


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
