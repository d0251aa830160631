"""The fleet's router: prefill -> hold -> decode pulls -> (one in five) the next turn pulled back.

It talks to daemons with ``kvd_client.aio`` only (mTLS, the router's certificate), the way a
router in front of prefill and decode pools would; it drives engines over their control sockets
(what a real router does through the engines' HTTP APIs). For each documented failure
(docs/failure-rules.md) it does what the rules say: a retryable error (UNAVAILABLE,
RESOURCE_EXHAUSTED) is retried, on another engine where it makes sense; anything else ends the
pull: the router releases the lease it no longer needs and the reader recomputes.

It learns how every pull it started ended. A ``StartPull`` that got no answer (its deadline
passed, its connection dropped) may have started the pull all the same: the daemon then runs it
to DONE and counts it. So the router asks the same ``StartPull`` again until it is answered (the
daemon answers a repeated pull with the one it started, running or DONE: docs/failure-rules.md),
and then waits for that pull; it never recomputes blocks a pull it lost sight of may be writing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd_client import errors
from kvd_client.aio import AsyncKvdClient
from kvd_client.channel import TlsConfig
from kvd_client.v1 import common_pb2

logger = logging.getLogger("fleet.router")

# Every failure class the docs name for the calls a router makes (docs/failure-rules.md,
# docs/lifetimes.md "one reader per reader rank"). Anything else is an invariant violation.
DOCUMENTED = frozenset(
    {
        "Unavailable",
        "PeerUnavailable",
        "Aborted",
        "DeadlineExceeded",
        "LeaseExpired",
        "UnknownEngine",
        "UnknownLease",
        "UnknownTransfer",
        "HeldKvEvicted",
        "ResourceExhausted",
        "FailedPrecondition",
        "Cancelled",  # a call still running when a stopping daemon's servers stop (failure-rules.md, SIGTERM)
    }
)
RETRYABLE = frozenset({"Unavailable", "PeerUnavailable", "ResourceExhausted"})
# A StartPull failed with exactly one of these got no answer from the daemon (the call's deadline,
# a dropped connection, a daemon not serving yet, a call cut off by a stopping daemon's servers):
# the pull may have started, so it is asked again.
UNANSWERED = (errors.DeadlineExceeded, errors.Unavailable, errors.Cancelled)
LOST_AFTER_S = 60.0  # a pull (or an unanswered StartPull) not ended this long after its deadline is lost
UNANSWERED_RETRY_S = 0.5  # the wait before an unanswered StartPull or GetTransfer is asked again
# Failures of the harness's own engines (not kvd's): an engine the run killed, or one that is full.
ENGINE_SIDE = frozenset({"EngineDown", "EngineFull"})


@dataclasses.dataclass(frozen=True)
class EngineRef:
    """An engine as the router knows it: where it is, its role, its TP degree, its control socket."""

    engine_id: str
    node: int
    role: str  # prefill | decode
    tp: int
    control: Path


@dataclasses.dataclass
class Held:
    engine: EngineRef
    params: common_pb2.KvTransferParams
    sums: list[int]
    n: int


@dataclasses.dataclass
class Tally:
    """What the router saw: the run's report and the metrics cross-check are built from it."""

    pulls_started: int = 0
    pulls_done: int = 0
    pulls_failed: int = 0
    pulls_lost: int = 0
    wrong: int = 0
    stale_reads: int = 0  # a DONE pull whose bytes carry the holder's RELEASED marker
    done_after_lease_lost: int = 0
    bytes: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    failures: Counter[str] = dataclasses.field(default_factory=Counter)  # class -> count
    failure_ops: Counter[str] = dataclasses.field(default_factory=Counter)  # "op:class" -> count
    undocumented: list[str] = dataclasses.field(default_factory=list)
    engine_side: Counter[str] = dataclasses.field(default_factory=Counter)
    retries: int = 0
    recomputed: int = 0
    conversations: int = 0
    second_turns: int = 0
    turns_ok: int = 0
    renewals: int = 0
    releases: int = 0
    # Per reader daemon incarnation (node, epoch): DONE pulls and their bytes, for the metrics check.
    done_by_epoch: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)
    bytes_by_epoch: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)
    failed_by_epoch: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)
    ambiguous_epochs: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    ok_times_by_node: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # monotonic
    # Verified moves through a node: (when its successful pulls started, when they ended), monotonic.
    ok_pulls_by_node: dict[int, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    # Started pulls whose final outcome the router never saw, their reader daemon having been
    # restarted meanwhile, per reader daemon incarnation (node, epoch).
    unseen_by_epoch: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)
    unseen: list[str] = dataclasses.field(default_factory=list)  # "<transfer id> n<node>.<epoch> <why>"
    probes: int = 0
    in_flight: int = 0


class EngineDown(Exception):
    """The engine's control socket did not answer (the run killed or is restarting it)."""


async def engine_call(engine: EngineRef, op: str, timeout_s: float = 10.0, **fields: Any) -> dict[str, Any]:
    """One control call; an engine-side kvd error comes back as that class."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(engine.control)), timeout_s)
    except (TimeoutError, OSError) as err:
        raise EngineDown(f"{engine.engine_id}: {err}") from err
    try:
        writer.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (TimeoutError, OSError) as err:
        raise EngineDown(f"{engine.engine_id}: {op}: {err!r}") from err
    finally:
        writer.close()
    if not line:
        raise EngineDown(f"{engine.engine_id}: {op}: connection closed")
    answer: dict[str, Any] = json.loads(line)
    if not answer.get("ok"):
        cls = errors.error_class_named(str(answer.get("error_class"))) or errors.KvdError
        if answer.get("error_class") == "ResourceExhausted":
            raise EngineFull(answer.get("message", ""))
        raise cls(str(answer.get("message", "")))
    return answer


class EngineFull(Exception):
    """The engine has no free blocks for the request."""


class Router:
    """Conversations over the fleet until ``stop`` is set."""

    def __init__(
        self,
        engines: list[EngineRef],
        addresses: list[str],
        tls: TlsConfig,
        epoch_of: Callable[[int], int],
        rng: random.Random,
        lease_ttl_s: float,
        deadline_s: float,
    ) -> None:
        self.engines = engines
        self.addresses = addresses
        self.node_of_address = {a: i for i, a in enumerate(addresses)}
        self.clients: list[AsyncKvdClient] = []
        self.tls = tls
        self.epoch_of = epoch_of
        self.rng = rng
        self.lease_ttl_s = lease_ttl_s
        self.deadline_s = deadline_s
        self.tally = Tally()
        self._next = 0
        self.t0 = time.monotonic()  # undocumented failures say when, from here

    async def open(self) -> None:
        self.clients = [AsyncKvdClient(a, tls=self.tls, timeout_s=3.0) for a in self.addresses]

    async def close(self) -> None:
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()

    # -- bookkeeping -------------------------------------------------------------------------

    def _fail(self, op: str, err: BaseException) -> str:
        name = type(err).__name__
        if isinstance(err, (EngineDown, EngineFull)):
            self.tally.engine_side[name] += 1
            return name
        self.tally.failures[name] += 1
        self.tally.failure_ops[f"{op}:{name}"] += 1
        if name not in DOCUMENTED:
            self.tally.undocumented.append(f"{op}: {name} @{time.monotonic() - self.t0:.1f}s: {str(err)[:200]}")
        return name

    def _pick(self, role: str, avoid: frozenset[str] | set[str] = frozenset(), not_node: int = -1) -> EngineRef:
        """A random engine of ``role``, off node ``not_node`` (kvd pulls between daemons: an engine
        on the holder's own node is not a reader a router sends through kvd)."""
        others = [e for e in self.engines if e.node != not_node]
        pool = [e for e in others if e.role == role and e.engine_id not in avoid]
        if not pool:
            pool = [e for e in others if e.role == role] or others
        return self.rng.choice(pool)

    # -- the flow ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, concurrency: int) -> None:
        async def worker() -> None:
            while not stop.is_set():
                cid = self._next
                self._next += 1
                try:
                    await self.conversation(cid)
                except Exception as err:  # a harness bug: report it, keep the fleet going
                    logger.exception("conversation %d", cid)
                    self.tally.undocumented.append(f"router bug: {err!r}")
                    await asyncio.sleep(0.5)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def conversation(self, cid: int) -> None:
        self.tally.conversations += 1
        rng = self.rng
        tokens = [rng.randrange(32000) for _ in range(rng.randint(24, 160))]
        req = f"c{cid}t1"
        held = await self.prefill(req, tokens)
        if held is None:
            return
        decode = self._pick("decode", not_node=held.engine.node)
        ok = await self.move(req, held, decode, tokens)
        if ok is None:
            return
        generated = [rng.randrange(32000) for _ in range(rng.randint(4, 40))]
        full = tokens + generated
        with contextlib.suppress(EngineDown, errors.KvdError, EngineFull):
            await engine_call(decode, "write", req=req, tokens=full, start=len(tokens))
            if rng.random() < 0.2:
                self.tally.second_turns += 1
                await self.second_turn(cid, req, decode, full)
        with contextlib.suppress(EngineDown, errors.KvdError, EngineFull):
            await engine_call(decode, "free", req=req)

    async def prefill(self, req: str, tokens: list[int]) -> Held | None:
        """Prefill and hold on a prefill engine; another one on a retryable or engine-side error."""
        tried: set[str] = set()
        for _ in range(3):
            engine = self._pick("prefill", tried)
            tried.add(engine.engine_id)
            try:
                answer = await engine_call(
                    engine, "prefill", req=req, tokens=tokens, ttl_ms=int(self.lease_ttl_s * 1000)
                )
            except (EngineDown, EngineFull, errors.KvdError) as err:
                self._fail("hold", err)
                self.tally.retries += 1
                await asyncio.sleep(0.1)
                continue
            params = common_pb2.KvTransferParams.FromString(base64.b64decode(answer["params"]))
            return Held(engine, params, list(answer["sums"]), len(tokens))
        return None

    async def second_turn(self, cid: int, req: str, decode: EngineRef, full: list[int]) -> None:
        """Decode holds the conversation; a prefill engine pulls it back for the next turn."""
        try:
            answer = await engine_call(decode, "hold", req=req, n=len(full), ttl_ms=int(self.lease_ttl_s * 1000))
        except (EngineDown, EngineFull, errors.KvdError) as err:
            self._fail("hold", err)
            return
        params = common_pb2.KvTransferParams.FromString(base64.b64decode(answer["params"]))
        held = Held(decode, params, list(answer["sums"]), len(full))
        prefill = self._pick("prefill", not_node=decode.node)
        req2 = f"c{cid}t2"
        if await self.move(req2, held, prefill, full) is not None:
            with contextlib.suppress(EngineDown, errors.KvdError, EngineFull):
                await engine_call(prefill, "free", req=req2)

    async def move(self, req: str, held: Held, reader: EngineRef, tokens: list[int], queue: bool = True) -> bool | None:
        """Pull ``held`` into ``reader`` (every reader rank), verify it, or recompute.

        Returns True (pulled, verified), False (recomputed) or None (the reader is gone).
        ``queue``: one move in ten first waits in a queue (a probe does not)."""
        lease_lost = asyncio.Event()
        renew = asyncio.create_task(self._renew(held.params, lease_lost))
        self.tally.in_flight += 1
        try:
            if queue and self.rng.random() < 0.1:  # queued behind other work: the lease is kept alive meanwhile
                await asyncio.sleep(self.rng.uniform(0.0, 1.5 * self.lease_ttl_s))
            try:
                alloc = await engine_call(reader, "alloc", req=req, n=held.n)
            except (EngineDown, EngineFull, errors.KvdError) as err:
                self._fail("alloc", err)
                await self._release(held.params)
                return None
            blocks = list(alloc["blocks"])
            renew.cancel()  # pulling now: the holder's admission keeps the blocks from here on
            left = set(range(reader.tp))
            started = time.monotonic()
            for attempt in range(3):
                started = time.monotonic()
                outcomes = await asyncio.gather(*(self._pull(req, held, reader, r, blocks) for r in sorted(left)))
                retry = True
                for rank, failure in outcomes:
                    if failure is None:
                        left.discard(rank)
                    elif failure not in RETRYABLE or lease_lost.is_set():
                        retry = False
                if not left or not retry or attempt == 2:
                    break
                self.tally.retries += 1
                await asyncio.sleep(0.2)
            if not left:
                if lease_lost.is_set():
                    self.tally.done_after_lease_lost += 1
                return await self._verify(req, held, reader, (started, time.monotonic()))
            # Failed for good: tell the holder nobody will read, and recompute.
            renew.cancel()
            await self._release(held.params)
            try:
                await engine_call(reader, "write", req=req, tokens=tokens, start=0)
            except (EngineDown, EngineFull, errors.KvdError) as err:
                self._fail("recompute", err)
                return None
            self.tally.recomputed += 1
            return False
        finally:
            self.tally.in_flight -= 1
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew

    async def _verify(self, req: str, held: Held, reader: EngineRef, pulled: tuple[float, float]) -> bool | None:
        """Check the reader's bytes; a verified move records ``pulled`` (its last attempt's start
        and end) for both nodes: the recovery times are read from them."""
        try:
            got = await engine_call(reader, "sums", req=req, n=held.n)
        except (EngineDown, errors.KvdError) as err:
            self._fail("verify", err)
            return None
        if list(got["sums"]) != held.sums:
            self.tally.wrong += 1
            if got.get("released"):
                self.tally.stale_reads += 1
            bad = [i for i, (a, b) in enumerate(zip(got["sums"], held.sums, strict=False)) if a != b]
            self.tally.undocumented.append(
                f"WRONG BYTES: {req} {held.engine.engine_id}->{reader.engine_id}: chunks {bad[:10]} differ "
                f"(released markers {got.get('released')}, unwritten {got.get('unwritten')})"
            )
            return False
        self.tally.turns_ok += 1
        now = time.monotonic()
        for node in (reader.node, held.engine.node):
            self.tally.ok_times_by_node.setdefault(node, []).append(now)
            self.tally.ok_pulls_by_node.setdefault(node, []).append(pulled)
        return True

    async def probe(self, holder: EngineRef, reader: EngineRef, n_tokens: int = 64) -> bool | None:
        """One move of a fresh prompt of ``n_tokens`` held on ``holder`` into ``reader``, not
        queued: True when it was pulled and verified. A fault measures a node's recovery with
        these; the soak's traffic is made of them."""
        self.tally.probes += 1
        req = f"probe{self.tally.probes}"
        tokens = [self.rng.randrange(32000) for _ in range(n_tokens)]
        try:
            answer = await engine_call(
                holder, "prefill", req=req, tokens=tokens, ttl_ms=int(self.lease_ttl_s * 1000), timeout_s=5.0
            )
        except (EngineDown, EngineFull, errors.KvdError) as err:
            self._fail("hold", err)
            return None
        params = common_pb2.KvTransferParams.FromString(base64.b64decode(answer["params"]))
        ok = await self.move(req, Held(holder, params, list(answer["sums"]), len(tokens)), reader, tokens, queue=False)
        with contextlib.suppress(EngineDown, errors.KvdError, EngineFull):
            await engine_call(reader, "free", req=req)
        return ok

    async def _pull(
        self, req: str, held: Held, reader: EngineRef, rank: int, blocks: list[int]
    ) -> tuple[int, str | None]:
        """One reader rank's pull: (rank, None) when DONE, else (rank, failure class)."""
        client = self.clients[reader.node]
        epoch = self.epoch_of(reader.node)
        t0 = time.monotonic()
        transfer_id, failure = await self._start(
            client,
            reader.node,
            epoch,
            engine_id=reader.engine_id,
            tp_rank=rank,
            request_id=req,
            local_block_ids=blocks,
            remote=held.params,
            deadline_ms=int(self.deadline_s * 1000),
        )
        if transfer_id is None:
            return rank, failure
        self.tally.pulls_started += 1
        status, failure = await self._outcome(client, transfer_id, reader.node, epoch)
        key = (reader.node, epoch)
        if self.epoch_of(reader.node) != epoch:
            self.tally.ambiguous_epochs.add(key)
        if status is None and failure is None:
            self.tally.pulls_lost += 1
            self.tally.undocumented.append(f"LOST: transfer {transfer_id} ({req} rank {rank}) never ended")
            return rank, "Lost"
        if failure is not None:
            self.tally.pulls_failed += 1
            if status is not None:
                self.tally.failed_by_epoch[key] += 1
            return rank, failure
        assert status is not None
        self.tally.pulls_done += 1
        self.tally.bytes += status.bytes
        self.tally.done_by_epoch[key] += 1
        self.tally.bytes_by_epoch[key] += status.bytes
        self.tally.latencies.append(time.monotonic() - t0)
        return rank, None

    async def _start(self, client: AsyncKvdClient, node: int, epoch: int, **pull: Any) -> tuple[str | None, str | None]:
        """StartPull: (its transfer id, None), or (None, the failure class) when the daemon
        refused it, restarted before answering (the pull, if it started, went with it), or never
        answered in time (``"Lost"``: counted lost, like a pull that never ends).

        An unanswered StartPull is asked again, the same, while the daemon lives: it may have
        started the pull (module docstring). Each unanswered try counts under ``start_pull``."""
        limit = time.monotonic() + self.deadline_s + LOST_AFTER_S
        while True:
            try:
                started = await client.start_pull(**pull)
            except errors.KvdError as err:
                failure = self._fail("start_pull", err)
                if type(err) not in UNANSWERED:
                    return None, failure  # refused: nothing started
            else:
                return started.transfer_id, None
            if self.epoch_of(node) != epoch:  # the pull, if it started, went with that daemon: retry
                return None, "Unavailable"
            if time.monotonic() > limit:
                self.tally.pulls_lost += 1
                self.tally.undocumented.append(
                    f"LOST: StartPull of {pull.get('request_id')} rank {pull.get('tp_rank')} into n{node} "
                    f"never answered ({failure})"
                )
                return None, "Lost"
            await asyncio.sleep(UNANSWERED_RETRY_S)

    async def _outcome(
        self, client: AsyncKvdClient, transfer_id: str, node: int, epoch: int
    ) -> tuple[common_pb2.TransferStatus | None, str | None]:
        """How a started pull ended: (DONE status, None), (status or None, failure class), or
        (None, None) when it never ended (lost)."""
        limit = time.monotonic() + self.deadline_s + LOST_AFTER_S
        try:
            return await client.wait_transfer(transfer_id, timeout_s=self.deadline_s + 5.0), None
        except errors.KvdError:
            pass  # the pull failed, or the watch did: ask for the final state
        while time.monotonic() < limit:
            if self.epoch_of(node) != epoch:
                self.tally.unseen_by_epoch[(node, epoch)] += 1
                self.tally.unseen.append(f"{transfer_id} n{node}.{epoch} its daemon was replaced")
                return None, self._fail("pull", errors.Unavailable("the reader's daemon restarted mid-pull"))
            try:
                status = await client.get_transfer(transfer_id, timeout_s=2.0)
            except errors.UnknownTransfer as err:
                self.tally.unseen_by_epoch[(node, epoch)] += 1  # its daemon forgot it (or was replaced)
                self.tally.unseen.append(f"{transfer_id} n{node}.{epoch} UnknownTransfer: {str(err)[:120]}")
                return None, self._fail("pull", err)
            except errors.KvdError:
                await asyncio.sleep(UNANSWERED_RETRY_S)  # its daemon is stopped or cut off: ask again
                continue
            if status.state == common_pb2.TRANSFER_STATE_DONE:
                return status, None
            if status.state in (common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_ABORTED):
                cls = errors.error_class_named(status.error_class) or errors.KvdError
                return status, self._fail("pull", cls(status.error_message))
            await asyncio.sleep(0.2)
        return None, None

    async def _renew(self, params: common_pb2.KvTransferParams, lost: asyncio.Event) -> None:
        """Renew the lease while the pull waits, as a router keeps a queued request's lease alive."""
        node = self.node_of_address.get(params.daemon_address)
        if node is None:
            return
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                await self.clients[node].renew_lease(
                    params.lease_id, ttl_ms=int(self.lease_ttl_s * 1000), timeout_s=1.0
                )
                self.tally.renewals += 1
            except (errors.UnknownLease, errors.LeaseExpired) as err:
                self._fail("renew", err)
                lost.set()
                return
            except errors.KvdError as err:
                self._fail("renew", err)

    async def _release(self, params: common_pb2.KvTransferParams) -> None:
        node = self.node_of_address.get(params.daemon_address)
        if node is None:
            return
        try:
            await self.clients[node].release_lease(params.lease_id, timeout_s=2.0)
            self.tally.releases += 1
        except errors.UnknownLease:
            pass  # already over (read, expired, engine gone)
        except errors.KvdError as err:
            self._fail("release", err)  # unreachable holder: the lease expires a TTL later
