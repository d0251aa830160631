"""The bench's rig: two real daemons on loopback, an engine on one, a bare NIXL agent beside them.

The holder ("peer") serves its daemon-owned scratch cache (``SelftestHold``: a checksummed
pattern, Llama-8B-shaped, see :mod:`kvd.core.scratch`); every hold is a fresh lease on the same
bytes. The reader ("local") has an engine registered by this process (a shm cache, zero-copy,
exactly as an engine registers) and pulls into it the way an engine does: ``StartPull`` over its
Unix socket (or an engine step's pulls in one ``StartPulls``), completion as ``FinishedRecving`` on
the engine stream (no per-pull watch). The raw
baseline is a bare NIXL agent in this process reading the holder's scratch registration: the
same bytes from the same peer, one descriptor, polled without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvd.bench.cpu import cpu_seconds, split_cpu_seconds
from kvd.bench.leftovers import segment_name
from kvd.spawn import DaemonProcess, launch_daemon, stop_launches, wait_ready
from kvd_client import errors
from kvd_client.aio import AsyncKvdClient
from kvd_client.v1 import common_pb2, engine_pb2, peer_pb2, peer_pb2_grpc, router_pb2

BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # one block of the scratch layout: 2 MiB (kvd.core.scratch)
BLOCK_PLANES = 32 * 2  # a scratch block lies in one piece per layer and K/V: 64 of 32 KiB


@dataclasses.dataclass
class Daemons:
    """The bench's daemons: the reader, the holder, and fresh holders for first-contact samples."""

    local: DaemonProcess
    peer: DaemonProcess
    fresh: list[DaemonProcess]

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the reader's and the holder's control processes and of their
        data-plane workers (each daemon's child processes)."""
        reader, reader_workers = split_cpu_seconds(self.local.process.pid)
        holder, holder_workers = split_cpu_seconds(self.peer.process.pid)
        return {"reader": reader, "reader worker": reader_workers, "holder": holder, "holder worker": holder_workers}

    def holder_cpu(self) -> float:
        """CPU seconds so far of the holder's whole tree: what serving a raw READ of its
        registration costs it (the raw agent reads the holder's scratch)."""
        return cpu_seconds(self.peer.process.pid)

    def every_cpu(self) -> dict[str, float]:
        """CPU seconds so far of every daemon's process tree (control process, worker, spare):
        reader, holder, fresh holders."""
        return {
            "reader": cpu_seconds(self.local.process.pid),
            "holder": cpu_seconds(self.peer.process.pid),
            **{f"fresh holder {i}": cpu_seconds(d.process.pid) for i, d in enumerate(self.fresh)},
        }


# A daemon is ready before it is settled: its spare data-plane worker starts right after the first
# worker serves and imports torch and NIXL for seconds of CPU. Measured beside it on two cores, a
# 2 MiB pull's control overhead doubled (docs/performance.md, "Measure settled daemons"). The bench
# waits until every daemon's tree spends under SETTLE_BUSY of a core for SETTLE_QUIET_WINDOWS windows.
SETTLE_WINDOW_S = 0.5
SETTLE_BUSY = 0.1
SETTLE_QUIET_WINDOWS = 2
SETTLE_TIMEOUT_S = 90.0


async def wait_settled(daemons: Daemons, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[float, bool]:
    """Wait until every daemon's process tree (control process, worker, spare) is quiet: (seconds
    waited, whether it settled). One still busy after ``timeout_s`` is measured anyway (said so)."""
    started = time.monotonic()
    quiet = 0
    before = daemons.every_cpu()
    while time.monotonic() - started < timeout_s:
        await asyncio.sleep(SETTLE_WINDOW_S)
        after = daemons.every_cpu()
        busiest = max(after[name] - before.get(name, 0.0) for name in after)
        before = after
        quiet = quiet + 1 if busiest < SETTLE_BUSY * SETTLE_WINDOW_S else 0
        if quiet >= SETTLE_QUIET_WINDOWS:
            return time.monotonic() - started, True
    return time.monotonic() - started, False


def start_daemons(stack: contextlib.ExitStack, workdir: Path, fresh_peers: int) -> Daemons:
    """Start the reader, the holder and ``fresh_peers`` more holders, side by side."""
    names = ["local", "peer", *(f"fresh{i}" for i in range(fresh_peers))]
    launches = [launch_daemon(workdir, name, ["--log-level", "WARNING"]) for name in names]
    stack.callback(stop_launches, launches)
    started = [wait_ready(launch, ready_timeout_s=120.0) for launch in launches]
    return Daemons(started[0], started[1], started[2:])


class Engine:
    """An engine rank on the reader daemon: its shm cache, its stream, its completions."""

    def __init__(self, client: AsyncKvdClient, capacity_blocks: int) -> None:
        from kvd.core import scratch  # noqa: PLC0415 - torch: only once the daemons are starting
        from kvd.layout.spec import contiguous_placements  # noqa: PLC0415
        from kvd.server import convert  # noqa: PLC0415
        from kvd_client.shm import create_shm_tensor  # noqa: PLC0415

        self.client = client
        self.spec = scratch.scratch_layout(capacity_blocks * BLOCK_BYTES)
        self.engine_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.shm_name = segment_name(os.getpid(), uuid.uuid4().hex[:8])
        self.buffer = create_shm_tensor(self.shm_name, self.spec.total_bytes)
        # Resident, as an engine's KV cache is once allocated: a page of a new shm file is only
        # allocated when first written, and the first pull into it paid that (~2.5 ms per 2 MiB
        # of page faults in the reader's worker), counted as the first pull's own cost.
        self.buffer.zero_()
        self._layout = convert.layout_to_pb(self.spec)
        self._layers = [convert.placement_to_pb(p) for p in contiguous_placements(self.spec)]
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._started_on_stream: dict[int, list[str]] = {}  # seq -> its pulls' request ids
        self._transfer_ids: dict[str, str] = {}  # request id -> transfer id, from the stream's answers
        self._stream: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.last_transfer_id = ""
        self.block_bytes = BLOCK_BYTES
        self.framed = False  # whether its engine stream runs over the framed socket (set by open)

    @property
    def capacity_blocks(self) -> int:
        return self.spec.num_blocks

    async def open(self) -> None:
        await self.client.register_kv_cache(
            engine_id=self.engine_id,
            layout=self._layout,
            regions=[
                common_pb2.MemoryRegion(
                    kind=common_pb2.MEMORY_KIND_SHM, size_bytes=self.spec.total_bytes, shm_name=self.shm_name
                )
            ],
            layers=self._layers,
            engine_pid=os.getpid(),
        )
        self._stream = self.client.open_engine_stream(self.engine_id, 0)
        self._reader = asyncio.get_running_loop().create_task(self._receive())
        await self.wait_takes_pulls()
        self.framed = bool(self._stream.framed)  # over the daemon's framed socket, or gRPC

    async def close(self) -> None:
        from kvd_client.shm import unlink_shm  # noqa: PLC0415

        if self._stream is not None:
            await self._stream.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        with contextlib.suppress(errors.KvdError):
            await self.client.unregister_kv_cache(engine_id=self.engine_id, tp_rank=0)
        unlink_shm(self.shm_name)

    async def wait_takes_pulls(self, timeout_s: float = 10.0) -> None:
        """Until the daemon says it takes pulls on the engine stream (its first message)."""
        deadline = time.monotonic() + timeout_s
        while not self._stream.takes_pulls:
            if self._stream.closed or time.monotonic() > deadline:
                raise errors.Internal("the daemon does not take pulls on the engine stream")
            await asyncio.sleep(0.001)

    def _answered(self, answer: Any) -> None:
        """A stream's PullsStarted: each pull's transfer id, or its refusal (its waiter fails)."""
        from kvd_client import pull_results  # noqa: PLC0415

        request_ids = self._started_on_stream.pop(answer.seq)
        for request_id, result in zip(request_ids, pull_results(answer, len(request_ids)), strict=True):
            if isinstance(result, errors.KvdError):
                waiter = self._waiters.pop(request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(result)
            else:
                self._transfer_ids[request_id] = result

    async def _start(self, requests: list[router_pb2.StartPullRequest], how: str) -> None:
        """Start ``requests`` the way ``how`` says: ``stream`` (one message on the engine stream,
        as the engine patch does), ``batched`` (one StartPulls) or ``single`` (a StartPull each)."""
        if how == "stream":
            seq = self._stream.send_start_pulls(requests)
            if not seq:
                raise errors.Internal("the engine stream does not take pulls (ended, or an older daemon)")
            self._started_on_stream[seq] = [r.request_id for r in requests]
        elif how == "batched":
            for result in await self.client.start_pulls(requests):
                if isinstance(result, errors.KvdError):
                    raise result
        else:
            answers = await asyncio.gather(*(self.client.start_pull(request=r) for r in requests))
            for request, started in zip(requests, answers, strict=True):
                self._transfer_ids[request.request_id] = started.transfer_id

    async def _receive(self) -> None:
        async for message in self._stream:
            kind = message.WhichOneof("kind")
            if kind == "pulls_started":
                self._answered(message.pulls_started)
            elif kind == "finished_recving":
                waiter = self._waiters.pop(message.finished_recving.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif kind == "load_failed":
                body = message.load_failed
                waiter = self._waiters.pop(body.request_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(errors.Internal(f"pull failed: {body.error_code}: {body.error_message}"))

    async def pull(self, params: common_pb2.KvTransferParams, first_block: int, how: str = "stream") -> float:
        """One pull of a held scratch into blocks ``first_block...``: seconds from its start (on
        the engine stream, as the engine patch starts it; ``how="single"``: a StartPull call) to
        FinishedRecving on the engine stream (what an engine waits)."""
        blocks = len(params.block_ids)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[params.request_id] = waiter
        request = router_pb2.StartPullRequest(
            engine_id=self.engine_id,
            tp_rank=0,
            request_id=params.request_id,
            local_block_ids=range(first_block, first_block + blocks),
            remote=params,
        )
        t0 = time.perf_counter()
        try:
            await self._start([request], how)
            await waiter
        finally:
            self._waiters.pop(params.request_id, None)
            self.last_transfer_id = self._transfer_ids.pop(params.request_id, "")
        return time.perf_counter() - t0

    async def pull_step(self, params: list[common_pb2.KvTransferParams], first_block: int, how: str) -> list[float]:
        """An engine step's loads: every pull of ``params`` at once, each into blocks of its own
        from ``first_block`` on, started as ``how`` says (:meth:`_start`: one message on the engine
        stream, one StartPulls, or one StartPull each, all in flight together); seconds from the
        step's start to each pull's FinishedRecving."""
        loop = asyncio.get_running_loop()
        waiters = []
        for p in params:
            waiters.append(loop.create_future())
            self._waiters[p.request_id] = waiters[-1]
        blocks = [first_block + sum(len(q.block_ids) for q in params[:i]) for i in range(len(params))]
        requests = [
            router_pb2.StartPullRequest(
                engine_id=self.engine_id,
                tp_rank=0,
                request_id=p.request_id,
                local_block_ids=range(first, first + len(p.block_ids)),
                remote=p,
            )
            for p, first in zip(params, blocks, strict=True)
        ]
        t0 = time.perf_counter()

        async def finished(waiter: asyncio.Future[None]) -> float:
            await waiter
            return time.perf_counter() - t0

        try:
            await self._start(requests, how)
            return list(await asyncio.gather(*(finished(w) for w in waiters)))
        finally:
            for p in params:
                self._waiters.pop(p.request_id, None)
                self._transfer_ids.pop(p.request_id, None)

    def _block_view(self, first_block: int, count: int) -> Any:
        """Blocks ``first_block..+count`` in the engine's memory: one row per layer and K/V."""
        layers = self.spec.num_layers * 2
        per_layer = self.spec.num_blocks * BLOCK_BYTES // layers
        piece = BLOCK_BYTES // layers
        return self.buffer.view(layers, per_layer)[:, first_block * piece : (first_block + count) * piece]

    def zero_blocks(self, first_block: int, count: int) -> None:
        """Zero blocks ``first_block..+count`` (before a pull into them, so its check proves the
        bytes arrived). Only those: zeroing the whole cache before each pull wrote up to 128 MiB
        just before the clock started, and the pull then ran with every cache cold."""
        self._block_view(first_block, count).zero_()

    def blocks(self, first_block: int, count: int) -> Any:
        """The bytes of blocks ``first_block..+count`` as they lie in the engine's memory,
        rearranged into the holder's contiguous order (the scratch's order) for checking."""
        import torch  # noqa: PLC0415

        view = self._block_view(first_block, count)
        return torch.cat([view[i] for i in range(view.shape[0])])


class RawReader:
    """A bare NIXL agent in this process reading the holder's scratch registration: the baseline."""

    def __init__(self, size: int) -> None:
        import torch  # noqa: PLC0415
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

        self.agent = nixl_agent(
            f"kvd-bench-raw-{uuid.uuid4().hex[:8]}", nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self._registration = self.agent.register_memory(self.buffer)
        self._local: Any = None
        self._remote: Any = None
        self._local_planes: Any = None  # the buffer as an engine's planes (read_step(layout=True))
        self._remote_planes: Any = None
        self._remote_name: Any = None
        self.nbytes = 0
        self.slots = 0

    def target(self, peer_address: str, engine_id: str) -> None:
        """Read from the holder's current scratch registration (re-read after the scratch changed)."""
        self._drop_remote()
        with grpc.insecure_channel(peer_address) as channel:
            info = peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=30)
        engine = next(e for e in info.engines if e.engine_id == engine_id)
        region = engine.regions[0]
        self._remote_name = self.agent.add_remote_agent(info.agent_metadata)
        self.nbytes = min(region.size_bytes, self.buffer.numel())
        self._remote = self.agent.prep_xfer_dlist(
            self._remote_name, np.array([[region.address, self.nbytes, 0]], dtype=np.int64), "DRAM"
        )
        # One local descriptor per ``nbytes`` slot of the buffer: a step's READs each land in a
        # slot of their own, as a step's pulls land in blocks of their own (slot 0: ``read``).
        slots = self.buffer.numel() // self.nbytes
        base = self.buffer.data_ptr()
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            np.array([[base + i * self.nbytes, self.nbytes, 0] for i in range(slots)], dtype=np.int64),
            "DRAM",
        )
        self.slots = slots
        if self.nbytes == BLOCK_BYTES:  # a scratch of one block: its planes, as a pull reads them
            piece = BLOCK_BYTES // BLOCK_PLANES
            self._remote_planes = self.agent.prep_xfer_dlist(
                self._remote_name,
                np.array([[region.address + p * piece, piece, 0] for p in range(BLOCK_PLANES)], dtype=np.int64),
                "DRAM",
            )
            # Plane p of slot s at (p * slots + s) pieces: each plane holds every slot's piece in
            # turn, as an engine's cache holds every block's (the bench engine's layout).
            self._local_planes = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                np.array([[base + i * piece, piece, 0] for i in range(BLOCK_PLANES * slots)], dtype=np.int64),
                "DRAM",
            )

    def read(self, layout: bool = False) -> float:
        """One READ of the whole scratch, polled to DONE; seconds.

        ``layout``: with the descriptors a pull of the block has (one per plane, 64 of 32 KiB,
        into slot 0's piece of every plane), as :meth:`read_step` reads them: what the layout
        itself costs one READ, which a pull pays and the one-descriptor READ does not."""
        zero = np.array([0], np.int32)
        if layout and self._local_planes is None:
            raise ValueError(f"a raw READ with a block's descriptors needs a scratch of one block, not {self.nbytes}")
        # The index arrays are made before the clock starts: only NIXL's work is timed.
        if layout:  # slot 0's piece of every plane, from every plane of the scratch block
            planes = np.arange(BLOCK_PLANES, dtype=np.int32)
            lists = (self._local_planes, planes * self.slots, self._remote_planes, planes)
        else:
            lists = (self._local, zero, self._remote, zero)
        t0 = time.perf_counter()
        handle = self.agent.make_prepped_xfer("READ", *lists)
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        handle.release()
        if state != "DONE":
            raise errors.PeerUnavailable(f"raw NIXL read failed ({state})")
        return elapsed

    def read_step(self, count: int, timeout_s: float = 60.0, layout: bool = False) -> list[float]:
        """An engine step's worth of raw READs: ``count`` READs of the whole scratch, each into a
        slot of its own, all posted before any is polled, then polled together until every one
        is DONE; seconds from the first post to each READ's DONE (the raw side of a batched step:
        what one bare agent does for ``count`` pulls with no control path at all). A step not
        done within ``timeout_s`` fails the bench rather than hanging it.

        ``layout``: each READ with the descriptors a pull of a block has (one per plane, 64 of
        32 KiB, into the slot's piece of every plane, as into an engine's cache) instead of one
        of 2 MiB: the same bytes as the layout makes anyone read them (a scratch of one block)."""
        if count > self.slots:
            raise ValueError(f"a raw step of {count} READs needs {count} slots of {self.nbytes} bytes")
        if layout and self._local_planes is None:
            raise ValueError(f"a raw step with a block's descriptors needs a scratch of one block, not {self.nbytes}")
        zero = np.array([0], np.int32)
        planes = np.arange(BLOCK_PLANES, dtype=np.int32)
        t0 = time.perf_counter()
        if layout:
            handles = [
                self.agent.make_prepped_xfer(
                    "READ", self._local_planes, planes * self.slots + i, self._remote_planes, planes
                )
                for i in range(count)
            ]
        else:
            handles = [
                self.agent.make_prepped_xfer("READ", self._local, np.array([i], np.int32), self._remote, zero)
                for i in range(count)
            ]
        pending = {i: self.agent.transfer(handle) for i, handle in enumerate(handles)}
        elapsed = [0.0] * count
        failed = ""
        deadline = t0 + timeout_s
        while pending:
            if time.perf_counter() > deadline:
                failed = f"{len(pending)} of {count} READs not done in {timeout_s:.0f} s"
                break
            for i, state in list(pending.items()):
                if state == "PROC":
                    pending[i] = self.agent.check_xfer_state(handles[i])
                    continue
                elapsed[i] = time.perf_counter() - t0
                del pending[i]
                if state != "DONE":
                    failed = state
        for handle in handles:
            if not failed:
                handle.release()
                continue
            with contextlib.suppress(Exception):  # NIXL may refuse to release a READ still posted
                handle.release()
        if failed:
            raise errors.PeerUnavailable(f"raw NIXL read failed ({failed})")
        return elapsed

    def _drop_remote(self) -> None:
        for table in (self._remote, self._local, self._remote_planes, self._local_planes):
            if table is not None:
                table.release()
        self._remote = self._local = self._remote_planes = self._local_planes = None
        if self._remote_name is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(self._remote_name)
            self._remote_name = None

    def close(self) -> None:
        self._drop_remote()
        self.agent.deregister_memory(self._registration)


async def hold_many(client: AsyncKvdClient, size: int, seed: int, count: int) -> list[Any]:
    """``count`` leases on the holder's scratch (fresh lease each), fetched ahead of a timed run."""
    held = [await client.selftest_hold(size_bytes=size, seed=seed)]  # alone: it may (re)fill the scratch
    for lo in range(1, count, 32):
        batch = await asyncio.gather(
            *(client.selftest_hold(size_bytes=size, seed=seed) for _ in range(min(32, count - lo)))
        )
        held.extend(batch)
    return held


def scratch_engine_id(held: engine_pb2.HoldBlocksResponse | Any) -> str:
    return str(held.kv_transfer_params.engine_id)
