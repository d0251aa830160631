"""What one pull holds, and the end of a pull on the reader side: the fence, the hand-back, the
AbandonPull (one part of :class:`kvd.core.pulls.Puller`, the reader's pipeline).

**Fence before failing.** A failed pull's blocks are recomputed by the engine, so the failure
is reported only once no byte of the pull can still land in them (docs/lifetimes.md):

1. every READ the pull posted is final (NIXL said DONE or ERR): reported at once;
2. otherwise, after waiting up to ``fence_timeout_s`` (within the pull's deadline), host memory
   is *re-mapped*: the engine's pages get new addresses in the daemon (new NIXL registration),
   and the old addresses are retired once no admitted remote read uses them, so a late copy
   lands in throw-away pages. Other pulls that were reading into the old mapping then fail too
   (their blocks are recomputed), never DONE;
3. VRAM cannot be re-mapped: the failure waits until NIXL finishes the reads.

**Hand-back.** The pull pins the engine's mapping and the peer's NIXL agent from first use until
its reads are final or fenced (:class:`PullResources`); what a pull that gave up still holds
(a staging chunk, one-off lists, the agent's pin) waits in :meth:`PullEnding.sweep`'s list until
NIXL finishes its reads.

**AbandonPull.** The pull tells the holder AbandonPull only when its READs are final: that is
the holder's proof that nothing reads its blocks any more. The proof is delivered: asked again
while the holder cannot be reached (a stopped or cut-off holder, a peer dropped meanwhile),
until it answers or ``peer_idle_s`` passed; a holder that timed the read out meanwhile then
lifts the taint it left on its memory (docs/lifetimes.md). Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvd.config import KvdConfig
from kvd.core.dataplane import DataPlane, Xfer
from kvd.core.local_memory import LocalMemory, Memories
from kvd.core.metrics import Metrics
from kvd.core.params import TransferParams
from kvd.core.peers import Peers, PeerSession, PeerTransport, RemoteAgent, unreachable
from kvd.core.registry import EngineRank
from kvd.core.staging import StagingChunk
from kvd.core.transfers import Transfer
from kvd_client.errors import KvdError

logger = logging.getLogger(__name__)

HOLDER_PIN_POLL_S = 0.01
# An AbandonPull the holder did not answer (unreachable) is asked again after this, then twice as
# long each time up to ABANDON_RETRY_MAX_S, for peer_idle_s at most (PullEnding.abandon).
ABANDON_RETRY_S = 0.5
ABANDON_RETRY_MAX_S = 30.0


@dataclasses.dataclass(eq=False)
class PullResources:
    """What one pull holds and must hand back, at the latest, when its reads are final."""

    memory: LocalMemory
    plane: DataPlane  # the worker the pull runs through: its lists and READs are that worker's
    agent: RemoteAgent | None = None
    session: PeerSession | None = None
    # Every READ the pull asked the data plane to post, from the moment it asked: a post runs on
    # the data plane's thread and completes even if the pull is cancelled while waiting for it,
    # so a READ the pull never saw returned is still one whose bytes may land (never "final").
    posts: list[asyncio.Future[Xfer]] = dataclasses.field(default_factory=list)
    staging: StagingChunk | None = None
    # One-off lists (staging), each from the moment its preparation was asked for (see ``posts``).
    one_off_tables: list[asyncio.Future[Any]] = dataclasses.field(default_factory=list)
    conversion: asyncio.Future[None] | None = None  # a conversion writing the engine's blocks
    # Its READs carry no notification: the holder hears of the read's end by FinishRead (pull_reads).
    quiet_reads: bool = False
    # A hard hold's quiet READs are DONE: a pull reported DONE sends FinishRead (Puller._finish);
    # one that fails after all sends AbandonPull instead.
    owes_finish_read: bool = False

    @property
    def xfers(self) -> list[Xfer]:
        """The READs posted so far (a post that failed before posting anything holds none)."""
        return [p.result() for p in self.posts if p.done() and not p.cancelled() and p.exception() is None]

    @property
    def reads_final(self) -> bool:
        return all(p.done() for p in self.posts) and all(x.final for x in self.xfers)

    async def reads_over(self) -> None:
        """Wait until every read is posted and final (a cancel of this wait leaves them running)."""
        await asyncio.gather(*(asyncio.shield(p) for p in self.posts), return_exceptions=True)
        await asyncio.gather(*(asyncio.shield(x.settled) for x in self.xfers))


class PullEnding:
    """The reader's end of each pull: fence its reads, hand back what it held, tell the holder."""

    def __init__(
        self,
        config: KvdConfig,
        metrics: Metrics,
        peers: Peers,
        transport: PeerTransport,
        memories: Memories,
        current_rank: Callable[[EngineRank], EngineRank | None],
        next_registration_id: Callable[[], int],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.peers = peers
        self._transport = transport
        self._memories = memories
        self._current_rank = current_rank
        self._next_registration_id = next_registration_id
        # Pull resources whose reads were given up before NIXL finished them: handed back by
        # sweep() once final (a staging chunk or a one-off list must not be reused before).
        self._stale: list[PullResources] = []
        # Messages to holders under way: AbandonPulls (waiting for their reads to be final) and
        # FinishReads, until answered.
        self._telling_holders: set[asyncio.Task[None]] = set()

    def close(self) -> None:
        """Shutting down: the holders end the admissions still abandoned here at their deadlines."""
        for task in list(self._telling_holders):
            task.cancel()

    async def fence(self, transfer: Transfer, rank: EngineRank, held: PullResources, fence_s: float) -> None:
        """Make sure no byte of the pull can still land in the engine's blocks (module docstring)."""
        remaining = max(0.0, transfer.started + transfer.deadline_s - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(fence_s, remaining), 0.001)):
                await held.reads_over()
        if held.reads_final:
            self.metrics.pull_fences.labels("final").inc()
            return
        outcome = await self._cut_off(rank, held.memory)
        if outcome:
            self.metrics.pull_fences.labels(outcome).inc()
            return
        logger.warning(
            "pull %s: %d NIXL reads into %s memory are not finished; the failure waits for them",
            transfer.transfer_id,
            sum(not x.final for x in held.xfers),
            held.memory.mem_type,
        )
        await held.reads_over()
        self.metrics.pull_fences.labels("final").inc()

    async def _cut_off(self, rank: EngineRank, memory: LocalMemory) -> str:
        """Retire ``memory`` so a late copy into it cannot reach the engine; "" if it cannot be.

        A rank still mapped through ``memory`` first gets a new mapping of its pages ("remapped");
        a rank already gone just loses the old one ("quarantined"). Either way the old addresses
        are retired only once no peer reads out of them (their reads would see zeros). One pull
        cuts a mapping off; others fencing on it wait for that one.
        """
        if memory.retired:
            return "remapped"
        if memory.cut_off is not None:
            await asyncio.shield(memory.cut_off)
            return "remapped" if memory.retired else ""
        if not memory.host:
            return ""
        current = self._current_rank(rank)
        mapped = current is not None and current.memory is memory
        if mapped and not self._memories.can_remap(memory):
            return ""
        memory.cut_off = asyncio.get_running_loop().create_future()
        try:
            if mapped:
                fresh = await self._memories.remap(memory, self._next_registration_id())
                if self._current_rank(rank) is rank and rank.memory is memory:
                    rank.memory = fresh
                    logger.warning(
                        "engine %s rank %d: re-mapped its memory (registration %d -> %d) to fence a read "
                        "NIXL did not finish",
                        rank.engine_id,
                        rank.tp_rank,
                        memory.registration_id,
                        fresh.registration_id,
                    )
                else:  # the rank unregistered while the new mapping was registered
                    await self._memories.fence(fresh)
                await self._memories.fence(memory)
            while memory.holder_pins:  # peers admitted to read out of the old mapping: let them finish
                await asyncio.sleep(HOLDER_PIN_POLL_S)
            await self._memories.retire(memory)
        finally:
            memory.cut_off.set_result(None)
        return "remapped" if mapped else "quarantined"

    async def hand_back(self, held: PullResources) -> None:
        final = held.reads_final
        await self._memories.unpin(held.memory, stale=held.xfers)
        if held.agent is not None and final:
            await self.peers.unpin(held.agent)
            held.agent = None
        if final:
            await self._release_buffers(held)
        else:
            self._stale.append(held)

    async def _release_buffers(self, held: PullResources) -> None:
        """Hand back the pull's staging chunk and one-off lists (its reads are final).

        The chunk goes back first and whatever the lists' release does: that call waits on the
        worker, which may hang and be declared lost meanwhile (the lists then die with it), and a
        chunk left out of its pool would stay counted in use for good."""
        if held.staging is not None:
            self.metrics.staging_bytes_in_use.dec(held.staging.size)
            held.staging.release()
            held.staging = None
        lists = await asyncio.gather(*(asyncio.shield(f) for f in held.one_off_tables), return_exceptions=True)
        held.one_off_tables.clear()
        try:
            # Through the worker that prepared them: after a restart, ids mean nothing to the new one.
            await held.plane.release_tables([t for t in lists if not isinstance(t, BaseException)])
        except KvdError as error:
            if held.plane.alive:
                raise
            logger.debug("one-off lists went with their lost worker: %s", error.message)

    async def sweep(self) -> None:
        """Hand back what stale pulls held once NIXL finished their reads."""
        for held in list(self._stale):
            if held.reads_final:
                self._stale.remove(held)
                if held.agent is not None:
                    await self.peers.unpin(held.agent)
                    held.agent = None
                await self._release_buffers(held)

    @property
    def stale_pulls(self) -> int:
        return len(self._stale)

    async def abandon_when_final(
        self,
        held: PullResources,
        remote: TransferParams,
        reader_rank: int,
        transfer_id: str,
        reason: str,
    ) -> None:
        """AbandonPull once the pull's reads are final, to the holder it read from."""
        if not held.reads_final:
            await held.reads_over()
        await self.abandon(remote, reader_rank, transfer_id, reason)

    def in_background(self, abandon: Coroutine[Any, Any, None]) -> None:
        """Run an AbandonPull or a FinishRead in the background, kept in ``_telling_holders`` until done."""
        task = asyncio.get_running_loop().create_task(abandon)
        self._telling_holders.add(task)
        task.add_done_callback(self._telling_holders.discard)

    @property
    def telling(self) -> tuple[asyncio.Task[None], ...]:
        """The AbandonPulls and FinishReads under way (an AbandonPull waits for its reads first)."""
        return tuple(self._telling_holders)

    async def abandon(self, remote: TransferParams, reader_rank: int, transfer_id: str, reason: str) -> None:
        """Tell the holder this read is over (nothing of it can still read its blocks).

        Asked again while the holder cannot be reached (stopped, cut off, its stream broken):
        an admission that timed out meanwhile keeps the holder's memory retired until this proof
        arrives. Any answer ends it (an unknown lease too: a restarted holder, or a read that
        ended otherwise); so do ``peer_idle_s`` without one, and shutdown (Puller.close)."""
        await self._tell_holder(
            "abandon",
            remote,
            lambda: self._transport.abandon_pull(
                remote.daemon_address,
                remote.lease_id,
                reader_rank,
                transfer_id,
                reason,
                self.config.handshake_timeout_s,
            ),
        )

    def finish_read_later(self, remote: TransferParams, reader_rank: int, transfer_id: str, nbytes: int) -> None:
        """FinishRead of a hard hold's quiet read (its READs are final and carried no
        notification: this is how the holder learns the read is over), in the background and
        delivered as an AbandonPull is: asked again while the holder cannot be reached."""
        self.in_background(
            self._tell_holder(
                "finish read",
                remote,
                lambda: self._transport.finish_read(
                    remote.daemon_address,
                    remote.lease_id,
                    reader_rank,
                    transfer_id,
                    self.config.handshake_timeout_s,
                    nbytes,
                ),
            )
        )

    async def _tell_holder(
        self, what: str, remote: TransferParams, call: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """``call`` until the holder answers (any answer), asked again while it is unreachable,
        backing off from ABANDON_RETRY_S to ABANDON_RETRY_MAX_S, for ``peer_idle_s`` at most."""
        give_up = time.monotonic() + self.config.peer_idle_s
        wait = ABANDON_RETRY_S
        while True:
            try:
                await call()
                return
            except KvdError as exc:
                if not unreachable(exc) or time.monotonic() + wait > give_up:
                    logger.debug("%s of lease %s at %s: %s", what, remote.lease_id, remote.daemon_address, exc.message)
                    return
            await asyncio.sleep(wait)
            wait = min(2 * wait, ABANDON_RETRY_MAX_S)
