"""The one place where gRPC status codes meet :mod:`kvd_client.errors`: every edge uses it.

* The client (sync and asyncio) and the daemon's peer client turn ``grpc.RpcError`` into the
  kvd class the daemon raised (:func:`to_kvd_error`);
* the daemon's server edge turns a :class:`~kvd_client.errors.KvdError` into a status code and
  trailing metadata (:func:`status_code`, :func:`error_metadata`).

Codes are mapped by name (kvd's :class:`~kvd_client.errors.ErrorCode` uses the canonical names).
Client callers catch ``errors.UnknownLease`` or ``errors.Unavailable``, never ``grpc.RpcError``: every
client method goes through :func:`translate` (sync) or :func:`translate_async`, and streaming
methods through :func:`translate_iter` / :func:`translate_aiter`. The daemon names the exact
class in trailing metadata (``kvd-error-class``); without it the status code table gives the
general class. The original RpcError is chained (``raise ... from``) so its debug string survives.
"""

from __future__ import annotations

import functools
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
)
from typing import Any, ParamSpec, TypeVar

import grpc

from . import errors
from .errors import ErrorCode

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def status_code(code: ErrorCode) -> grpc.StatusCode:
    """The gRPC status code a kvd error code travels as."""
    return grpc.StatusCode[code.name]


def error_code(status: grpc.StatusCode) -> ErrorCode:
    """The kvd error code of a gRPC status code."""
    return ErrorCode[status.name]


def error_metadata(exc: errors.KvdError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming the exact class, so the other side rebuilds the same class."""
    return ((errors.ERROR_CLASS_METADATA_KEY, type(exc).__name__),)


def error_class_name(err: grpc.RpcError) -> str:
    """The exact class a daemon named in an error's trailing metadata, or ""."""
    trailing_fn = getattr(err, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    return _metadata_value(trailing, errors.ERROR_CLASS_METADATA_KEY)


def _metadata_value(metadata: Iterable[Any] | None, key: str) -> str:
    """The value of ``key`` in grpc metadata (sync tuples or aio ``Metadata``), or ""."""
    if not metadata:
        return ""
    for item in metadata:
        k, v = item[0], item[1]
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
    return ""


def to_kvd_error(err: grpc.RpcError) -> errors.KvdError:
    """The kvd error an RpcError stands for (works for sync and aio errors alike)."""
    return errors.from_status(rpc_error_code(err), rpc_error_details(err), error_class_name(err))


def rpc_error_code(err: grpc.RpcError) -> ErrorCode:
    """The kvd code of an RpcError (UNKNOWN when it carries none)."""
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else None
    return error_code(code) if isinstance(code, grpc.StatusCode) else ErrorCode.UNKNOWN


def rpc_error_details(err: grpc.RpcError) -> str:
    """The details string of an RpcError ("" when it carries none)."""
    details_fn = getattr(err, "details", None)
    return str((details_fn() if callable(details_fn) else None) or "")


def translate(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: a sync call whose RpcErrors come out as kvd errors."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            raise to_kvd_error(err) from err

    return wrapper


def translate_async(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Decorator: a coroutine whose RpcErrors (``grpc.aio.AioRpcError``) come out as kvd errors."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except grpc.RpcError as err:
            raise to_kvd_error(err) from err

    return wrapper


def translate_iter(call: Iterator[T]) -> Generator[T, None, None]:
    """Iterate a server-streaming call, translating its errors and cancelling it if abandoned.

    A caller that stops early (``break``, an exception) closes this generator; the call is then
    cancelled so that the daemon stops producing and the channel frees the stream.
    """
    try:
        yield from call
    except grpc.RpcError as err:
        raise to_kvd_error(err) from err
    finally:
        cancel = getattr(call, "cancel", None)
        if callable(cancel):
            cancel()


async def translate_aiter(call: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """The asyncio counterpart of :func:`translate_iter`."""
    try:
        async for item in call:
            yield item
    except grpc.RpcError as err:
        raise to_kvd_error(err) from err
    finally:
        cancel = getattr(call, "cancel", None)
        if callable(cancel):
            cancel()
