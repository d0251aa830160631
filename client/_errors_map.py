"""The one place where gRPC errors become :mod:`kvd_client.errors` classes.

Callers catch ``errors.UnknownLease`` or ``errors.Unavailable``, never ``grpc.RpcError``: every
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

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


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
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    details = (details_fn() if callable(details_fn) else None) or ""
    trailing_fn = getattr(err, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    class_name = _metadata_value(trailing, errors.ERROR_CLASS_METADATA_KEY)
    return errors.from_status(code, details, class_name)


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
