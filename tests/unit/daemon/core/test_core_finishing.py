"""Work a cancelled caller leaves running (kvd.core.finishing), and lists prepared meanwhile
(kvd.core.tables): the interleavings, with fakes for the worker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
from typing import Any

import numpy as np
import pytest

from kvd.core.finishing import Finishing
from kvd.core.tables import TableCache
from kvd_client.errors import Unavailable


def test_a_cancelled_caller_leaves_the_work_running_and_its_result_to_abandoned() -> None:
    async def scenario() -> None:
        finishing = Finishing("test")
        gate = asyncio.Event()
        steps: list[str] = []
        abandoned: list[str] = []

        async def work() -> str:
            steps.append("started")
            await gate.wait()
            steps.append("finished")
            return "made"

        caller = asyncio.ensure_future(finishing.run(work(), abandoned=abandoned.append))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert steps == ["started"] and len(finishing) == 1
        gate.set()
        await finishing.settle(5.0)
        assert steps == ["started", "finished"] and abandoned == ["made"] and len(finishing) == 0

    asyncio.run(scenario())


def test_a_caller_that_waits_gets_the_result_and_abandoned_is_not_called() -> None:
    async def scenario() -> None:
        finishing = Finishing("test")
        abandoned: list[int] = []

        async def work() -> int:
            await asyncio.sleep(0)
            return 7

        assert await finishing.run(work(), abandoned=abandoned.append) == 7
        assert abandoned == []

    asyncio.run(scenario())


def test_work_that_fails_after_its_caller_left_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        finishing = Finishing("test work")
        gate = asyncio.Event()
        abandoned: list[object] = []

        async def work() -> None:
            await gate.wait()
            raise Unavailable("the worker went away")

        caller = asyncio.ensure_future(finishing.run(work(), abandoned=abandoned.append))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        await finishing.settle(5.0)
        assert abandoned == []

    with caplog.at_level("INFO", logger="kvd.core.finishing"):
        asyncio.run(scenario())
    assert "test work whose caller gave up failed: the worker went away" in caplog.text


def test_settle_gives_up_after_its_timeout_on_work_that_never_ends() -> None:
    async def scenario() -> None:
        finishing = Finishing("hung")
        finishing.start(asyncio.Event().wait())
        loop = asyncio.get_running_loop()
        started = loop.time()
        await finishing.settle(0.05)
        assert 0.04 <= loop.time() - started < 2.0 and len(finishing) == 1

    asyncio.run(scenario())


@dataclasses.dataclass(frozen=True)
class FakeGeometry:
    """What TableCache asks of a geometry: rows to prepare, and a size to log."""

    planes: int = 2
    table_size: int = 2

    def strided(self, addresses: list[int], device_index: int) -> np.ndarray:
        return np.array([[address, 64, device_index] for address in addresses[: self.planes]], dtype=np.int64)


class FakePlane:
    """A worker whose list preparation blocks until ``proceed`` is set (a slow NIXL call)."""

    def __init__(self) -> None:
        self.proceed = threading.Event()
        self.entered = threading.Event()
        self.prepared: list[int] = []
        self.released: list[Any] = []
        self.deregistered = False
        self.prepared_after_deregister = False

    def prepare_table(self, agent_name: str, rows: np.ndarray, mem_type: str) -> int:
        self.entered.set()
        assert self.proceed.wait(10)
        if self.deregistered:
            self.prepared_after_deregister = True
        handle = len(self.prepared) + 100
        self.prepared.append(handle)
        return handle

    async def release_tables(self, tables: list[Any]) -> None:
        self.released.extend(tables)


def test_release_waits_for_a_list_whose_waiter_was_cancelled_and_releases_it() -> None:
    """The list is prepared before the memory is deregistered, and released, never cached."""

    async def scenario() -> None:
        plane = FakePlane()
        cache = TableCache(plane, "NIXL_INIT_AGENT")  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiter = asyncio.ensure_future(cache.get(1, FakeGeometry(), [4096], 0, "DRAM", pool))  # type: ignore[arg-type]
            await loop.run_in_executor(None, plane.entered.wait, 10)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            release = asyncio.ensure_future(cache.release())
            await asyncio.sleep(0.05)
            assert not release.done(), "the release must wait for the list still being prepared"
            plane.proceed.set()
            await asyncio.wait_for(release, 10)
            plane.deregistered = True  # what the owner does right after its release
        assert plane.prepared == [100] and plane.released == [100] and len(cache) == 0
        assert not plane.prepared_after_deregister
        with pytest.raises(Unavailable):
            await cache.get(1, FakeGeometry(), [4096], 0, "DRAM", pool)  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_two_waiters_share_one_preparation_and_a_cancelled_one_does_not_stop_it() -> None:
    async def scenario() -> None:
        plane = FakePlane()
        cache = TableCache(plane, "peer")  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = asyncio.ensure_future(cache.get(1, FakeGeometry(), [4096], 0, "DRAM", pool))  # type: ignore[arg-type]
            second = asyncio.ensure_future(cache.get(1, FakeGeometry(), [4096], 0, "DRAM", pool))  # type: ignore[arg-type]
            await loop.run_in_executor(None, plane.entered.wait, 10)
            first.cancel()
            plane.proceed.set()
            assert await asyncio.wait_for(second, 10) == 100
        assert plane.prepared == [100] and len(cache) == 1 and plane.released == []

    asyncio.run(scenario())
