"""A pull's READs posted within the StartPull(s) that starts it, before any task of its step runs
(one part of :class:`kvd.core.pulls.Puller`, the reader's pipeline).

An engine step starts its pulls in one StartPulls (or one message on its engine stream). Each
pull's task used to plan, pin and post its READs in turn, interleaved with the other tasks of the
step and their admissions, so a step of 32 one-block pulls sent its step READ to the data-plane
worker ~8 ms after StartPulls arrived, after every pull had been planned and every PreparePull
built and written (docs/performance.md, "A step's READs sent as it starts"). Here a pull that
needs nothing it would have to wait for is planned and its READs queued at once, in the call
that starts it; StartPulls then sends the step's READs to the worker (one step READ per pair of
lists: kvd.core.step_reads) before anything else of the step runs. Each such pull's admission is
queued here too (:meth:`PullPlanner.ask_admission`), and StartPulls writes the step's admissions
out (one message per holder) right after its last READs: the holder starts on them within the
call, not two event-loop turns after it (the pull's task, then the peer stream's writer). The
pull's task then only reads the answer, beside READs already under way
(:meth:`PullReads.beside_admission`): the rules are those of any READ posted beside its admission
(docs/lifetimes.md, "A READ beside its admission"), only the order of the two differs.

A step's READs leave in a few sends, not one: the first pull's READs as soon as it is planned,
then the next 3, the next 9, and the rest (:func:`step_flush_points`). The worker copies the first
pulls' bytes while the reader plans the others, instead of waiting idle for the whole step's
planning (a step of 32 one-block pulls: ~4.5 ms of planning before its one READ, against ~0.3 ms
before its first here; docs/performance.md, "A step's READs in growing sends"). Each send is
one "reads" call carrying one step READ per pair of lists, so a step costs at most four worker
messages and four holder notifications whatever its size below 40 pulls.

"Nothing to wait for" is checked without yielding to the event loop: the holder's handshake is
cached, of the incarnation the lease names, young enough to read early and naming the lease's
registrations; the peer's agent is loaded and not being reloaded; the plan is small (inline) and
reads straight into the engine's blocks (no staging, no conversion); every holder rank takes
early READs; and both descriptor lists of every READ are prepared already. Anything else (a first
contact, a re-registration, a large or converting pull) posts nothing here and takes the usual
way, unchanged. Event-loop only.
"""

from __future__ import annotations

import functools
import logging
import time

from kvd.config import KvdConfig
from kvd.core.dataplane import DataPlane
from kvd.core.local_memory import Memories
from kvd.core.params import TransferParams
from kvd.core.peers import Peers
from kvd.core.pull_plans import (
    INLINE_PLAN_BLOCKS,
    PullPlanner,
    StaleHandshake,
    lease_unexpired,
    names_the_leased_registrations,
)
from kvd.core.pull_reads import PullReads, StartedReads
from kvd.core.pull_resources import PullResources
from kvd.core.registry import EngineRank
from kvd.core.transfers import Transfer

logger = logging.getLogger(__name__)

STEP_FLUSH_GROWTH = 3
"""Each send of a step's READs carries this many times the pulls of the one before (1, 3, 9, ...).

The reader plans a one-block pull in ~0.15 ms and the worker copies its 2 MiB in ~0.4 ms here,
so the next send is ready about when the worker has posted the last; 3 keeps the worker busy
with few sends (docs/performance.md, "A step's READs in growing sends")."""


@functools.lru_cache(maxsize=128)
def step_flush_points(pulls: int) -> frozenset[int]:
    """The indices of a step's pulls before which the READs queued so far go to the worker.

    For 32 pulls: {1, 4, 13} (sends of 1, 3, 9 and 19 pulls' READs). Cached: steps repeat sizes."""
    points: set[int] = set()
    size, at = 1, 1
    while at < pulls:
        points.add(at)
        size *= STEP_FLUSH_GROWTH
        at += size
    return frozenset(points)


class StartPosts:
    """Queues a starting pull's READs where nothing has to be awaited first (module docstring)."""

    def __init__(
        self, config: KvdConfig, peers: Peers, planner: PullPlanner, reads: PullReads, memories: Memories
    ) -> None:
        self.config = config
        self.peers = peers
        self._planner = planner
        self._reads = reads
        self._memories = memories

    def post(
        self, transfer: Transfer, rank: EngineRank, remote: TransferParams, dataplane: DataPlane
    ) -> StartedReads | None:
        """Plan the pull and queue its READs now, or return None having changed nothing."""
        if not self.config.read_beside_admission or len(transfer.local_block_ids) > INLINE_PLAN_BLOCKS:
            return None
        memory = rank.memory
        if not memory.usable or not lease_unexpired(remote):
            return None
        session = self.peers.cached(remote.daemon_address)
        if session is None or session.agent.reloading or session.agent.removed:
            return None
        if remote.daemon_incarnation and session.incarnation != remote.daemon_incarnation:
            return None  # the usual way says why (the holder restarted)
        if session.early_read_window_s <= 0 or not session.may_read_early(time.monotonic()):
            return None
        if not names_the_leased_registrations(session, remote):
            return None
        try:
            plan, remote_ranks = self._planner.plan_layout_now(session, transfer, rank, remote)
        except StaleHandshake:
            return None
        if plan.staging_bytes or plan.postprocess is not None:
            return None
        if not all(remote_ranks[r].early_reads for r in plan.remote_ranks):
            return None
        tables = []
        for group in plan.reads:
            remote_table = session.agent.ready_table(remote_ranks[group.remote_rank], group.remote_geometry)
            local_table = memory.ready_table(group.local_geometry)
            if remote_table is None or local_table is None:
                return None  # a list still to prepare: the usual way waits for it
            tables.append((local_table, remote_table))
        # Nothing below yields or can refuse: the pull is committed to this way.
        self._memories.pin(memory)
        held = PullResources(memory, plane=dataplane, posts=transfer.posts)
        held.agent = self.peers.pin(session)
        held.session = session  # from here a failed pull tells the holder, once its READs are final
        held.quiet_reads = quiet = self._reads.quiet(plan, remote_ranks)
        self._reads.begin_reading(transfer, plan)
        tag = self._reads.notif_tag(remote, transfer)
        for index, (group, (local_table, remote_table)) in enumerate(zip(plan.reads, tables, strict=True)):
            self._reads.queue_read(
                held, session, plan, index, remote_ranks[group.remote_rank], local_table, remote_table, tag, quiet
            )
        try:
            asked = self._planner.ask_admission(transfer, rank, remote, plan, remote_ranks)
        except Exception:  # a bug must not strand READs already queued: the pull's task asks it then
            logger.exception("queueing the admission of pull %s failed; its task asks it", transfer.transfer_id)
            asked = None
        return StartedReads(held, session, plan, remote_ranks, asked)
