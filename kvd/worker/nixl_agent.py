"""The worker's NIXL agent: one per worker incarnation, driven by one thread that owns it.

This module runs in the data-plane worker process, never in the control process (see
kvd.dataplane_protocol); with kvd.worker.nixl_setup (which creates the agent) and
kvd.worker.nixl_reads (what a READ is and how it is cut) it is the only code that talks to NIXL.
It turns NIXL's string states and exceptions into :class:`XferState` and kvd errors, and promises:

* **One thread drives NIXL.** Every call on the agent runs on the owner thread (``kvd-nixl``),
  fed by a queue, except ``prep_xfer_dlist``: preparing a large table takes long, touches no UCX
  worker and runs under NIXL's agent lock, so it runs in the caller's thread pool. The owner
  thread also polls every posted READ and NIXL's notifications, so UCX makes progress (it copies
  inside those polls) and no two threads ever drive the UCX worker at once.
* **A READ is settled only once final.** NIXL cannot cancel a READ in flight (``release`` leaves
  the UCX request running and its bytes still land), so a handle that is not final is never
  released: it is polled until NIXL reports DONE or ERR, then released and reported settled
  (``on_settled``). A final state is therefore the proof that no byte of the READ can land any
  more; callers that give up on a READ keep its destination pinned until then (docs/lifetimes.md).
* **Heartbeats are answered between NIXL calls.** Over shared memory UCX copies a READ within its
  post, and meanwhile the owner thread answers nothing, the control process's heartbeat included.
  So a READ larger than ``max_post_bytes`` is posted in pieces, one after the other (the next once
  the previous is DONE), heartbeats answered between them and between the READs of one batch; the
  READ is final when its last piece is, or when a piece ends in ERR (kvd.worker.nixl_reads).
* **Large host READs may be copied by several threads** (opt-in: ``copy_threads`` > 1; the UCX
  backend is then NIXL's thread pool). Such a READ is re-cut into equal descriptors for the
  threads (kvd.worker.nixl_reads), and while it is in flight the owner thread polls it every
  POLL_FAST_S without spinning: a spinning poller takes one of the copy threads' cores.
* **An idle agent costs little.** With nothing to do the owner thread polls less and less often
  (the POLL_* constants below), and not at all while no memory is registered; any call or a
  reader's admission (``fast_poll_until``) wakes it at once.
* **Callbacks run on the owner thread**: ``on_notifications``, ``on_settled`` and the answer of
  :meth:`NixlAgent.post_reads`. The worker sends them to the control process straight from here
  (kvd.worker.channel), without a hop through its event loop; they must not block.

The figures behind these choices, and the NIXL versions they were measured with:
docs/performance.md ("The worker's NIXL agent: figures and history").
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
from kvd.worker.nixl_reads import (
    PARALLEL_BYTES_PER_S,
    NixlRead,
    PostedRead,
    PreparedTable,
    build_parallel_xfer,
    copies_in_parallel,
    nixl_error,
    nixl_handle,
    split_read,
)

# ``X as X``: defined here before kvd.worker.nixl_reads and nixl_setup took them; still importable from here.
from kvd.worker.nixl_reads import SPLIT_BATCH_SIZE as SPLIT_BATCH_SIZE
from kvd.worker.nixl_reads import cut_runs as cut_runs
from kvd.worker.nixl_reads import split_read as _split  # noqa: F401 - tests import it from here
from kvd.worker.nixl_setup import PROGRESS_THREAD_WAIT_S as PROGRESS_THREAD_WAIT_S
from kvd.worker.nixl_setup import WARMUP_BYTES as WARMUP_BYTES
from kvd.worker.nixl_setup import WARMUP_TIMEOUT_S as WARMUP_TIMEOUT_S
from kvd.worker.nixl_setup import create_agent_with_progress_wait as create_agent_with_progress_wait
from kvd.worker.nixl_setup import loaded_agent_name, nixl_api, open_agent, takes_strided_lists, warm_transport
from kvd.worker.nixl_thread import OwnerThread
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
# notifications are polled every POLL_DORMANT_S only (what an idle daemon costs:
# docs/performance.md). Any call or a reader's admission wakes the thread at once.
DORMANT_AFTER_S = 1.0
POLL_DORMANT_S = 0.05
# Dormant with no reader admitted at all (the control process sets fast_poll_until to 0.0 once the
# last admission is over; it stays at a past deadline while an overdue admission is still open, in
# its read_admission_margin_s, and then a late notification is read within POLL_DORMANT_S, and
# while a read that was never proven over may still be served: Holder._poll_fast_while_admitted (kvd.core.holder)):
# nothing can notify us, so the thread polls once a second only (the control process's heartbeat wakes it
# about as often anyway). An admission, or any call, wakes it at once. Each poll costs UCX
# progress, which added up to much of an idle worker's CPU (docs/performance.md).
POLL_UNADMITTED_S = 1.0


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
        self._owner = OwnerThread("kvd-nixl", self._poll_created, self._poll_interval)
        self._xfers: list[PostedRead] = []  # posted and not final; owner thread only
        self._on_notifications: Callable[[dict[str, list[bytes]]], None] = lambda _: None
        self._on_settled: Callable[[PostedRead], None] = lambda _: None
        self._fast_poll_until = 0.0  # written on the event loop, read by the owner thread
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
        self._owner.start()
        await self.call(self._create_agent)

    def _create_agent(self) -> None:
        api = nixl_api()
        self._bindings = api.nixlBind
        self.agent = open_agent(
            api, self.name, self._backends, self._nixl_progress_thread, self._copy_threads, self._parallel_min_bytes
        )
        self._warmup_leftovers = warm_transport(api, self.agent, self._backends)
        self._snapshot()

    def _snapshot(self) -> None:
        """Take the agent's metadata and its regions together (owner thread)."""
        self._identity = AgentIdentity(bytes(self.agent.get_agent_metadata()), tuple(self._regions.values()))

    def attach_inbox(self, sock: socket.socket, read: Callable[[], bool]) -> None:
        """Have the owner thread read ``sock`` itself (before :meth:`start`; see
        kvd.worker.nixl_thread): the worker's READ orders reach it with no hop."""
        self._owner.attach_inbox(sock, read)

    def submit(self, fn: Callable[[], T], activity: bool = True) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the owner thread (any thread may call this). ``activity=False``: a
        heartbeat, which must not keep the thread polling fast (see DORMANT_AFTER_S)."""
        return self._owner.submit(fn, activity)

    async def call(self, fn: Callable[[], T], activity: bool = True) -> T:
        """Run ``fn`` on the owner thread and wait for it (the call itself is not cancelled)."""
        return await self._owner.call(fn, activity)

    @property
    def fast_poll_until(self) -> float:
        return self._fast_poll_until

    @fast_poll_until.setter
    def fast_poll_until(self, deadline: float) -> None:
        """Poll fast until ``deadline`` (a reader is admitted): wakes a dormant thread at once."""
        self._fast_poll_until = deadline
        self._owner.wake()

    def _poll_interval(self) -> float | None:
        """Seconds until the next poll; None: nothing to poll until a call comes (no memory is
        registered, so no peer can read from this agent and nothing notifies it: a spare worker)."""
        now = time.monotonic()
        if not self._regions and not self._xfers and now >= self._fast_poll_until:
            return None
        if self._xfers:
            self._owner.active_at = now
            if any(now < x.spin_until for x in self._xfers):
                return 0.0
            return min(max(POLL_FAST_S, x.poll_from - now) if x.parallel else POLL_SLOW_S for x in self._xfers)
        if now < self._fast_poll_until:
            self._owner.active_at = now
            # NIXL's progress thread serves admitted readers as their requests arrive: only the
            # notifications are left to poll, and they need no hurry (they end admissions).
            return POLL_IDLE_S if self._nixl_progress_thread else POLL_FAST_S
        if now - self._owner.active_at < DORMANT_AFTER_S:
            return POLL_IDLE_S
        return POLL_DORMANT_S if self._fast_poll_until else POLL_UNADMITTED_S

    def _poll_created(self) -> None:
        if self.agent is not None:
            self._poll()

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
            self._owner.active_at = time.monotonic()
            _report(self._on_notifications, dict(notifications))

    def _check(self, xfer: PostedRead) -> None:
        try:
            state = XferState(self.agent.check_xfer_state(xfer.handle))
        except Exception as exc:  # NIXL reports a failed request by raising: it is final
            xfer.state, xfer.error = XferState.ERROR, nixl_error(self._bindings, exc, xfer.peer)
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
        if await self._owner.stop() and self._xfers:
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
        up while the first pull plans and is admitted, instead of after its READ is posted
        (what that saves: docs/performance.md)."""

        def add() -> str:
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # NIXL raises its own exception types here
                if REMOTE_DISCONNECT in str(exc):  # the peer went away while it loaded: not bad metadata
                    raise PeerUnavailable(f"peer agent gone while its metadata was loaded: {exc}") from exc
                if "NIXL_ERR_BACKEND" in str(exc):
                    # UCX could not reach the peer's worker (its data plane was replaced or is gone:
                    # "connect ... failed: Connection refused"): the peer's state, not bad metadata.
                    raise PeerUnavailable(f"peer agent unreachable while its metadata was loaded: {exc}") from exc
                raise InvalidArgument(f"peer agent metadata rejected by NIXL: {exc}") from exc
            name = loaded_agent_name(name)
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
        posted). Any thread may call this (the owner thread posts at once: the orders it reads
        itself); a stopped agent answers every READ Unavailable.

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
                self._owner.answer_heartbeats()
            answer(out)

        if self._owner.on_thread() and not self._owner.stopping:
            post_all()  # an order the thread read itself (its inbox): posted now, not queued
            return
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
            piece, xfer.rest = split_read(xfer.rest, self._max_post_bytes)
            xfer.parallel = copies_in_parallel(piece, self._copy_threads, self._parallel_min_bytes)
            try:
                if xfer.parallel:
                    xfer.handle = build_parallel_xfer(self.agent, self.name, piece, self._copy_threads)
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
                error = nixl_error(self._bindings, exc, piece.peer)
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
                xfer.error, xfer.rest = nixl_error(self._bindings, exc, piece.peer), None
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
            self._owner.answer_heartbeats()

    def in_flight(self) -> int:
        """Reads posted and not yet final (approximate: read from another thread)."""
        return len(self._xfers)


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
