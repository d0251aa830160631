"""The worker's NIXL agent: one per worker incarnation, driven by one thread that owns it.

This is the only module that talks to NIXL (it runs in the data-plane worker process, never in
the control process: see kvd.dataplane_protocol). It turns NIXL's string states and exceptions into
:class:`XferState` and kvd errors.

**Threads.** Every call on the agent runs on the data plane's own thread (``kvd-nixl``), fed
by a queue, except ``prep_xfer_dlist``: preparing a large table takes long, touches no UCX
worker and runs under NIXL's agent lock, so it runs in the caller's thread pool. The owner
thread also polls every posted transfer and NIXL's notifications, so UCX makes progress (it
copies inside those polls) and no two threads ever drive the UCX worker at once.

**Transfers.** A posted READ is a :class:`PostedRead`. NIXL 1.5 cannot cancel a READ in flight
(``release`` leaves the UCX request running and its bytes still land), so the data plane
never releases a handle that is not final: it polls it until NIXL reports DONE or ERR, then
releases it and reports it settled (``on_settled``, on the owner thread). A final state is
therefore the proof that no byte of the read can land any more; callers that give up on a read
keep its destination pinned until then (see docs/lifetimes.md).

**Large READs go in pieces.** One NIXL call copies about ``max_post_bytes`` of a READ at most
(config ``dataplane_max_post_bytes``). Over shared memory UCX copies a READ within its post
(128 MiB: 20-30 ms on a 2-core VM; a multi-GiB host pull on a busy machine, seconds), and
meanwhile the owner thread answers nothing, the control process's heartbeat included: a worker
copying one huge READ could be killed as hung. A larger READ is posted in pieces, one after the
other (the next once the previous is DONE), answering heartbeats between them, its notification
with the last piece only, so the holder hears of it once every byte is read. Pieces split the
READ's runs by count (the runs of one READ are of similar size), so a piece can be larger by up
to one run. The READ is final when its last piece is, or when a piece ends in ERR.

**Large READs can be copied by several threads** (opt-in: config dataplane_copy_threads, default 1;
with NIXL 1.5.1's pool a reader's worker killed mid-read over TCP crashed the holder's worker inside
``get_new_notifs``, docs/performance.md). With ``copy_threads`` > 1 the agent's UCX backend is
NIXL's thread pool (``num_threads``, as vLLM's NIXL connector creates it): a transfer of at least
SPLIT_BATCH_SIZE descriptors is cut by NIXL into ``copy_threads`` consecutive chunks, each posted
and progressed by a dedicated thread on its own UCX worker, and NIXL sends the notification once
every chunk is done. Over shared memory UCX's copy runs in the thread that posts, so one thread
copies a READ at about one core's memory bandwidth (~7 GB/s on the 2-core development VM); two
copy a 128 MiB READ in 0.65-0.7 of the time (measured with raw NIXL, 64 runs of 2 MiB: 13-14 ms
against 19-21). A READ (or piece) of at least ``parallel_min_bytes`` in host memory on both sides
is therefore posted as ad-hoc lists (``initialize_xfer``) of about ``copy_threads`` x
SPLIT_BATCH_SIZE equal descriptors, cut from its runs' addresses (:class:`PreparedTable` keeps the
rows each list was prepared from): NIXL's descriptor count, not the bytes, decides a split, and a
2 MiB pull is as many runs as a 128 MiB one. Smaller READs keep their prepared lists, and any of
them with SPLIT_BATCH_SIZE runs or more is split by NIXL as well. While a parallel READ is in
flight the owner thread polls every POLL_FAST_S without spinning: a spinning poller took one of
the copy threads' cores.

**Callbacks run on the owner thread**: ``on_notifications``, ``on_settled`` and the answer of
:meth:`NixlAgent.post_reads`. The worker sends them to the control process straight from here
(kvd.worker.channel), without a hop through its event loop; they must not block.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvd.dataplane_protocol import (
    DEFAULT_MAX_POST_BYTES,
    DEFAULT_PARALLEL_READ_MIN_BYTES,
    LOCAL_AGENT,
    AgentIdentity,
    NixlRegion,
    XferState,
)
from kvd.layout.geometry import expand_strided
from kvd_client.errors import Internal, InvalidArgument, KvdError, PeerUnavailable, Unavailable

logger = logging.getLogger(__name__)
# NIXL's status when a peer agent's metadata could not be loaded because the peer's UCX side went
# away meanwhile (its worker died, its daemon restarted): the peer is unavailable, not its metadata bad.
REMOTE_DISCONNECT = "NIXL_ERR_REMOTE_DISCONNECT"

LOCAL = LOCAL_AGENT
T = TypeVar("T")

# The owner thread polls posted reads without sleeping (sleep(0): it still yields the GIL) for
# SPIN_S plus the bytes' time at SPIN_BYTES_PER_S, then every POLL_SLOW_S; with no read in flight
# it polls notifications every POLL_IDLE_S, or POLL_FAST_S while a reader may be reading from us
# (a READ that carries a notification completes only once the holder has made progress).
SPIN_S = 0.002
SPIN_BYTES_PER_S = 2e9
POLL_SLOW_S = 0.001
POLL_IDLE_S = 0.001
POLL_FAST_S = 0.0002
# With nothing to do for DORMANT_AFTER_S (no call, no read, no notification, no admitted reader),
# notifications are polled every POLL_DORMANT_S only: an idle daemon then costs well under 1 % of
# a core instead of ~5 %. Any call or a reader's admission wakes the thread at once.
DORMANT_AFTER_S = 1.0
POLL_DORMANT_S = 0.05
# Dormant with no reader admitted at all (the control process sets fast_poll_until to 0.0 once the
# last admission is over; it stays at a past deadline while an overdue admission is still open, in
# its read_admission_margin_s, and then a late notification is read within POLL_DORMANT_S, and
# while a read that was never proven over may still be served: HolderReads._poll_fast_while_admitted):
# nothing can notify us, so the thread polls once a second only (the control process's heartbeat wakes it
# about as often anyway). An admission, or any call, wakes it at once. Each poll costs ~0.1 ms
# (UCX progress): 20 a second were a quarter of an idle worker's CPU (issue 19).
POLL_UNADMITTED_S = 1.0
# NIXL's own progress thread (nixl_progress_thread), when it runs, sleeps in poll() on the UCX
# worker's event fd between rounds and wakes when the worker has something to progress (a
# notification, a peer's request over TCP, a connection), or after this long at most. NIXL's
# Python API starts it with no timeout, and then it busy-polls a whole core (see
# create_agent_with_progress_wait). With it, the owner thread no longer polls fast for admitted
# readers: their READs progress as their packets arrive.
PROGRESS_THREAD_WAIT_S = 0.1
# NIXL's thread pool splits a transfer of at least this many descriptors across its threads
# (UCX backend parameter ``split_batch_size``; NIXL's default, 1024, made the pieces of a parallel
# READ small enough that UCX's cost per descriptor ate the gain). Above the descriptors of a
# 1-block pull of most models (2 x layers), so small READs keep one thread and finish in their post.
SPLIT_BATCH_SIZE = 256
# While a parallel READ copies, its poller sleeps for its bytes at this rate per copy thread (a
# lower bound of the copy's time: each poll costs the copy threads CPU), then every POLL_FAST_S.
PARALLEL_BYTES_PER_S = 8e9
# The transport warm-up at agent creation (see warm_transport) gives up after this long.
WARMUP_TIMEOUT_S = 5.0
WARMUP_BYTES = 4096


def _nixl() -> Any:
    """Import NIXL lazily: the layout and registry code is usable (and testable) without it."""
    from nixl import _api  # noqa: PLC0415

    return _api


class NixlRead(NamedTuple):
    """One READ for the owner thread to build and post: the prepared lists (NIXL's objects,
    owned by the worker's table ids) and the indices into each, one run per index. ``xfer_id``
    is the control process's name for it (its settled report carries it)."""

    xfer_id: int
    local_table: Any
    local_indices: np.ndarray
    remote_table: Any
    remote_indices: np.ndarray
    notif: bytes
    peer: str
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedTable:
    """A prepared descriptor list and the rows it was prepared from (owner: the worker's table
    id; released on the owner thread by :meth:`NixlAgent.release_tables` or with its peer).

    The rows let a large READ be re-cut into ad-hoc lists for NIXL's copy threads (see the module
    docstring): a row index is resolved to its address without NIXL, vectorised."""

    handle: Any
    agent_name: str
    mem_type: str
    rows: np.ndarray  # (address, length, device, stride, count) or (address, length, device)
    first_index: np.ndarray  # compressed rows: the index of each row's first descriptor

    @classmethod
    def of(cls, handle: Any, agent_name: str, mem_type: str, rows: np.ndarray) -> PreparedTable:
        rows = np.asarray(rows, dtype=np.int64)
        first = np.cumsum(rows[:, 4]) - rows[:, 4] if rows.shape[1] == 5 else np.zeros(0, dtype=np.int64)
        return cls(handle, agent_name, mem_type, rows, first)

    def descriptors(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Address, length and device of each descriptor named by ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.rows.shape[1] == 5:
            row = np.searchsorted(self.first_index, indices, side="right") - 1
            address = self.rows[row, 0] + (indices - self.first_index[row]) * self.rows[row, 3]
            return address, self.rows[row, 1], self.rows[row, 2]
        return self.rows[indices, 0], self.rows[indices, 1], self.rows[indices, 2]


def nixl_handle(table: Any) -> Any:
    """NIXL's own handle of a list (tests pass bare stand-ins)."""
    return table.handle if isinstance(table, PreparedTable) else table


def cut_runs(lengths: np.ndarray, pieces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs into about ``pieces`` descriptors of equal length (the last of each run shorter),
    in order: NIXL gives each copy thread consecutive descriptors, so equal pieces give each
    thread about the same bytes. Returns per piece its run, its offset in the run, its length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    size = max(1, -(-int(lengths.sum()) // max(1, pieces)))
    per_run = -(-lengths // size)
    run = np.repeat(np.arange(lengths.size), per_run)
    offset = (np.arange(run.size, dtype=np.int64) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * size
    return run, offset, np.minimum(size, lengths[run] - offset)


@dataclasses.dataclass(eq=False)
class PostedRead:
    """A READ NIXL built, from its post until final (DONE or ERR); owner thread only. ``error``
    set with the state still in progress: it was posted only in part, and is polled to its end.

    A READ larger than the agent's max_post_bytes goes in pieces: ``handle`` is the piece in flight (None
    between pieces and once released), ``rest`` what is still to post (with the notification)."""

    xfer_id: int
    handle: Any
    peer: str
    spin_until: float  # poll without sleeping until then (see SPIN_S)
    state: XferState = XferState.IN_PROGRESS
    error: KvdError | None = None
    rest: NixlRead | None = None
    pieces_posted: int = 0
    parallel: bool = False  # the piece in flight is copied by NIXL's copy threads (poll, never spin)
    poll_from: float = 0.0  # a parallel piece: not worth polling before (its bytes' time at best)

    @property
    def final(self) -> bool:
        return self.state is not XferState.IN_PROGRESS


class NixlAgent:
    """A NIXL agent and the one thread that calls it (in the data-plane worker process)."""

    def __init__(
        self,
        agent_name: str,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
        on_reads_in_flight: Callable[[int], None] = lambda _: None,
        max_post_bytes: int = DEFAULT_MAX_POST_BYTES,
        copy_threads: int = 1,
        parallel_min_bytes: int = DEFAULT_PARALLEL_READ_MIN_BYTES,
    ) -> None:
        self.name = agent_name
        self._max_post_bytes = max_post_bytes
        self._copy_threads = max(1, copy_threads)
        self._parallel_min_bytes = parallel_min_bytes
        self._on_reads_in_flight = on_reads_in_flight  # called on the owner thread when the count changes
        self._backends = list(backends)
        self._nixl_progress_thread = progress_thread
        self.agent: Any = None
        self._bindings: Any = None  # NIXL's bindings module, once the agent is created (its exceptions)
        # Replaced whole (never mutated) on the owner thread after each (de)registration.
        self._identity = AgentIdentity(b"", ())
        self._regions: dict[int, NixlRegion] = {}  # id(registration) -> region; owner thread only
        self._serials = 0
        # (call, its future): each counts as activity (heartbeats, which do not, wait apart below)
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        # Heartbeats (``activity=False``) wait apart: the owner thread answers them between commands
        # and between the READs of one batch (see _answer_heartbeats).
        self._heartbeats: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._wake = threading.Event()
        self._stopping = False
        self._xfers: list[PostedRead] = []  # posted and not final; owner thread only
        self._thread: threading.Thread | None = None
        self._on_notifications: Callable[[dict[str, list[bytes]]], None] = lambda _: None
        self._on_settled: Callable[[PostedRead], None] = lambda _: None
        self._fast_poll_until = 0.0  # written on the event loop, read by the owner thread
        self._active_at = time.monotonic()  # the owner thread's last call, read or notification
        self._warmup_leftovers: object = None  # what a warm-up that timed out could not release

    # --- the owner thread ---------------------------------------------------------------------

    async def start(
        self,
        on_notifications: Callable[[dict[str, list[bytes]]], None],
        on_settled: Callable[[PostedRead], None],
    ) -> None:
        """Create the agent on the owner thread. Both callbacks run on the owner thread:
        ``on_notifications`` with the notifications of each poll that had some, ``on_settled``
        with each READ that became final after its post (not one final within it)."""
        self._on_notifications = on_notifications
        self._on_settled = on_settled
        self._thread = threading.Thread(target=self._run, name="kvd-nixl", daemon=True)
        self._thread.start()
        await self.call(self._create_agent)

    def _create_agent(self) -> None:
        api = _nixl()
        self._bindings = api.nixlBind
        threaded = self._copy_threads > 1 and "UCX" in self._backends
        config = api.nixl_agent_config(
            enable_prog_thread=self._nixl_progress_thread,
            # UCX with copy threads is created below, with the parameters NIXL's config cannot pass
            backends=[b for b in self._backends if b != "UCX"] if threaded else self._backends,
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        if self._nixl_progress_thread:
            self.agent = create_agent_with_progress_wait(api, self.name, config, PROGRESS_THREAD_WAIT_S)
        else:
            self.agent = api.nixl_agent(self.name, config)
        if threaded:
            params = {"num_threads": str(self._copy_threads), "split_batch_size": str(SPLIT_BATCH_SIZE)}
            try:
                self.agent.create_backend("UCX", params)
                logger.info(
                    "NIXL's UCX backend copies READs of %d bytes or more with %d threads",
                    self._parallel_min_bytes,
                    self._copy_threads,
                )
            except Exception as exc:
                raise Internal(
                    f"NIXL's UCX backend with {self._copy_threads} copy threads could not be created: {exc}"
                ) from exc
        missing = [b for b in self._backends if b not in self.agent.backends]
        if missing:
            raise Internal(
                f"NIXL backends {missing} could not be created (available plugins: {self.agent.plugin_list})"
            )
        self._warmup_leftovers = warm_transport(api, self.agent, self._backends)
        self._snapshot()

    def _snapshot(self) -> None:
        """Take the agent's metadata and its regions together (owner thread)."""
        self._identity = AgentIdentity(bytes(self.agent.get_agent_metadata()), tuple(self._regions.values()))

    def submit(self, fn: Callable[[], T], activity: bool = True) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the owner thread (any thread may call this). ``activity=False``: a
        heartbeat, which must not keep the thread polling fast (see DORMANT_AFTER_S)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping or self._thread is None:
            future.set_exception(Unavailable("the NIXL data plane is stopped"))
            return future
        if activity:
            self._commands.append((fn, future))
        else:
            self._heartbeats.append((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[], T], activity: bool = True) -> T:
        """Run ``fn`` on the owner thread and wait for it (the call itself is not cancelled)."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, activity)))

    @property
    def fast_poll_until(self) -> float:
        return self._fast_poll_until

    @fast_poll_until.setter
    def fast_poll_until(self, deadline: float) -> None:
        """Poll fast until ``deadline`` (a reader is admitted): wakes a dormant thread at once."""
        self._fast_poll_until = deadline
        self._wake.set()

    def _run(self) -> None:
        while True:
            # Popped one at a time, never iterated: other threads append while this one runs
            # (iterating the deque raised "deque mutated during iteration" and ended the thread:
            # its worker was then killed as hung).
            self._answer_heartbeats()
            while self._commands:
                fn, future = self._commands.popleft()
                self._active_at = time.monotonic()
                _run_into(fn, future)
                self._answer_heartbeats()
            if self._stopping and not self._commands and not self._heartbeats:
                return
            if self.agent is not None:
                try:
                    self._poll()
                except Exception:  # the owner thread must survive a NIXL hiccup: log and go on
                    logger.exception("polling NIXL failed")
            self._wake.wait(self._poll_interval())
            self._wake.clear()

    def _answer_heartbeats(self) -> None:
        """Run the heartbeats waiting (owner thread only). Called between commands and between
        the READs of one ``reads`` batch: over shared memory UCX copies a READ within its post
        (128 MiB: tens of milliseconds, far more on a starved machine), and a batch of such READs
        must not make a working thread miss the control process's heartbeat and be killed as
        hung. A thread stuck inside one NIXL call still answers nothing."""
        while self._heartbeats:  # popped one at a time: other threads append meanwhile
            fn, future = self._heartbeats.popleft()
            _run_into(fn, future)

    def _poll_interval(self) -> float | None:
        """Seconds until the next poll; None: nothing to poll until a call comes (no memory is
        registered, so no peer can read from this agent and nothing notifies it: a spare worker)."""
        now = time.monotonic()
        if not self._regions and not self._xfers and now >= self._fast_poll_until:
            return None
        if self._xfers:
            self._active_at = now
            if any(now < x.spin_until for x in self._xfers):
                return 0.0
            return min(max(POLL_FAST_S, x.poll_from - now) if x.parallel else POLL_SLOW_S for x in self._xfers)
        if now < self._fast_poll_until:
            self._active_at = now
            # NIXL's progress thread serves admitted readers as their requests arrive: only the
            # notifications are left to poll, and they need no hurry (they end admissions).
            return POLL_IDLE_S if self._nixl_progress_thread else POLL_FAST_S
        if now - self._active_at < DORMANT_AFTER_S:
            return POLL_IDLE_S
        return POLL_DORMANT_S if self._fast_poll_until else POLL_UNADMITTED_S

    def _poll(self) -> None:
        if self._xfers:
            still = []
            for xfer in self._xfers:
                if not xfer.final:  # a READ whose later piece could not be built is final already
                    self._check(xfer)
                if xfer.state is XferState.DONE and xfer.rest is not None:
                    self._release(xfer)  # a piece is done: post the next ones
                    xfer.state = XferState.IN_PROGRESS
                    self._post_pieces(xfer)
                if xfer.final:
                    self._release(xfer)
                    _report(self._on_settled, xfer)
                else:
                    still.append(xfer)
            if len(still) != len(self._xfers):
                self._on_reads_in_flight(len(still))
            self._xfers = still
            if still:
                time.sleep(0)  # let the event loop run between spins
        notifications = self.agent.get_new_notifs()
        if notifications:
            self._active_at = time.monotonic()
        if notifications:
            _report(self._on_notifications, dict(notifications))

    def _check(self, xfer: PostedRead) -> None:
        try:
            state = XferState(self.agent.check_xfer_state(xfer.handle))
        except Exception as exc:  # NIXL reports a failed request by raising: it is final
            xfer.state, xfer.error = XferState.ERROR, self._map(exc, xfer.peer)
            return
        if state is XferState.ERROR:
            xfer.error = PeerUnavailable(f"NIXL read from peer {xfer.peer} failed: peer gone?")
        xfer.state = state

    def _release(self, xfer: PostedRead) -> None:
        """A final transfer (or piece): release its handle (safe now: no byte of it can land any
        more). Nothing to do where it has none (released already, or never built)."""
        if xfer.handle is None:
            return
        try:
            self.agent.release_xfer_handle(xfer.handle)
        except Exception as exc:  # a final handle that NIXL will not release: it holds no bytes
            logger.warning("NIXL could not release a finished transfer from %s: %s", xfer.peer, exc)
        xfer.handle = None

    async def stop(self) -> None:
        """Stop the owner thread after the queued calls (reads still in flight stay unreleased)."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        if self._xfers:
            logger.warning("%d NIXL reads were still in flight at shutdown", len(self._xfers))

    # --- identity -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """The agent's metadata as of the last (de)registration (no NIXL call: loop-safe)."""
        return self._identity.metadata

    def identity(self) -> AgentIdentity:
        """The agent's metadata and exactly the regions it names (no NIXL call: loop-safe)."""
        return self._identity

    # --- memory -------------------------------------------------------------------------------

    async def register(self, address: int, size: int, device_index: int, mem_type: str) -> Any:
        """Register one region with every backend that takes its memory type."""

        def register() -> Any:
            registration = self.agent.register_memory([(address, size, device_index, "")], mem_type)
            self._serials += 1
            self._regions[id(registration)] = NixlRegion(address, size, device_index, mem_type == "VRAM", self._serials)
            self._snapshot()
            return registration

        return await self.call(register)

    async def deregister(self, registration: Any) -> None:
        def deregister() -> None:
            self.agent.deregister_memory(registration)
            self._regions.pop(id(registration), None)
            self._snapshot()

        await self.call(deregister)

    # --- peers --------------------------------------------------------------------------------

    async def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata. Loading a known agent again adds its new memory (NIXL merges
        the sections: prepared lists stay valid), so a re-handshake never removes the agent.

        The UCX connection is started at once (``make_connection`` does not wait): it then sets
        up while the first pull plans and is admitted, instead of after its READ is posted (a
        first READ on a new endpoint took ~4-12 ms more; one 2 ms after the connect, ~1 ms)."""

        def add() -> str:
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # NIXL raises its own exception types here
                if REMOTE_DISCONNECT in str(exc):  # the peer went away while it loaded: not bad metadata
                    raise PeerUnavailable(f"peer agent gone while its metadata was loaded: {exc}") from exc
                raise InvalidArgument(f"peer agent metadata rejected by NIXL: {exc}") from exc
            name = _agent_name(name)
            try:
                self.agent.make_connection(name)
            except Exception as exc:  # an optimisation only: the first READ connects anyway
                logger.debug("NIXL could not start connecting to %s: %s", name, exc)
            return name

        return await self.call(add)

    async def remove_remote(self, agent_name: str, tables: Sequence[Any]) -> None:
        """Release a peer's prepared lists, then forget its agent (only once nothing uses them)."""

        def remove() -> None:
            for table in tables:
                _release_table(self.agent, table)
            try:
                self.agent.remove_remote_agent(agent_name)
            except Exception as exc:  # already gone: nothing to release
                logger.debug("remove_remote_agent(%s): %s", agent_name, exc)

        await self.call(remove)

    # --- tables -------------------------------------------------------------------------------

    def prepare_table(self, agent_name: str, rows: np.ndarray, mem_type: str) -> Any:
        """Prepare a descriptor list (blocking; run in a worker thread, see the module docstring)."""
        if self.agent is None:
            raise Unavailable("the NIXL data plane is not started")
        # The table keeps the rows as given: compressed, they are a few rows per plane even where
        # this NIXL must be given one row per descriptor.
        given = rows
        if rows.shape[1] == 5 and not takes_strided_lists(self.agent):
            rows = expand_strided(rows)
        return PreparedTable.of(self.agent.prep_xfer_dlist(agent_name, rows, mem_type), agent_name, mem_type, given)

    async def release_tables(self, tables: Sequence[Any]) -> None:
        if tables:

            def release() -> None:
                for table in tables:
                    _release_table(self.agent, table)

            await self.call(release)

    # --- transfers ----------------------------------------------------------------------------

    def post_reads(self, reads: Sequence[NixlRead], answer: Callable[[list[PostedRead | KvdError]], None]) -> None:
        """Post READs, all in one command on the owner thread, and call ``answer`` there at once
        with, for each, its PostedRead or the error that refused it (then nothing of it was
        posted). Any thread may call this; a stopped agent answers every READ Unavailable.

        A READ that NIXL built but failed to post (wholly or in part) is a PostedRead with
        ``error`` set: part of it may be on its way, so it is polled to a final state like any
        other, and its destination must stay pinned until then. ``answer`` runs before any of
        them is polled, so it always precedes their ``on_settled``."""
        reads = [
            read._replace(
                local_indices=np.ascontiguousarray(read.local_indices, dtype=np.int32),
                remote_indices=np.ascontiguousarray(read.remote_indices, dtype=np.int32),
            )
            for read in reads
        ]

        def post_all() -> None:
            out: list[PostedRead | KvdError] = []
            for read in reads:
                try:
                    out.append(self._post(read))
                except KvdError as exc:
                    out.append(exc)
                except Exception as exc:
                    out.append(Internal(f"posting a READ from {read.peer} failed: {type(exc).__name__}: {exc}"))
                self._answer_heartbeats()
            answer(out)

        posting = self.submit(post_all)
        if posting.done() and posting.exception() is not None:  # stopped: nothing was posted
            error = posting.exception()
            answer([error if isinstance(error, KvdError) else Unavailable(str(error)) for _ in reads])

    def _post(self, read: NixlRead) -> PostedRead:
        """Build and post one READ (owner thread only), in pieces if it is larger than
        ``max_post_bytes``. Raises if NIXL refused to build it (then nothing of it was posted)."""
        xfer = PostedRead(read.xfer_id, None, read.peer, 0.0, rest=read)
        self._post_pieces(xfer)
        if xfer.state is XferState.DONE:
            # Done within the post (UCX copied it: shared memory, small reads): final now,
            # released here; its answer says so, and no settled report follows.
            return xfer
        # In flight, or final with an error after some of its pieces were posted: both are
        # reported settled by the next poll.
        self._xfers.append(xfer)
        self._on_reads_in_flight(len(self._xfers))
        return xfer

    def _post_pieces(self, xfer: PostedRead) -> None:
        """Post the READ's next pieces, one after the other while each is DONE within its post,
        answering heartbeats between them (owner thread). Returns with a piece in flight, or the
        READ final (DONE, or ERR where a later piece could not be built: nothing is in flight
        then). Raises only where its first piece could not be built (nothing was posted)."""
        while xfer.rest is not None:
            piece, xfer.rest = _split(xfer.rest, self._max_post_bytes)
            xfer.parallel = self._copies_in_parallel(piece)
            try:
                if xfer.parallel:
                    xfer.handle = self._make_parallel_xfer(piece)
                else:
                    xfer.handle = self.agent.make_prepped_xfer(
                        "READ",
                        nixl_handle(piece.local_table),
                        piece.local_indices,
                        nixl_handle(piece.remote_table),
                        piece.remote_indices,
                        piece.notif,
                    )
            except Exception as exc:
                error = self._map(exc, piece.peer)
                if xfer.pieces_posted == 0:
                    raise error from exc
                xfer.state, xfer.error, xfer.rest = XferState.ERROR, error, None
                return
            xfer.pieces_posted += 1
            if xfer.rest is None and xfer.pieces_posted > 1:
                logger.debug(
                    "READ %d from %s: its last piece posted, %d in all", xfer.xfer_id, piece.peer, xfer.pieces_posted
                )
            now = time.monotonic()
            if xfer.parallel:  # never spun on: the spinning thread took a copy thread's core
                xfer.spin_until = 0.0
                xfer.poll_from = now + piece.nbytes / (PARALLEL_BYTES_PER_S * self._copy_threads)
            else:
                xfer.spin_until = now + SPIN_S + piece.nbytes / SPIN_BYTES_PER_S
            try:
                state = self.agent.transfer(xfer.handle)
            except Exception as exc:
                # Some of the piece may be posted already: poll it to a final state like any other.
                xfer.error, xfer.rest = self._map(exc, piece.peer), None
                return
            if state == "ERR":
                xfer.error, xfer.rest = PeerUnavailable(f"NIXL could not post a read from peer {piece.peer}"), None
                return
            if state != "DONE":
                return  # in flight: the poll posts the next piece once this one is DONE
            self._release(xfer)
            if xfer.rest is None:
                xfer.state = XferState.DONE
                return
            self._answer_heartbeats()

    def _copies_in_parallel(self, piece: NixlRead) -> bool:
        """Is this piece posted as ad-hoc lists cut for NIXL's copy threads? Host memory on both
        sides (a GPU copy is the GPU's, not a thread's), large enough, and lists kvd prepared."""
        local, remote = piece.local_table, piece.remote_table
        return (
            self._copy_threads > 1
            and piece.nbytes >= self._parallel_min_bytes
            and isinstance(local, PreparedTable)
            and isinstance(remote, PreparedTable)
            and local.mem_type == "DRAM"
            and remote.mem_type == "DRAM"
        )

    def _make_parallel_xfer(self, piece: NixlRead) -> Any:
        """Build a piece as about ``copy_threads`` x SPLIT_BATCH_SIZE equal descriptors (owner
        thread). The same bytes as its runs, in the same registrations: only the cut differs."""
        local, remote = piece.local_table, piece.remote_table
        assert isinstance(local, PreparedTable) and isinstance(remote, PreparedTable)
        local_address, lengths, local_device = local.descriptors(piece.local_indices)
        remote_address, remote_lengths, remote_device = remote.descriptors(piece.remote_indices)
        if not np.array_equal(lengths, remote_lengths):  # the planner pairs runs of one length
            raise Internal(f"a READ from {piece.peer} pairs runs of different lengths")
        run, offset, length = cut_runs(lengths, self._copy_threads * SPLIT_BATCH_SIZE)
        local_rows = np.stack([local_address[run] + offset, length, local_device[run]], axis=1)
        remote_rows = np.stack([remote_address[run] + offset, length, remote_device[run]], axis=1)
        peer_agent = self.name if remote.agent_name == LOCAL else remote.agent_name
        logger.debug(
            "READ %d from %s: %d bytes in %d runs, posted as %d descriptors for %d copy threads",
            piece.xfer_id,
            piece.peer,
            int(length.sum()),
            lengths.size,
            length.size,
            self._copy_threads,
        )
        return self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local_rows, "DRAM"),
            self.agent.get_xfer_descs(remote_rows, "DRAM"),
            peer_agent,
            piece.notif,
        )

    def in_flight(self) -> int:
        """Reads posted and not yet final (approximate: read from another thread)."""
        return len(self._xfers)

    def _map(self, exc: Exception, peer: str) -> KvdError:
        # The bindings of the agent this module created: never an import here (a test's fake
        # agent must not load NIXL into its process: loaded there, it made a later import of
        # grpc_tools' protoc compiler segfault).
        bindings = self._bindings
        if bindings is None:
            return Internal(f"NIXL error reading from {peer}: {type(exc).__name__}: {exc}")
        if isinstance(exc, (bindings.nixlRemoteDisconnectError, bindings.nixlBackendError)):
            return PeerUnavailable(f"peer {peer} disconnected: {exc}")
        if isinstance(exc, bindings.nixlNotFoundError):
            return PeerUnavailable(f"peer {peer} is not known to NIXL (restarted?): {exc}")
        if isinstance(exc, bindings.nixlInvalidParamError):
            return Internal(f"NIXL rejected a transfer built by kvd: {exc}")
        return Internal(f"NIXL error reading from {peer}: {type(exc).__name__}: {exc}")


_CREATE_LOCK = threading.Lock()


def _split(read: NixlRead, max_bytes: int) -> tuple[NixlRead, NixlRead | None]:
    """The first piece of a READ to post (about ``max_bytes``, at least one run) and the rest, or
    None where it fits whole. Only the last piece carries the notification."""
    runs = len(read.local_indices)
    if read.nbytes <= max_bytes or runs <= 1:
        return read, None
    take = max(1, runs * max_bytes // read.nbytes)
    if take >= runs:
        return read, None
    piece_bytes = read.nbytes * take // runs
    piece = read._replace(
        local_indices=read.local_indices[:take],
        remote_indices=read.remote_indices[:take],
        notif=b"",
        nbytes=piece_bytes,
    )
    rest = read._replace(
        local_indices=read.local_indices[take:],
        remote_indices=read.remote_indices[take:],
        nbytes=read.nbytes - piece_bytes,
    )
    return piece, rest


def _run_into(fn: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
    """Run a submitted call and settle its future with the result or the exception."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)


def create_agent_with_progress_wait(api: Any, name: str, config: Any, wait_s: float) -> Any:
    """``api.nixl_agent(name, config)`` with its progress thread waiting on UCX's event fd.

    The C++ agent's config has the thread's poll timeout (``pthrDelay``, microseconds), but NIXL's
    Python API sets it to 0 itself, and with 0 the thread busy-polls a whole core (measured with
    NIXL 1.5.1 on an idle agent: 99.9 % of a core; with 100 ms, 0.08 %, and a notification or a
    request from a peer still wakes it at once). So the agent is created with the bindings'
    constructor wrapped to set the timeout: public fields of the public bindings, nothing else
    changed. A NIXL whose bindings lack the field is refused: its thread would busy-poll."""
    bindings = api.nixlBind
    construct = bindings.nixlAgent
    if not hasattr(bindings.nixlAgentConfig(), "pthrDelay"):
        raise Internal("this NIXL's agent config has no progress-thread timeout: set nixl_progress_thread = false")

    def with_wait(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = max(1, round(wait_s * 1e6))
        return construct(agent_name, agent_config)

    with _CREATE_LOCK:  # agents are created one at a time anyway (the owner thread)
        bindings.nixlAgent = with_wait
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = construct


def warm_transport(api: Any, agent: Any, backends: Sequence[str]) -> object:
    """Pay UCX's one-time costs of a new agent now, at worker start, instead of on a first pull.

    Measured here (UCX 1.23 through NIXL 1.5, tcp + cma): the first connection an agent ever
    initiates costs ~10 ms in loading the peer's metadata, and the first connection it ever
    accepts ~10 ms inside the progress call that handles it; later connections cost ~1-2 ms.
    Both fell on the first pull to a new peer. So a throwaway agent in this process connects
    both ways and reads ``WARMUP_BYTES`` with a notification each way: a pull's READ path.

    Runs on the owner thread before the agent is used (nothing else knows its name yet, so the
    only notifications it can get are the warm-up's own). Never fatal: a failure only costs the
    first pull its time. The probes are dropped after it (the warmed state stays: measured).
    Returns what could not be released (a READ that never became final keeps its buffers,
    registrations and probes alive), or None."""
    started = time.perf_counter()
    probes: list[Any] = []
    try:
        # Two throwaway agents: one this agent connects out to, one that connects in. With one
        # probe both ways, the second connection reused the first one's endpoint, and a first real
        # peer still paid for whichever side that skipped (measured both orders).
        for direction in ("out", "in"):
            probe = api.nixl_agent(
                f"{agent.name}-warmup-{direction}",
                api.nixl_agent_config(enable_prog_thread=False, backends=list(backends)),
            )
            probes.append(probe)
            initiator, target = (agent, probe) if direction == "out" else (probe, agent)
            leftover = _warm_read(initiator, target)
            if leftover is not None:  # _warm_read said why
                return (probes, leftover)
    except Exception as exc:  # an optimisation only
        logger.warning("NIXL transport warm-up failed (the first pull to each peer will be slower): %s", exc)
        return None
    logger.debug("NIXL transport warm-up took %.1f ms", (time.perf_counter() - started) * 1e3)
    return None  # the probes go with their last reference: their UCX workers and endpoints close


def _warm_read(initiator: Any, target: Any) -> object:
    """``initiator`` READs WARMUP_BYTES of ``target``'s memory with a notification, polling both
    to the end; returns what must stay alive if the READ never became final, else None.
    Whatever was set up is undone in reverse order, on errors too, once nothing is in flight."""
    source = np.zeros(WARMUP_BYTES, np.uint8)
    destination = np.zeros(WARMUP_BYTES, np.uint8)
    with contextlib.ExitStack() as undo:
        registration = target.register_memory([(source.ctypes.data, WARMUP_BYTES, 0, "")], "DRAM")
        undo.callback(target.deregister_memory, registration)
        registration = initiator.register_memory([(destination.ctypes.data, WARMUP_BYTES, 0, "")], "DRAM")
        undo.callback(initiator.deregister_memory, registration)
        name = _agent_name(initiator.add_remote_agent(target.get_agent_metadata()))
        undo.callback(initiator.remove_remote_agent, name)
        remote = initiator.prep_xfer_dlist(name, [(source.ctypes.data, WARMUP_BYTES, 0)], "DRAM")
        undo.callback(initiator.release_dlist_handle, remote)
        local = initiator.prep_xfer_dlist(LOCAL, [(destination.ctypes.data, WARMUP_BYTES, 0)], "DRAM")
        undo.callback(initiator.release_dlist_handle, local)
        handle = initiator.make_prepped_xfer("READ", local, [0], remote, [0], b"kvd-warmup")
        state = "PROC"
        failure: Exception | None = None
        try:
            state = initiator.transfer(handle)
            notified = False
            deadline = time.monotonic() + WARMUP_TIMEOUT_S
            while (state == "PROC" or not notified) and state != "ERR" and time.monotonic() < deadline:
                if state == "PROC":
                    state = initiator.check_xfer_state(handle)
                notified = notified or bool(target.get_new_notifs())
                time.sleep(0)
        except Exception as exc:
            failure = exc
        if state == "PROC":  # may still land (timed out, or a call failed mid-way): nothing is undone
            logger.warning(
                "the NIXL transport warm-up's READ is not final (%s): its buffers stay for the worker's life",
                failure if failure is not None else f"not done in {WARMUP_TIMEOUT_S:.0f} s",
            )
            return (source, destination, handle, undo.pop_all())
        if failure is not None:
            raise failure
        initiator.release_xfer_handle(handle)
    return None


def takes_strided_lists(agent: Any) -> bool:
    """Does this NIXL prepare lists from compressed rows (address, length, device, stride, count)?

    Tables come in that form (:meth:`kvd.layout.geometry.DescGeometry.strided`): a whole-block
    table of a large engine is millions of descriptors, and building them one by one held the
    GIL for 100-250 ms per table (measured, 4M descriptors), stalling every READ the worker
    posts meanwhile; compressed, NIXL prepares it in about a millisecond. A NIXL whose
    ``prep_xfer_dlist`` does not document the form gets them expanded (its old cost)."""
    return "Nx5" in (getattr(type(agent).prep_xfer_dlist, "__doc__", None) or "")


def _agent_name(loaded: bytes | str) -> str:
    """The agent name ``add_remote_agent`` returns (bytes or str, depending on NIXL's binding)."""
    return loaded.decode() if isinstance(loaded, bytes) else str(loaded)


def _release_table(agent: Any, table: Any) -> None:
    try:
        agent.release_dlist_handle(nixl_handle(table))
    except Exception as exc:  # releasing a dead peer's list may fail; nothing else to do
        logger.debug("releasing a prepared list: %s", exc)


def _report(callback: Callable[[T], None], value: T) -> None:
    """Run a callback of the poll; one that fails is logged, and the poll goes on (the READs
    it was checking must still be released once, and kept until final)."""
    try:
        callback(value)
    except Exception:
        logger.exception("reporting from the NIXL thread failed")
