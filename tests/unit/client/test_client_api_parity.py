"""The sync and asyncio front ends expose the same API: a method added to one is added to both."""

from __future__ import annotations

import inspect

import pytest

from kvd_client import AsyncEngineStream, AsyncKvdClient, EngineStream, KvdClient

PAIRS = [(KvdClient, AsyncKvdClient), (EngineStream, AsyncEngineStream)]


def _public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_same_public_names(sync: type, aio: type) -> None:
    assert _public(sync) == _public(aio)


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_same_parameters_and_defaults(sync: type, aio: type) -> None:
    """Same parameter names, kinds and defaults, in the same order, for every public method."""
    differing = []
    for name in sorted(_public(sync) & _public(aio)):
        a, b = inspect.getattr_static(sync, name), inspect.getattr_static(aio, name)
        if isinstance(a, property) or not callable(getattr(sync, name)):
            assert isinstance(b, property) == isinstance(a, property), name
            continue
        pa = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(sync, name)).parameters.values()]
        pb = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(aio, name)).parameters.values()]
        if pa != pb:
            differing.append(f"{name}: {pa} != {pb}")
    assert differing == []


def test_every_aio_call_is_awaitable_where_the_sync_one_returns() -> None:
    """RPC methods of the asyncio client are coroutines (or async iterators for streams)."""
    for name in sorted(_public(KvdClient)):
        attr = inspect.getattr_static(AsyncKvdClient, name)
        if isinstance(attr, property) or not callable(attr):
            continue
        fn = getattr(AsyncKvdClient, name)
        sync_fn = getattr(KvdClient, name)
        if inspect.isgeneratorfunction(sync_fn):
            assert inspect.isasyncgenfunction(fn), name
