"""The real data-plane worker (``python -m kvd.worker``) behind its control-side handle (kvd.core.dataplane).

Two DataPlanes, each on a worker from its own WorkerLauncher, move bytes between two shm regions
through real NIXL over UCX (tcp, so a stopped holder really holds a read back), and the holder
gets the READ's notification. Then the reader's worker is SIGKILLed with a READ posted and calls
in flight: the DataPlane is lost once ("SIGKILL"), every call fails Unavailable, the READ is final
with an Unavailable error (the worker's death is the fence). A healthy worker stopped through its
DataPlane exits 0 and is reaped; a worker that stops answering (SIGSTOP) is found hung by the
heartbeat, killed and reaped. READ orders go on their own socket, read by the worker's NIXL
thread (the reading tests run that way and on the channel): a call other than ``reads`` there is
refused NotFound, and a corrupt stream ends the worker (lost, never left hung). No daemon runs
here: this is the channel and the worker themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvd.core.dataplane import LOCAL, DataPlane, XferState
from kvd.core.workers import WorkerLauncher, WorkerStartFailed
from kvd.dataplane_protocol import CALL, HEADER, MAX_BODY, MappedRegion, MemoryKind, RegionRequest, frame
from kvd_client.errors import NotFound, Unavailable
from kvd_client.shm import create_shm_tensor, new_shm_name, unlink_shm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BLOCK = 64 << 10
BLOCKS = 64  # 4 MiB per region
SIZE = BLOCK * BLOCKS
STEP_S = 20.0  # no single step of these tests may take longer (a worker starts in ~2 s)


@pytest.fixture(autouse=True)
def _tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers inherit the environment: over tcp a READ needs the holder's process to run."""
    monkeypatch.setenv("UCX_TLS", "tcp")


@pytest.fixture
def shm_regions() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine-side shm regions (``/dev/shm`` files): the test maps them, the workers map them too."""
    made: list[tuple[str, torch.Tensor]] = []

    def make() -> None:
        name = new_shm_name("kvdtest-dataplane")
        made.append((name, create_shm_tensor(name, SIZE)))

    for _ in range(2):
        make()
    yield made
    for name, _ in made:
        unlink_shm(name)


class Plane:
    """A DataPlane with what the test watches: its notifications and its on_lost calls."""

    def __init__(self, base: str, heartbeat_timeout_s: float = 10.0, orders_socket: bool = True) -> None:
        self.launcher = WorkerLauncher(
            base, ("UCX",), False, "WARNING", 0.0002, spare=False, orders_socket=orders_socket
        )
        self.lost: list[tuple[DataPlane, str]] = []
        self.lost_event = asyncio.Event()
        self.notifications: list[dict[str, list[bytes]]] = []
        self.notified = asyncio.Event()
        self.plane = DataPlane(launcher=self.launcher, heartbeat_timeout_s=heartbeat_timeout_s, on_lost=self._on_lost)

    def _on_lost(self, plane: DataPlane, reason: str) -> None:
        self.lost.append((plane, reason))
        self.lost_event.set()

    def _on_notifications(self, notifications: dict[str, list[bytes]]) -> None:
        self.notifications.append(notifications)
        self.notified.set()

    async def start(self) -> None:
        await self.plane.start(self._on_notifications)

    def process(self) -> asyncio.subprocess.Process:
        worker = self.plane._worker  # the process itself: the test checks its exit status
        assert worker is not None
        return worker.process

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.plane.stop()
        await self.launcher.close()


@contextlib.asynccontextmanager
async def planes(*planes: Plane) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(STEP_S):
            await asyncio.gather(*(p.start() for p in planes))
        yield
    finally:
        for plane in planes:
            await plane.close()


async def step(awaitable: Any) -> Any:
    async with asyncio.timeout(STEP_S):
        return await awaitable


def rows(region: MappedRegion) -> np.ndarray:
    """The region's blocks as NIXL descriptor rows: (address in the worker, length, device)."""
    addresses = region.address + BLOCK * np.arange(BLOCKS, dtype=np.int64)
    return np.stack([addresses, np.full(BLOCKS, BLOCK, np.int64), np.zeros(BLOCKS, np.int64)], axis=1)


async def expose(plane: DataPlane, shm_name: str) -> MappedRegion:
    """Map an engine's shm region in the worker and register it with NIXL."""
    (region,) = await step(plane.open_regions([RegionRequest(MemoryKind.SHM, SIZE, shm_name=shm_name)]))
    assert region.size_bytes == SIZE and not region.vram
    await step(plane.register(region.address, SIZE, 0, "DRAM"))
    assert any(r.covers(region.address, SIZE, 0, False) for r in plane.identity().regions)
    return region


def children() -> set[int]:
    """This process's children (zombies included: not reaped)."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found.update(int(p) for p in (task / "children").read_text().split())
    return found


def children_running(pids: set[int]) -> set[int]:
    """Which of ``pids`` are still this process's children (zombies included: not reaped)."""
    return children() & pids


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped: a signal is acted on when
    its target next runs, so the process may go on (and a READ finish) for a while after kill()."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STEP_S
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {STEP_S}s of SIGSTOP")


@pytest.mark.parametrize("orders_socket", [True, False], ids=["orders-socket", "orders-on-channel"])
def test_a_read_between_two_workers_then_the_reader_killed_mid_read(
    shm_regions: list[tuple[str, torch.Tensor]], orders_socket: bool
) -> None:
    (holder_shm, holder_memory), (reader_shm, reader_memory) = shm_regions
    holder_memory.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)))

    async def main() -> None:
        holder, reader = Plane("dptest-holder"), Plane("dptest-reader", orders_socket=orders_socket)
        async with planes(holder, reader):
            assert holder.plane.name == "dptest-holder" and reader.plane.name == "dptest-reader"
            assert holder.plane.pid != reader.plane.pid and holder.plane.alive and reader.plane.alive
            held = await expose(holder.plane, holder_shm)
            landed = await expose(reader.plane, reader_shm)
            assert await step(reader.plane.add_remote(holder.plane.identity().metadata)) == holder.plane.name
            remote = await step(asyncio.to_thread(reader.plane.prepare_table, holder.plane.name, rows(held), "DRAM"))
            local = await step(asyncio.to_thread(reader.plane.prepare_table, LOCAL, rows(landed), "DRAM"))

            # Some blocks, into other places: the index arrays cross the channel out of band.
            src, dst = np.array([5, 0, 63, 17], np.int32), np.array([1, 62, 7, 30], np.int32)
            xfer = await step(reader.plane.read(local, dst, remote, src, b"first-read", holder.plane.name, 4 * BLOCK))
            await step(reader.plane.wait([xfer]))
            assert xfer.final and xfer.state is XferState.DONE and xfer.error is None
            assert reader.plane.in_flight() == 0
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(
                    reader_memory[d * BLOCK : (d + 1) * BLOCK], holder_memory[s * BLOCK : (s + 1) * BLOCK]
                )
            untouched = sorted(set(range(BLOCKS)) - set(dst.tolist()))
            assert not reader_memory.view(BLOCKS, BLOCK)[untouched].any()
            await step(holder.notified.wait())
            assert holder.notifications == [{reader.plane.name: [b"first-read"]}]

            # A READ posted while the holder's worker is stopped (over tcp nothing moves without
            # it), the reader's worker stopped with calls sent to it, the holder resumed (the READ
            # still cannot finish: the reader does not run), and the reader's worker killed.
            # (The holder resumes before the reader dies: a holder that resumes only after a dead
            # reader's pending READ is aborted by UCX, "Endpoint timeout": not this test's subject.)
            stop(holder.plane.pid)
            try:
                everything = np.arange(BLOCKS, dtype=np.int32)
                posted = await step(
                    reader.plane.read(local, everything, remote, everything, b"never", holder.plane.name, SIZE)
                )
                assert not posted.final and reader.plane.in_flight() == 1
                reader_process = reader.process()
                stop(reader.plane.pid)
            finally:
                os.kill(holder.plane.pid, signal.SIGCONT)
            in_flight = [
                asyncio.ensure_future(reader.plane.ping()),
                asyncio.ensure_future(reader.plane.add_remote(holder.plane.identity().metadata)),
                asyncio.ensure_future(reader.plane.open_regions([RegionRequest(MemoryKind.SHM, SIZE, reader_shm)])),
                asyncio.ensure_future(asyncio.to_thread(reader.plane.prepare_table, LOCAL, rows(landed), "DRAM")),
            ]
            await asyncio.sleep(0.2)  # sent, never answered
            assert not any(call.done() for call in in_flight) and not posted.final
            os.kill(reader.plane.pid, signal.SIGKILL)
            await step(reader.lost_event.wait())

            assert reader.lost == [(reader.plane, "SIGKILL")]
            assert reader.plane.lost_reason == "SIGKILL" and not reader.plane.alive
            assert reader_process.returncode == -signal.SIGKILL  # reaped before it was reported lost
            assert not children_running({reader_process.pid})
            for call in in_flight:
                with pytest.raises(Unavailable, match="SIGKILL"):
                    await step(call)
            assert posted.final and posted.state is XferState.ERROR
            assert isinstance(posted.error, Unavailable) and "SIGKILL" in posted.error.message
            assert reader.plane.in_flight() == 0
            with pytest.raises(Unavailable):
                await step(reader.plane.wait([posted]))

            # Every later call fails Unavailable at once; the releases have nothing left to release.
            later = [
                reader.plane.ping(),
                reader.plane.add_remote(holder.plane.identity().metadata),
                reader.plane.open_regions([RegionRequest(MemoryKind.SHM, SIZE, reader_shm)]),
                reader.plane.register(landed.address, SIZE, 0, "DRAM"),
                reader.plane.read(local, everything, remote, everything, b"late", holder.plane.name, SIZE),
                reader.plane.duplicate_region(landed.region_id),
                asyncio.to_thread(reader.plane.prepare_table, LOCAL, rows(landed), "DRAM"),
            ]
            for call in later:
                with pytest.raises(Unavailable, match="gone \\(SIGKILL\\)"):
                    await step(call)
            await step(reader.plane.close_regions([landed.region_id]))
            await step(reader.plane.release_tables([local, remote]))
            await step(reader.plane.deregister(1))
            await step(reader.plane.remove_remote(holder.plane.name, []))
            await step(reader.plane.stop())
            await asyncio.sleep(HEARTBEAT_WAIT_S)
            assert len(reader.lost) == 1  # once, whatever came after

            # The holder lived through its stop and the reader's death; stopped, it exits 0.
            assert holder.plane.alive and holder.lost == []
            assert await step(holder.plane.ping()) < STEP_S
            holder_process = holder.process()
            await step(holder.plane.stop())
            assert holder_process.returncode == 0
            assert not children_running({holder_process.pid, reader_process.pid})
            assert holder.lost == []  # a stop is not a loss
            with pytest.raises(Unavailable):
                await step(holder.plane.ping())

    asyncio.run(main())


HEARTBEAT_WAIT_S = 1.5  # three heartbeats


def test_a_call_other_than_reads_on_the_orders_socket_is_refused_and_the_worker_serves_on() -> None:
    """The orders socket takes READ orders only: anything else is answered NotFound, on the
    channel, and changes nothing."""

    async def main() -> None:
        plane = Plane("dptest-orders-other")
        async with planes(plane):
            worker = plane.plane._worker
            assert worker is not None and worker.orders is not None
            answer = asyncio.get_running_loop().create_future()
            plane.plane._calls[10**9] = answer  # the channel's reply lands here, as any call's
            worker.orders.writelines(frame((CALL, 10**9, "release_tables", ((1, 2),))))
            with pytest.raises(NotFound, match="orders socket takes no 'release_tables'"):
                await step(answer)
            await step(plane.plane.ping())
            assert plane.plane.alive and not plane.lost

    asyncio.run(main())


def test_a_corrupt_orders_stream_ends_the_worker_and_its_plane_is_lost_not_hung() -> None:
    """READs that nobody reads would leave their pulls waiting while the heartbeat passes: a
    worker whose orders socket is corrupt ends at once, and the control process sees it lost."""

    async def main() -> None:
        plane = Plane("dptest-orders-corrupt", heartbeat_timeout_s=30.0)
        async with planes(plane):
            worker = plane.plane._worker
            assert worker is not None and worker.orders is not None
            process = plane.process()
            worker.orders.write(HEADER.pack(MAX_BODY + 1, 0))
            async with asyncio.timeout(STEP_S):  # well before any heartbeat could call it hung
                await plane.lost_event.wait()
            assert len(plane.lost) == 1 and plane.lost[0][1] != "hung"
            assert process.returncode == 0  # it ended itself, releasing what it held
            with pytest.raises(Unavailable):
                await step(plane.plane.ping())

    asyncio.run(main())


def test_a_worker_that_stops_answering_is_found_hung_killed_and_reaped() -> None:
    async def main() -> None:
        hung = Plane("dptest-hung", heartbeat_timeout_s=1.0)
        async with planes(hung):
            process = hung.process()
            await step(hung.plane.ping())
            stop(process.pid)
            pending = asyncio.ensure_future(hung.plane.ping())
            async with asyncio.timeout(10.0):  # a heartbeat every 0.5 s, each given 1 s
                await hung.lost_event.wait()
            assert hung.lost == [(hung.plane, "hung")]
            assert process.returncode == -signal.SIGKILL  # killed (stopped or not) and reaped
            assert not children_running({process.pid})
            with pytest.raises(Unavailable, match="hung"):
                await step(pending)
            with pytest.raises(Unavailable, match="hung"):
                await step(hung.plane.ping())
            await asyncio.sleep(HEARTBEAT_WAIT_S)
            assert len(hung.lost) == 1

    asyncio.run(main())


def test_a_worker_with_a_kill_pending_is_not_called_hung_and_is_reported_by_its_real_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGKILL sent while a worker's thread sits in an uninterruptible kernel call is acted on
    only when the call returns, and meanwhile the worker answers nothing. The heartbeat must not
    call that "hung" (killing it again would report SIGKILL as "hung"): it leaves the worker to
    die and the reader reports the real cause. The pending kill is stood in for (a real one
    cannot be held pending on demand): the worker is stopped, and WorkerProcess.kill_pending
    says a SIGKILL waits; the later real SIGKILL is what the plane reports."""
    from kvd.core.workers import WorkerProcess

    async def main() -> None:
        killed = Plane("dptest-killpending", heartbeat_timeout_s=1.0)
        async with planes(killed):
            process = killed.process()
            await step(killed.plane.ping())
            monkeypatch.setattr(WorkerProcess, "kill_pending", lambda self: True)
            stop(process.pid)
            await asyncio.sleep(1.0 + 3 * HEARTBEAT_WAIT_S)  # past the timeout, several beats on
            assert killed.lost == [], "a worker with a kill pending was called hung"
            assert process.returncode is None, "a worker with a kill pending was killed again"
            os.kill(process.pid, signal.SIGKILL)
            async with asyncio.timeout(10.0):
                await killed.lost_event.wait()
            assert killed.lost == [(killed.plane, "SIGKILL")]

    asyncio.run(main())


def test_a_worker_registering_memory_gets_time_for_its_size_and_then_no_more(
    shm_regions: list[tuple[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration is one NIXL call that answers no heartbeat, and over RDMA its time grows
    with the region (kvd.core.dataplane.REGISTER_BYTES_PER_S; here slowed so the 4 MiB region is
    given 5 s beyond the 1 s timeout). The worker is stopped (SIGSTOP) with a registration in
    flight: it is not killed within that allowance, and once resumed the registration completes
    and the heartbeat is answered again. Stopped for good with one in flight, it is found hung
    after the allowance, not before."""

    from kvd.core import dataplane as dataplane_module

    monkeypatch.setattr(dataplane_module, "REGISTER_BYTES_PER_S", SIZE / 5.0)
    (shm_name, _), _ = shm_regions

    async def main() -> None:
        busy = Plane("dptest-registering", heartbeat_timeout_s=1.0)
        async with planes(busy):
            plane = busy.plane
            (region,) = await step(plane.open_regions([RegionRequest(MemoryKind.SHM, SIZE, shm_name=shm_name)]))
            process = busy.process()
            stop(process.pid)
            registering = asyncio.ensure_future(plane.register(region.address, SIZE, 0, "DRAM"))
            await asyncio.sleep(3.0)  # past the heartbeat's timeout, well within the 6 s allowance
            assert busy.lost == [], "a worker registering memory was killed as hung within its allowance"
            os.kill(process.pid, signal.SIGCONT)
            registration = await step(registering)
            assert any(r.covers(region.address, SIZE, 0, False) for r in plane.identity().regions)
            await step(plane.ping())
            stop(process.pid)
            stopped_at = time.monotonic()
            deregistering = asyncio.ensure_future(plane.deregister(registration))
            async with asyncio.timeout(20.0):
                await busy.lost_event.wait()
            assert time.monotonic() - stopped_at >= 5.5, "killed before the deregistration's allowance"
            assert busy.lost == [(plane, "hung")]
            assert process.returncode == -signal.SIGKILL
            with pytest.raises(Unavailable, match="hung"):
                await step(deregistering)

    asyncio.run(main())


@pytest.mark.parametrize("orders_socket", [True, False], ids=["orders-socket", "orders-on-channel"])
def test_reads_asked_for_in_one_loop_turn_are_posted_together_each_with_its_own_outcome(
    shm_regions: list[tuple[str, torch.Tensor]], orders_socket: bool
) -> None:
    """READs asked for together travel in one call to the worker and one hop to its NIXL thread;
    each still gets its own Xfer, bytes and notification, and one naming a list the worker does
    not have fails alone (nothing of it posted) without touching the others."""
    (holder_shm, holder_memory), (reader_shm, reader_memory) = shm_regions
    holder_memory.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)))

    async def main() -> None:
        holder, reader = Plane("dptest-holder-many"), Plane("dptest-reader-many", orders_socket=orders_socket)
        async with planes(holder, reader):
            held = await expose(holder.plane, holder_shm)
            landed = await expose(reader.plane, reader_shm)
            await step(reader.plane.add_remote(holder.plane.identity().metadata))
            remote = await step(asyncio.to_thread(reader.plane.prepare_table, holder.plane.name, rows(held), "DRAM"))
            local = await step(asyncio.to_thread(reader.plane.prepare_table, LOCAL, rows(landed), "DRAM"))
            sent: list[str] = []
            submit = reader.plane._submit

            def recorded(op: str, *args: Any) -> Any:
                sent.append(op)
                return submit(op, *args)

            reader.plane._submit = recorded  # type: ignore[method-assign]

            reads = [
                reader.plane.read(
                    local,
                    np.array([i], np.int32),
                    remote,
                    np.array([BLOCKS - 1 - i], np.int32),
                    b"many-%d" % i,
                    holder.plane.name,
                    BLOCK,
                )
                for i in range(8)
            ]
            refused = reader.plane.read(
                local, np.array([9], np.int32), 10**9, np.array([0], np.int32), b"refused", holder.plane.name, BLOCK
            )
            *xfers, outcome = await step(asyncio.gather(*reads, refused, return_exceptions=True))
            assert isinstance(outcome, NotFound), outcome
            # One "reads" call carried all nine (a heartbeat's ping may have gone meanwhile).
            assert [op for op in sent if op != "ping"] == ["reads"]
            await step(reader.plane.wait(xfers))
            assert all(x.final and x.state is XferState.DONE and x.error is None for x in xfers)
            assert reader.plane.in_flight() == 0
            for i in range(8):
                src = BLOCKS - 1 - i
                assert torch.equal(
                    reader_memory[i * BLOCK : (i + 1) * BLOCK], holder_memory[src * BLOCK : (src + 1) * BLOCK]
                )
            assert not reader_memory[9 * BLOCK : 10 * BLOCK].any()  # the refused READ moved nothing
            seen: set[bytes] = set()
            async with asyncio.timeout(STEP_S):
                while len(seen) < 8:
                    await holder.notified.wait()
                    holder.notified.clear()
                    seen = {m for n in holder.notifications for m in n.get(reader.plane.name, [])}
            assert seen == {b"many-%d" % i for i in range(8)}

    asyncio.run(main())


def test_a_worker_that_cannot_start_and_one_killed_while_it_starts_are_told_apart() -> None:
    """The daemon exits when a new worker cannot start, and backs off when one was killed while
    it started (kvd.core.restarts): the launcher must tell the two apart. NIXL refusing the
    worker's agent (no such backend) is the first; a SIGKILL from outside during the imports is
    the second. Either way the process is reaped and nothing is left."""

    async def main() -> None:
        refused = WorkerLauncher("dptest-refused", ("NOSUCHBACKEND",), False, "WARNING", 0.0002, spare=False)
        try:
            with pytest.raises(WorkerStartFailed, match="NOSUCHBACKEND") as failed:
                await step(refused.take())
            assert not failed.value.killed
        finally:
            await refused.close()

        killed = WorkerLauncher("dptest-killed", ("UCX",), False, "WARNING", 0.0002, spare=False)
        before = children()
        taking = asyncio.ensure_future(killed.take())
        try:
            async with asyncio.timeout(STEP_S):
                while not (new := children() - before):
                    await asyncio.sleep(0.005)
            (pid,) = new
            os.kill(pid, signal.SIGKILL)  # while it imports torch and NIXL
            with pytest.raises(WorkerStartFailed, match="SIGKILL") as failed:
                await step(taking)
            assert failed.value.killed
            assert not children_running({pid})
        finally:
            await killed.close()

    asyncio.run(main())


@pytest.mark.parametrize("socket_name", ["channel", "orders"])
def test_a_worker_whose_socket_cannot_be_opened_is_reaped_with_no_socket_left(
    monkeypatch: pytest.MonkeyPatch, socket_name: str
) -> None:
    """A worker's two sockets are wrapped after its exec: the channel first (before any
    WorkerProcess owns the process), then the orders socket. Should either fail, the start fails
    as any other (WorkerStartFailed), the process is killed and reaped, and neither of the
    daemon's ends of the two socketpairs is left open."""

    async def main() -> None:
        async def refuse(*args: Any, **kwargs: Any) -> Any:
            raise OSError(f"no {socket_name} socket (test)")

        if socket_name == "channel":
            monkeypatch.setattr(asyncio, "open_connection", refuse)
        else:
            monkeypatch.setattr(asyncio.get_running_loop(), "create_unix_connection", refuse)
        launcher = WorkerLauncher(f"dptest-{socket_name}", ("UCX",), False, "WARNING", 0.0002, spare=False)
        fds_before = set(os.listdir("/proc/self/fd"))
        before = children()
        try:
            failed = rf"did not start: its sockets could not be set up \(no {socket_name} socket"
            with pytest.raises(WorkerStartFailed, match=failed):
                await step(launcher.take())
            assert not children_running(children() - before)
            await asyncio.sleep(0)  # the channel's transport (once made) closes its socket on the next turn
            assert set(os.listdir("/proc/self/fd")) - fds_before == set()
        finally:
            await launcher.close()

    asyncio.run(main())


def test_a_worker_asked_for_its_stacks_writes_every_threads_and_serves_on(capfd: pytest.CaptureFixture[str]) -> None:
    """What the daemon does before it kills a worker as hung (dump_stacks: SIGUSR1, faulthandler):
    the log gets every thread's Python stack, the NIXL thread's among them, and the signal itself
    ends nothing (a worker asked while it is merely slow goes on serving)."""

    async def main() -> None:
        asked = Plane("dptest-stacks")
        async with planes(asked):
            worker = asked.plane._worker
            assert worker is not None
            worker.dump_stacks()
            deadline = time.monotonic() + STEP_S
            written = ""
            while "nixl_thread.py" not in written and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                written += capfd.readouterr().err
            assert "Thread 0x" in written and "nixl_thread.py" in written, written  # its NIXL thread
            await step(asked.plane.ping())
            assert asked.lost == [] and worker.process.returncode is None

    asyncio.run(main())
