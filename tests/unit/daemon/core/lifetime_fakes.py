"""Fakes for deterministic lifetime tests of the daemon core: no NIXL, no gRPC, no threads of ours.

* :class:`FakeDataPlane` has :class:`kvd.core.dataplane.DataPlane`'s async API. ``read()`` returns a
  real :class:`~kvd.core.dataplane.Xfer` that stays IN_PROGRESS until the test calls
  :meth:`FakeDataPlane.finish` (DONE; the READ's notification reaches the holder daemon, as NIXL
  delivers it) or :meth:`FakeDataPlane.fail` (ERR). Every call is recorded in ``log`` and checked
  against the lifetime rules (docs: "no byte can still move"): memory deregistered, a list released
  or a peer agent removed while a READ into or out of it is not final is a *violation*.
* :class:`FakePeerTransport` implements :class:`kvd.core.peers.PeerTransport` by calling the holder
  :class:`~kvd.core.daemon.Daemon` object in the same event loop (or test-set answers).
* :class:`Fabric` wires daemons, their fake data planes and transports together, and owns a fake
  clock for lease tables.

Everything here runs on the test's event loop, except ``prepare_table`` (called from the daemon's
worker pool, as in production), which only takes a lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvd.config import KvdConfig
from kvd.core import notif
from kvd.core.dataplane import LOCAL, AgentIdentity, NixlRegion, Xfer, XferState
from kvd.core.memory import MemoryKind, RegionRequest
from kvd.core.metrics import Metrics
from kvd.core.peers import HandshakeInfo, PrepareRequest, PrepareResult
from kvd.core.registry import EngineRank
from kvd.dataplane_protocol import MappedRegion
from kvd.layout.geometry import expand_strided
from kvd.layout.spec import LayoutSpec, contiguous_placements
from kvd.worker.regions import RegionTable
from kvd_client.errors import InvalidArgument, KvdError, PeerUnavailable, Unavailable
from kvd_client.shm import create_shm_tensor, unlink_shm

SAFETY_TIMEOUT_S = 20.0  # only turns a hang into a failure: no test outcome depends on it


class FakeClock:
    """A monotonic clock the test moves by hand (for lease tables)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Tally:
    """A counter a test can await: ``await tally.reach(n)``."""

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def bump(self) -> None:
        self.count += 1
        for n, future in self._waiters:
            if self.count >= n and not future.done():
                future.set_result(None)

    async def reach(self, n: int) -> None:
        if self.count >= n:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, future))
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await future


class Gate:
    """Calls that pass through it block until the test opens it; ``arrived`` counts them."""

    def __init__(self) -> None:
        self.arrived = Tally()
        self._open = asyncio.Event()

    async def passage(self) -> None:
        self.arrived.bump()
        await self._open.wait()

    def open(self) -> None:
        self._open.set()


@dataclasses.dataclass(eq=False)
class FakeRegistration:
    reg_id: int
    address: int
    size: int
    mem_type: str
    live: bool = True

    def overlaps(self, lo: int, hi: int) -> bool:
        return lo < self.address + self.size and self.address < hi


@dataclasses.dataclass(eq=False)
class FakeTable:
    """A prepared descriptor list: whose (LOCAL or a peer's agent name) and which addresses."""

    table_id: int
    agent: str
    lo: int
    hi: int
    mem_type: str
    released: bool = False


@dataclasses.dataclass(eq=False)
class FakeRead:
    """What a posted READ touches: kept after NIXL would have dropped the handle."""

    xfer: Xfer
    local: FakeTable
    remote: FakeTable
    message: bytes
    local_indices: np.ndarray
    remote_indices: np.ndarray


class FakeDataPlane:
    """DataPlane's async API over in-memory bookkeeping; the test decides when READs end."""

    def __init__(
        self,
        agent_name: str,
        fabric: Fabric,
        on_reads_in_flight: Callable[[int], None] = lambda _: None,
        on_lost: Callable[[Any, str], None] = lambda _plane, _reason: None,
    ) -> None:
        self.name = agent_name
        self._on_lost = on_lost
        self.lost_reason = ""
        # The worker's mappings, in this process (the real worker's RegionTable).
        self.region_table = RegionTable()
        self.converts = 0
        self.converting = 0
        self.fabric = fabric
        self._on_reads_in_flight = on_reads_in_flight
        self._on_notifications: Callable[[dict[str, list[bytes]]], None] = lambda _: None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # prepare_table runs in the daemon's worker threads
        self._ids = itertools.count(1)
        self.fast_poll_until = 0.0
        self.asked = 0  # READs asked for (read), and that count at each flush_reads
        self.flushed_at: list[int] = []
        self.started = False
        self.stopped = False
        self.log: list[tuple[str, Any]] = []  # ("register", reg) ("deregister", reg) ("add_remote", name) ...
        self.registrations: list[FakeRegistration] = []
        self.tables: list[FakeTable] = []
        self.remotes: dict[str, int] = {}  # agent name -> times loaded (present while loaded)
        # agent name -> (reg_id, address, size) of every region loaded since the agent was added
        self.loaded: dict[str, set[tuple[int, int, int]]] = {}
        self.posted: list[Xfer] = []
        self.reads: dict[Xfer, FakeRead] = {}
        self.posts = Tally()
        self.register_gate: Gate | None = None  # set by a test to hold register() calls
        self.register_errors: list[BaseException] = []  # raised, one per register() call, first
        self.refuse_reads: KvdError | None = None
        self.read_gate: Gate | None = None  # set by a test to hold read() calls mid-post
        self.add_remote_gate: Gate | None = None  # set by a test to hold add_remote() calls
        self.add_remote_errors: list[BaseException] = []  # raised, one per add_remote() call, first
        self.release_gate: Gate | None = None  # set by a test to hold release_tables() calls (a hung worker)

    # --- life cycle -------------------------------------------------------------------------------

    async def start(self, on_notifications: Callable[[dict[str, list[bytes]]], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_notifications = on_notifications
        if self.fabric.start_gate is not None:  # a replacement worker still starting
            await self.fabric.start_gate.passage()
        if self.fabric.start_errors:
            raise self.fabric.start_errors.pop(0)
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        self.region_table.close_all()

    @property
    def alive(self) -> bool:
        return self.started and not self.stopped and not self.lost_reason

    @property
    def pid(self) -> int:
        return os.getpid()

    def lose(self, reason: str = "SIGKILL") -> None:
        """The worker dies: every READ it posted is final (its death is the fence), calls fail,
        and its mappings go with it."""
        assert self.alive, "only a live worker can die"
        self.lost_reason = reason
        if not self.converting:  # (a conversion thread still uses the tensors: left to the GC)
            self.region_table.close_all()
        for xfer in self.posted:
            if not xfer.final:
                xfer.state = XferState.ERROR
                xfer.error = Unavailable(f"the data-plane worker died ({reason})")
                if not xfer.settled.done():
                    xfer.settled.set_result(None)
        self._on_reads_in_flight(0)
        self.log.append(("lost", reason))
        self._on_lost(self, reason)

    def _require_started(self) -> None:
        if self.lost_reason:
            raise Unavailable(f"the data-plane worker is gone ({self.lost_reason}): retry")
        if not self.started or self.stopped:
            raise Unavailable("the NIXL data plane is stopped")

    # --- the worker's mappings ------------------------------------------------------------------

    async def open_regions(self, requests: Sequence[RegionRequest]) -> list[MappedRegion]:
        self._require_started()
        return self.region_table.open_all(requests)

    async def close_regions(self, region_ids: Sequence[int], keep_readable_s: float = 0.0) -> None:
        if self.alive:
            for region_id in region_ids:
                self.region_table.close(region_id, keep_readable_s)

    async def duplicate_region(self, region_id: int) -> MappedRegion:
        self._require_started()
        return self.region_table.duplicate(region_id)

    async def retire_region(self, region_id: int) -> None:
        self._require_started()
        self.region_table.retire(region_id)

    async def open_staging(self, size: int, device: str) -> MappedRegion:
        self._require_started()
        return self.region_table.staging(size, device)

    async def convert(
        self, postprocess: Any, staging_region: int, offset: int, size: int, engine_regions: Sequence[int]
    ) -> None:
        self._require_started()
        self.converts += 1
        staging = self.region_table.get(staging_region)[offset : offset + size]
        tensors = [self.region_table.get(region_id) for region_id in engine_regions]
        self.converting += 1
        try:
            await asyncio.to_thread(self.region_table.convert, postprocess, staging, tensors)
        finally:
            self.converting -= 1

    def metadata(self) -> bytes:
        """Names the agent and its live registrations, as NIXL's metadata does."""
        regions = ",".join(f"{r.reg_id}:{r.address}:{r.size}" for r in self.live_registrations())
        return f"fake-nixl|{self.name}|{regions}".encode()

    def identity(self) -> AgentIdentity:
        regions = tuple(
            NixlRegion(r.address, r.size, 0, r.mem_type == "VRAM", r.reg_id) for r in self.live_registrations()
        )
        return AgentIdentity(self.metadata(), regions)

    def _violation(self, what: str) -> None:
        self.fabric.violations.append(f"{self.name[-8:]}: {what}")

    # --- memory -----------------------------------------------------------------------------------

    async def register(self, address: int, size: int, device_index: int, mem_type: str) -> FakeRegistration:
        self._require_started()
        if self.register_gate is not None:
            await self.register_gate.passage()
            self._require_started()  # a call in flight when the worker dies fails
        if self.register_errors:
            raise self.register_errors.pop(0)
        registration = FakeRegistration(next(self._ids), address, size, mem_type)
        self.registrations.append(registration)
        self.log.append(("register", registration))
        return registration

    async def deregister(self, registration: FakeRegistration) -> None:
        if self.lost_reason:  # the worker is gone, and all of it with it
            return
        self._require_started()
        if not registration.live:
            self._violation(f"registration {registration.reg_id} deregistered twice")
        for read in self.fabric.live_reads():
            touches_local = (
                read.xfer in self.reads
                and read.local.agent == LOCAL
                and registration.overlaps(read.local.lo, read.local.hi)
            )
            touches_remote = read.remote.agent == self.name and registration.overlaps(read.remote.lo, read.remote.hi)
            if touches_local or touches_remote:
                self._violation(f"registration {registration.reg_id} deregistered while a READ through it is not final")
        registration.live = False
        self.log.append(("deregister", registration))

    def live_registrations(self) -> list[FakeRegistration]:
        return [r for r in self.registrations if r.live]

    def registered(self, table: FakeTable) -> bool:
        """Whether a live registration of this data plane overlaps the list's memory."""
        return any(r.overlaps(table.lo, table.hi) for r in self.live_registrations())

    def deregistered(self, registration: Any) -> bool:
        return ("deregister", registration) in self.log

    # --- peers --------------------------------------------------------------------------------

    async def add_remote(self, metadata: bytes) -> str:
        """Loads a peer's metadata as NIXL does: into a known agent it *merges* (regions the peer
        has deregistered since stay loaded), and the same addresses under another registration
        make the load fail and NIXL forget the agent."""
        self._require_started()
        if self.add_remote_gate is not None:
            await self.add_remote_gate.passage()
            self._require_started()  # a call in flight when the worker dies fails
        if self.add_remote_errors:
            raise self.add_remote_errors.pop(0)
        prefix, _, rest = metadata.decode().partition("|")
        name, _, listed = rest.partition("|")
        if prefix != "fake-nixl" or not name:
            raise PeerUnavailable(f"fake NIXL rejected metadata {metadata[:32]!r}")
        regions = {tuple(int(v) for v in item.split(":")) for item in listed.split(",") if item}
        loaded = self.loaded.setdefault(name, set())
        by_range = {(address, size): reg_id for reg_id, address, size in loaded}
        if any(by_range.get((address, size), reg_id) != reg_id for reg_id, address, size in regions):
            self.remotes.pop(name, None)
            self.loaded.pop(name, None)
            raise InvalidArgument(f"peer agent metadata rejected by NIXL: NIXL_ERR_NOT_ALLOWED ({name[-8:]} dropped)")
        loaded |= regions
        self.remotes[name] = self.remotes.get(name, 0) + 1
        self.log.append(("add_remote", name))
        return name

    async def remove_remote(self, agent_name: str, tables: Sequence[FakeTable]) -> None:
        if self.lost_reason:  # the worker is gone, and all of it with it
            return
        self._require_started()
        for read in self._live_reads():
            if read.remote.agent == agent_name:
                self._violation(f"agent {agent_name[-8:]} removed while a READ through it is not final")
        self._release(tables)
        self.remotes.pop(agent_name, None)
        self.loaded.pop(agent_name, None)
        self.log.append(("remove_remote", agent_name))

    def removals(self, agent_name: str) -> int:
        return self.log.count(("remove_remote", agent_name))

    # --- tables ---------------------------------------------------------------------------------

    def prepare_table(self, agent_name: str, rows: np.ndarray, mem_type: str) -> FakeTable:
        if not self.alive:
            raise Unavailable("the NIXL data plane is not started (or its worker is gone)")
        if rows.shape[1] == 5:  # NIXL's compressed form
            rows = expand_strided(rows)
        lo = int(rows[:, 0].min()) if len(rows) else 0
        hi = int((rows[:, 0] + rows[:, 1]).max()) if len(rows) else 0
        if agent_name != LOCAL:
            self._check_remote_lookup(agent_name, lo, hi)
        with self._lock:
            table = FakeTable(next(self._ids), agent_name, lo, hi, mem_type)
            self.tables.append(table)
        return table

    def _check_remote_lookup(self, agent_name: str, lo: int, hi: int) -> None:
        """NIXL resolves a remote list by looking each descriptor's region up among the regions
        loaded for the agent, assuming they do not overlap: a list over memory where a region the
        peer has deregistered since overlaps another loaded region is resolved wrongly or not at
        all. A list over a deregistered region alone resolves against its metadata, which stays
        loaded (a warm-up that raced the peer's unregistration); posting a READ on it is what
        must never happen (:meth:`read` checks that)."""
        with self._lock:
            loaded = set(self.loaded.get(agent_name, ()))
        if agent_name not in self.remotes:
            raise RuntimeError(f"NIXL_ERR_NOT_FOUND (fake): metadata for remote agent {agent_name[-8:]} not found")
        holder = self.fabric.dataplanes.get(agent_name)
        live = {r.reg_id for r in holder.live_registrations()} if holder is not None else set()
        overlapping = [reg_id for reg_id, address, size in loaded if lo < address + size and address < hi]
        stale = [reg_id for reg_id in overlapping if reg_id not in live]
        if stale and len(overlapping) > 1:
            self._violation(
                f"a list over agent {agent_name[-8:]} prepared while stale regions {stale} overlap it "
                f"and other loaded regions ({sorted(set(overlapping) - set(stale))} live)"
            )
            raise RuntimeError("NIXL_ERR_NOT_FOUND (fake): failed to prepare the descriptors for any backend")
        if not any(address <= lo and hi <= address + size for _, address, size in loaded):
            raise RuntimeError("NIXL_ERR_NOT_FOUND (fake): no loaded region covers the list")

    async def release_tables(self, tables: Sequence[FakeTable]) -> None:
        if self.lost_reason:  # the worker is gone, and all of it with it
            return
        if tables:
            self._require_started()
            if self.release_gate is not None:  # a hung worker: the call fails if it dies meanwhile
                await self.release_gate.passage()
                self._require_started()
            self._release(tables)

    def _release(self, tables: Sequence[FakeTable]) -> None:
        for table in tables:
            if table not in self.tables:  # list ids are the worker's own: another's id names another list
                self._violation(f"list {table.table_id} ({table.agent[-8:]}) released in a worker that did not make it")
            if table.released:
                self._violation(f"list {table.table_id} released twice")
            for read in self._live_reads():
                if table is read.local or table is read.remote:
                    self.fabric.table_violations.append(
                        f"list {table.table_id} ({table.agent[-8:]}) released under a live READ"
                    )
            table.released = True
            self.log.append(("release_table", table))

    # --- transfers ----------------------------------------------------------------------------

    def read(
        self,
        local_table: FakeTable,
        local_indices: np.ndarray,
        remote_table: FakeTable,
        remote_indices: np.ndarray,
        notif_message: bytes,
        peer: str,
        nbytes: int,
        step: Any = None,  # a fake posts every READ alone (step READs: test_core_step_reads.py)
    ) -> asyncio.Future[Xfer]:
        """As DataPlane.read: the READ is on its way when this returns (its post answers later)."""
        self.asked += 1
        return asyncio.ensure_future(
            self._post(local_table, local_indices, remote_table, remote_indices, notif_message, peer, nbytes)
        )

    def flush_reads(self) -> None:
        """As DataPlane.flush_reads (a fake posts each READ as it is asked for): remembers how many
        READs had been asked for at each flush (a step's sends, kvd.core.start_posts)."""
        self.flushed_at.append(self.asked)
        self.fabric.sends.append(("reads", self.asked))

    async def _post(
        self,
        local_table: FakeTable,
        local_indices: np.ndarray,
        remote_table: FakeTable,
        remote_indices: np.ndarray,
        notif_message: bytes,
        peer: str,
        nbytes: int,
    ) -> Xfer:
        self._require_started()
        assert self._loop is not None
        if self.read_gate is not None:  # the post is under way on NIXL's thread; it completes regardless
            await self.read_gate.passage()
        if self.refuse_reads is not None:
            raise self.refuse_reads
        if local_table.released or remote_table.released:
            self._violation("READ posted on a released list")
        if remote_table.agent not in self.remotes:
            self._violation(f"READ posted through agent {remote_table.agent[-8:]}, which is not loaded")
        if local_table.agent == LOCAL and not self.registered(local_table):
            self._violation("READ posted into memory that is not registered")
        holder = self.fabric.dataplanes.get(remote_table.agent)
        if holder is not None and holder.alive and not holder.registered(remote_table):
            self._violation(f"READ posted over memory agent {remote_table.agent[-8:]} has deregistered")
        xfer = Xfer(object(), peer, nbytes, 0.0, self._loop.create_future())
        self.reads[xfer] = FakeRead(
            xfer,
            local_table,
            remote_table,
            notif_message,
            np.array(local_indices),
            np.array(remote_indices),
        )
        self.posted.append(xfer)
        self._on_reads_in_flight(self.in_flight())
        self.log.append(("read", xfer))
        self.posts.bump()
        return xfer

    async def wait(self, xfers: Sequence[Xfer]) -> None:
        """As DataPlane.wait: cancelling the wait leaves the reads running."""
        for xfer in xfers:
            await asyncio.shield(xfer.settled)
            if xfer.error is not None:
                raise xfer.error

    def in_flight(self) -> int:
        return sum(1 for x in self.posted if not x.final)

    def _live_reads(self) -> list[FakeRead]:
        return [read for read in self.reads.values() if not read.xfer.final]

    # --- the test's hand on NIXL ----------------------------------------------------------------

    def live(self) -> list[Xfer]:
        return [x for x in self.posted if not x.final]

    def finish(self, xfer: Xfer, *, notify: bool = True) -> None:
        """NIXL says DONE: the bytes moved, and the READ's notification reaches the holder."""
        self._end(xfer, XferState.DONE, None)
        if notify:
            self.deliver(xfer)

    def fail(self, xfer: Xfer, error: KvdError | None = None) -> None:
        """NIXL says ERR (the peer went away): nothing more of this READ can land."""
        self._end(
            xfer, XferState.ERROR, error or PeerUnavailable(f"NIXL read from peer {xfer.peer} failed: peer gone?")
        )

    def deliver(self, xfer: Xfer) -> None:
        """Hand the READ's notification to the holder daemon's notification callback."""
        read = self.reads[xfer]
        holder = self.fabric.dataplanes.get(read.remote.agent)
        if holder is not None and holder.alive:  # a dead worker hears nothing
            holder._on_notifications({self.name: [read.message]})

    def _end(self, xfer: Xfer, state: XferState, error: KvdError | None) -> None:
        assert not xfer.final, "the fake ends a READ once"
        xfer.state, xfer.error = state, error
        xfer.handle = None
        if not xfer.settled.done():
            xfer.settled.set_result(None)
        self._on_reads_in_flight(self.in_flight())
        self.log.append(("final", xfer))


class FakeAskedAdmission:
    """A PreparePull asked ahead (FakePeerTransport.ask_prepare_pull): the call runs as
    ``prepare_pull`` would, from the flush that sends it; a cancel of ``answer`` withdraws it."""

    def __init__(self, transport: FakePeerTransport, address: str, request: PrepareRequest, timeout_s: float) -> None:
        self._transport = transport
        self._address = address
        self._request = request
        self._timeout_s = timeout_s
        self._call: asyncio.Task[PrepareResult] | None = None
        self.withdrawn = False

    def send(self) -> None:
        self._transport.sent_asks.append(self._request.reader_transfer_id)
        if not self.withdrawn:
            self._call = asyncio.ensure_future(
                self._transport.prepare_pull(self._address, self._request, self._timeout_s)
            )
            self._call.add_done_callback(lambda call: call.cancelled() or call.exception())

    async def answer(self) -> PrepareResult:
        assert self._call is not None, "an admission asked ahead is answered only once a flush sent it"
        return await self._call

    def withdraw(self) -> None:
        if not self.withdrawn:
            self.withdrawn = True
            self._transport.withdrawn_asks.append(self._request.reader_transfer_id)
        if self._call is not None:
            self._call.cancel()


class FakePeerTransport:
    """PeerTransport that calls the holder Daemon object directly (or returns test-set answers)."""

    def __init__(self, fabric: Fabric, own_address: str, own_incarnation: Callable[[], str]) -> None:
        self.fabric = fabric
        self.own_address = own_address
        self.own_incarnation = own_incarnation
        self.handshakes: list[str] = []
        self.prepares: list[dict[str, Any]] = []
        self.abandons: list[dict[str, Any]] = []
        self.abandoned = Tally()
        self.forgets: list[str] = []
        self.closed = False
        self.handshake_answers: dict[str, HandshakeInfo] = {}
        self.prepare_answers: dict[str, PrepareResult] = {}
        self.prepare_gate: Gate | None = None  # holds PreparePull before it reaches the holder
        self.reply_gate: Gate | None = None  # holds PreparePull's answer after the holder admitted
        self.reply_lost: KvdError | None = None  # raised instead of PreparePull's answer (lost on its way)
        self.unreachable: set[str] = set()  # addresses whose daemon cannot be reached (stopped, cut off)
        self.finishes: list[dict[str, Any]] = []  # FinishReads delivered
        self.finished = Tally()
        self.finish_lost: KvdError | None = None  # raised instead of delivering a FinishRead (lost on its way)
        self._tags: dict[str, list[str]] = {}  # reader transfer id -> notification tags it was given
        self._unflushed: list[FakeAskedAdmission] = []  # asked (ask_prepare_pull), not sent yet
        self.sent_asks: list[str] = []  # reader transfer ids of the admissions asked, as flush sent them
        self.withdrawn_asks: list[str] = []  # ... and of those withdrawn

    def _holder(self, address: str) -> Any:
        daemon = self.fabric.daemons.get(address)
        if daemon is None or address in self.unreachable:
            raise PeerUnavailable(f"no daemon answers at {address}")
        return daemon

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo:
        self.handshakes.append(address)
        if address in self.handshake_answers:
            return self.handshake_answers[address]
        holder = self._holder(address)
        holder.require_serving()
        return holder.handshake_info()

    def ask_prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> FakeAskedAdmission | None:
        """As the gRPC transport queues a PreparePull on its peer's stream: it leaves at the next
        :meth:`flush` (``Fabric.asks_early`` False: None, the core asks with prepare_pull)."""
        if not self.fabric.asks_early:
            return None
        asked = FakeAskedAdmission(self, address, request, timeout_s)
        if not self._unflushed:  # unflushed, it leaves at the end of this loop turn (the writer task's send)
            asyncio.get_running_loop().call_soon(self.flush)
        self._unflushed.append(asked)
        return asked

    def flush(self) -> None:
        unflushed, self._unflushed = self._unflushed, []
        if unflushed:
            self.fabric.sends.append(("admissions", len(unflushed)))
        for asked in unflushed:
            asked.send()

    async def prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> PrepareResult:
        reader_transfer_id = request.reader_transfer_id
        self.prepares.append(dict(address=address, lease_id=request.lease_id, reader_transfer_id=reader_transfer_id))
        if request.read_id:  # its READ may be posted already, under the tag it names
            self._tags.setdefault(reader_transfer_id, []).append(notif.tag(request.lease_id, request.read_id))
        if self.prepare_gate is not None:
            await self.prepare_gate.passage()
        if address in self.prepare_answers:
            result = self.prepare_answers[address]
        else:
            result = await self._holder(address).prepare_pull(
                request, reader_address=self.own_address, reader_incarnation=self.own_incarnation()
            )
        if result.notif_tag not in self._tags.get(reader_transfer_id, []):
            self._tags.setdefault(reader_transfer_id, []).append(result.notif_tag)
        if self.reply_gate is not None:  # the answer is on its way back (or lost)
            await self.reply_gate.passage()
        if self.reply_lost is not None:
            raise self.reply_lost
        return result

    def _live_reads_of(self, reader_transfer_id: str) -> list[object]:
        """The reader's READs of that pull not final: those notifying under a tag it was given
        or built, and those the pull recorded as its own (``Transfer.posts``: a READ with no
        notification too), a post not answered yet among them (its bytes may land all the same)."""
        node = self.fabric.node_at(self.own_address)
        own = node.dataplane
        tags = tuple(f"{t}|".encode() for t in self._tags.get(reader_transfer_id, []))
        try:
            posts = node.daemon.transfers.get(reader_transfer_id).posts
        except KvdError:
            posts = []
        pending: list[object] = [p for p in posts if not p.done()]
        mine = {id(p.result()) for p in posts if p.done() and not p.cancelled() and p.exception() is None}
        return pending + [
            x
            for x, read in own.reads.items()
            if not x.final and ((tags and read.message.startswith(tags)) or id(x) in mine)
        ]

    async def abandon_pull(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, reason: str, timeout_s: float
    ) -> None:
        live = self._live_reads_of(reader_transfer_id)
        if live:
            self.fabric.violations.append(
                f"AbandonPull of {reader_transfer_id[:8]} sent with {len(live)} READs not final"
            )
        holder = self._holder(address)  # an unreachable holder: PeerUnavailable, nothing delivered
        self.abandons.append(dict(address=address, lease_id=lease_id, transfer_id=reader_transfer_id, reason=reason))
        self.abandoned.bump()
        holder.abandon_pull(
            lease_id,
            reader_tp_rank,
            reason,
            reader_incarnation=self.own_incarnation(),
            reader_transfer_id=reader_transfer_id,
        )

    async def finish_read(
        self,
        address: str,
        lease_id: str,
        reader_tp_rank: int,
        reader_transfer_id: str,
        timeout_s: float,
        nbytes: int = 0,
    ) -> None:
        live = self._live_reads_of(reader_transfer_id)
        if live:
            self.fabric.violations.append(
                f"FinishRead of {reader_transfer_id[:8]} sent with {len(live)} READs not final"
            )
        holder = self._holder(address)  # an unreachable holder: PeerUnavailable, nothing delivered
        if self.finish_lost is not None:
            raise self.finish_lost
        self.finishes.append(dict(address=address, lease_id=lease_id, transfer_id=reader_transfer_id, nbytes=nbytes))
        self.finished.bump()
        await holder.finish_read(
            lease_id,
            reader_tp_rank,
            reader_incarnation=self.own_incarnation(),
            reader_transfer_id=reader_transfer_id,
            nbytes=nbytes,
        )

    async def forget(self, address: str) -> None:
        self.forgets.append(address)

    async def close(self) -> None:
        self.closed = True


@dataclasses.dataclass(eq=False)
class Node:
    """One daemon in the fabric, with its fake data plane and transport."""

    address: str
    daemon: Any  # kvd.core.daemon.Daemon
    transport: FakePeerTransport

    @property
    def dataplane(self) -> FakeDataPlane:
        dataplane = self.daemon.dataplane
        assert isinstance(dataplane, FakeDataPlane)
        return dataplane

    def metric(self, name: str, **labels: str) -> float:
        return self.daemon.metrics.registry.get_sample_value(name, labels) or 0.0


class Fabric:
    """Daemons with fake data planes, wired to each other in one event loop."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.dataplanes: dict[str, FakeDataPlane] = {}  # by agent name
        self.daemons: dict[str, Any] = {}  # by address
        self.nodes: dict[str, Node] = {}
        self.violations: list[str] = []
        self.table_violations: list[str] = []
        self.start_gate: Gate | None = None  # holds FakeDataPlane.start (a replacement worker starting)
        self.start_errors: list[BaseException] = []  # raised, one per start, by the next workers started
        self.shm_names: list[str] = []
        # Readers queue a warm pull's admission in StartPulls, as the gRPC transport does
        # (PeerTransport.ask_prepare_pull); False: their pulls' tasks ask it.
        self.asks_early = True
        # In order, what readers sent: ("reads", READs asked for so far on that plane) at each
        # flush of READs, ("admissions", how many) at each send of admissions asked ahead.
        self.sends: list[tuple[str, int]] = []

    def make_dataplane(
        self,
        *,
        launcher: Any,
        on_reads_in_flight: Callable[[int], None] = lambda _: None,
        on_lost: Callable[[Any, str], None] = lambda _plane, _reason: None,
        **_worker: Any,
    ) -> FakeDataPlane:
        """Stands in for the DataPlane class in kvd.core.daemon (the launcher only names it)."""
        agent_name = launcher.reserve_name()
        dataplane = FakeDataPlane(agent_name, self, on_reads_in_flight, on_lost)
        self.dataplanes[agent_name] = dataplane
        return dataplane

    def node_at(self, address: str) -> Node:
        return self.nodes[address]

    def live_reads(self) -> list[FakeRead]:
        return [read for dp in self.dataplanes.values() for read in dp._live_reads()]

    async def start_node(self, address: str, **config: Any) -> Node:
        from kvd.core.daemon import Daemon

        fields: dict[str, Any] = dict(
            unix_socket=f"/tmp/kvd-lifetimes-{os.getpid()}.sock",
            advertise_address=address,
            metrics_port=-1,
            transfer_deadline_s=30.0,
            handshake_timeout_s=5.0,
            commit_wait_s=1.0,
            fence_timeout_s=5.0,
            read_admission_margin_s=5.0,
            staging_pool_bytes=0,
        )
        fields.update(config)
        holder: dict[str, Any] = {}
        transport = FakePeerTransport(self, address, lambda: holder["daemon"].incarnation)
        daemon = Daemon(KvdConfig(**fields), transport, Metrics())
        holder["daemon"] = daemon
        await daemon.start()
        daemon.leases._clock = self.clock  # lease and admission deadlines on the test's clock
        self.daemons[address] = daemon
        node = Node(address, daemon, transport)
        self.nodes[address] = node
        return node

    def shm_regions(self, spec: LayoutSpec) -> list[RegionRequest]:
        """A new engine rank's memory: real shared memory, removed at :meth:`close`."""
        name = f"kvdlt-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.shm_names.append(name)
        create_shm_tensor(name, spec.total_bytes)
        return [RegionRequest(MemoryKind.SHM, spec.total_bytes, shm_name=name)]

    async def register(self, node: Node, engine_id: str, spec: LayoutSpec) -> EngineRank:
        """An engine rank over real shared memory (the test plays the engine)."""
        return await node.daemon.register_engine(engine_id, spec, self.shm_regions(spec), contiguous_placements(spec))

    async def close(self) -> None:
        """End every READ still in flight, then shut every daemon down."""
        for dataplane in self.dataplanes.values():
            for xfer in dataplane.live():
                dataplane.fail(xfer)
        for node in self.nodes.values():
            await node.daemon.shutdown(0.0)
        for name in self.shm_names:
            unlink_shm(name)
