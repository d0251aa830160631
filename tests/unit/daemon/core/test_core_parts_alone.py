"""The daemon core's parts built alone from a :class:`kvd.core.context.CoreContext`, no facade.

Each part names in its constructor only what is its own; the tables come from the context. These
tests build the context by hand (real tables, the lifetime fakes' data plane over real shared
memory) and drive :class:`Engines`, :class:`Holds` and :class:`Holder` without a
:class:`kvd.core.daemon.Daemon`, which is what lets a change to one part be tested on its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kvtest import small_spec
from lifetime_fakes import Fabric, FakeDataPlane

from kvd.config import KvdConfig
from kvd.core.commits import CommitTracker
from kvd.core.context import CoreContext
from kvd.core.engines import Engines
from kvd.core.events import FinishedSending
from kvd.core.holdchecks import HoldChecks
from kvd.core.holder import Holder
from kvd.core.holds import Holds
from kvd.core.leases import LeaseEnd, LeaseTable
from kvd.core.local_memory import Memories, MemoryState
from kvd.core.metrics import Metrics
from kvd.core.peers import PrepareRequest
from kvd.core.registry import EngineRank, Registry
from kvd.core.transfers import TransferTable
from kvd.layout.spec import LayoutSpec, contiguous_placements
from kvd_client.errors import InvalidArgument, NotFound, Unavailable


class _NamedLauncher:
    """All FakeDataPlane needs of a worker launcher: a name for the agent."""

    def reserve_name(self) -> str:
        return "kvd-parts-alone"


@dataclasses.dataclass
class Parts:
    ctx: CoreContext
    dataplane: FakeDataPlane
    engines: Engines
    holds: Holds
    holder: Holder
    lease_ends: list[LeaseEnd]
    serving: list[bool]
    fabric: Fabric  # the fake data plane's, and the shared memory of the ranks registered

    async def register(self, engine_id: str, spec: LayoutSpec) -> EngineRank:
        return await self.engines.register(engine_id, spec, self.fabric.shm_regions(spec), contiguous_placements(spec))


@contextlib.asynccontextmanager
async def built_parts() -> AsyncIterator[Parts]:
    loop = asyncio.get_running_loop()
    config = KvdConfig(metrics_port=-1, staging_pool_bytes=0, read_admission_margin_s=5.0)
    metrics = Metrics()
    fabric = Fabric()
    dataplane = fabric.make_dataplane(launcher=_NamedLauncher())
    await dataplane.start(lambda _notifications: None)
    memories = Memories(dataplane, metrics)  # type: ignore[arg-type]
    lease_ends: list[LeaseEnd] = []
    serving = [True]
    late: dict[str, Callable[..., None]] = {}  # the parts the lease table calls back, built after it
    leases = LeaseTable(
        on_admission_over=lambda admission: late["admission_over"](admission),
        on_lease_over=lambda lease, how: (lease_ends.append(how), late["lease_over"](lease, how)),
        admission_margin_s=5.0,
    )

    def require_serving() -> None:
        if not serving[0]:
            raise Unavailable("shutting down")

    executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    ctx = CoreContext(
        config,
        metrics,
        "incarnation-parts",
        Registry(),
        leases,
        CommitTracker(),
        HoldChecks(),
        TransferTable(),
        executor,
        dataplane=lambda: dataplane,  # type: ignore[arg-type, return-value]
        memories=lambda: memories,
        loop=lambda: loop,
        require_serving=require_serving,
        require_dataplane=lambda: None,
    )
    holds = Holds(ctx, advertise_address=lambda: "parts.test:1")
    holder = Holder(ctx, agent_name=lambda: dataplane.name)
    late["lease_over"], late["admission_over"] = holds.lease_over, holder.admission_over
    made = Parts(ctx, dataplane, Engines(ctx), holds, holder, lease_ends, serving, fabric)
    try:
        yield made
    finally:
        for rank in list(ctx.registry):
            await made.engines.unregister(rank, "test over")
        await holder.followups.settle(5.0)
        executor.shutdown(wait=True)
        await fabric.close()


def run(scenario: Callable[[Parts], Awaitable[None]]) -> None:
    async def main() -> None:
        async with built_parts() as parts:
            await scenario(parts)
            assert parts.fabric.violations == []

    asyncio.run(main())


def test_engines_alone_register_a_rank_and_unregistering_it_deregisters_its_memory() -> None:
    async def scenario(parts: Parts) -> None:
        rank = await parts.register("eng-a", small_spec())
        assert list(parts.ctx.registry) == [rank]
        registrations = list(rank.memory.nixl_registrations)
        assert registrations and not any(parts.dataplane.deregistered(r) for r in registrations)

        await parts.engines.unregister_engine("eng-a", 0)

        assert list(parts.ctx.registry) == []
        assert rank.memory.state is MemoryState.RELEASED
        assert all(parts.dataplane.deregistered(r) for r in registrations)

    run(scenario)


def test_holds_alone_a_released_lease_tells_its_engine_finished_sending_once() -> None:
    async def scenario(parts: Parts) -> None:
        rank = await parts.register("eng-h", small_spec())
        lease, params = parts.holds.hold("eng-h", "req-1", [0, 1, 2], 40)
        assert params.engine_id == "eng-h" and params.daemon_address == "parts.test:1"
        assert parts.holds.lookup_held("eng-h", "req-1") == [params]

        parts.holds.release_lease(lease.lease_id)

        assert parts.lease_ends == [LeaseEnd.RELEASED]
        sent = [event for event in rank.pending if isinstance(event, FinishedSending)]
        assert [(event.request_id, event.lease_id, event.expired) for event in sent] == [
            ("req-1", lease.lease_id, False)
        ]
        assert parts.holds.lookup_held("eng-h", "req-1") == []
        with pytest.raises(NotFound):
            parts.holds.release_lease(lease.lease_id)

    run(scenario)


def test_holds_alone_refuse_a_hold_once_the_daemon_stops_serving_and_change_nothing() -> None:
    async def scenario(parts: Parts) -> None:
        await parts.register("eng-h", small_spec())
        parts.serving[0] = False
        with pytest.raises(Unavailable):
            parts.holds.hold("eng-h", "req-1", [0], 16)
        assert len(parts.ctx.leases) == 0

    run(scenario)


def test_holder_alone_admits_a_read_of_a_held_lease_and_refuses_a_wrong_prefix() -> None:
    async def scenario(parts: Parts) -> None:
        rank = await parts.register("eng-h", small_spec())
        lease, _ = parts.holds.hold("eng-h", "req-1", [0, 1, 2], 40)
        request = PrepareRequest(lease.lease_id, "eng-h", (0, 1, 2), 40, 0, 1, (0,))

        with pytest.raises(InvalidArgument, match="not a prefix"):
            await parts.holder.prepare_pull(dataclasses.replace(request, block_ids=(1, 2)))
        assert rank.memory.holder_pins == 0

        result = await parts.holder.prepare_pull(request, reader_address="reader.test:1", reader_incarnation="r1")

        assert result.registration_ids == (rank.registration_id,)
        assert rank.memory.holder_pins == 1 and parts.ctx.leases.open_admissions == 1
        parts.holder.abandon_pull(lease.lease_id, 0, "test", "r1")
        await parts.holder.followups.settle(5.0)
        assert rank.memory.holder_pins == 0 and parts.ctx.leases.open_admissions == 0

    run(scenario)


def test_an_admission_names_the_registrations_it_pinned_when_the_rank_is_re_mapped_during_a_soft_pin() -> None:
    """A soft lease's admission awaits the engine's pin; the rank re-mapped meanwhile (this daemon
    fencing a read of its own) has a new registration by the answer. The answer names the pinned
    one, which the reader planned on: naming the new one read as "admitted nothing" to the reader,
    which then never ended the admission (the fleet saw it time out and retire the memory)."""

    async def scenario(parts: Parts) -> None:
        rank = await parts.register("eng-h", small_spec())
        pinned = rank.memory
        checks = parts.holder.holdchecks
        checks.connected = lambda engine_id: True  # type: ignore[method-assign]

        async def pin_while_re_mapped(*_args: object) -> tuple[bool, str]:
            rank.memory = dataclasses.replace(pinned, registration_id=pinned.registration_id + 100)
            return True, ""

        checks.check = pin_while_re_mapped  # type: ignore[method-assign]
        checks.unpin = lambda *_args: None  # type: ignore[method-assign]
        lease, _ = parts.holds.hold("eng-h", "req-1", [0, 1, 2], 40, soft=True)
        request = PrepareRequest(
            lease.lease_id, "eng-h", (0, 1, 2), 40, 0, 1, (0,), read_id="t1", registration_ids=(pinned.registration_id,)
        )

        result = await parts.holder.prepare_pull(request, reader_address="reader.test:1", reader_incarnation="r1")

        assert rank.registration_id == pinned.registration_id + 100, "re-mapped while the engine pinned"
        assert result.registration_ids == (pinned.registration_id,), "the answer names what was admitted"
        assert pinned.holder_pins == 1 and parts.ctx.leases.open_admissions == 1
        parts.holder.abandon_pull(lease.lease_id, 0, "test", "r1", reader_transfer_id="")
        await parts.holder.followups.settle(5.0)
        assert pinned.holder_pins == 0 and parts.ctx.leases.open_admissions == 0

    run(scenario)
