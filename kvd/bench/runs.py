"""The bench's measurements against real daemons: each figure beside its baseline, in one run.

* **sizes**: pulls of 2 MiB .. 512 MiB interleaved with raw NIXL reads of the same bytes;
* **overhead**: 2 MiB pulls and raw reads interleaved, the per-pair difference (control path);
* **concurrency**: 2 MiB pulls with 1..64 in flight (pulls/s, GB/s, p50/p99) and the
  CPU per pull of every process (reader and holder from /proc, the client from this process);
* **batched**: an engine step's B pulls of 2 MiB at once, B StartPull calls against one
  StartPulls, step after step (pulls/s, p50/p99 from the step's start, CPU per pull per process),
  each step followed by the same B READs from the bare NIXL agent (kvd's rate as a ratio of raw's,
  and the control CPU per pull: kvd's every process less the raw READs' own);
* **router path**: 2 MiB pulls with 32 in flight started by a router over TCP and waited on
  the client's one ``WatchTransfers`` stream, beside the engine's path (the concurrency section's)
  and the path before it (a ``WatchTransfer`` stream per pull), in turns, in the same window shape;
* **first contact**: the first pull to a daemon never seen, against later pulls to it;
* **idle**: every daemon's CPU (% of a core) over a few seconds with no engine pulling.

Samples are interleaved (pull, raw, pull, raw, ...) so both see the same machine load; every
pull's bytes are checked against the pattern (sizes: each pull; concurrency: every block at
the end of each level, zeroed before it).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvd.bench.cpu import own_cpu_seconds
from kvd.bench.rig import (
    BLOCK_BYTES,
    Daemons,
    Engine,
    RawReader,
    hold_many,
    scratch_engine_id,
)
from kvd_client.aio import AsyncKvdClient
from kvd_client.errors import UnknownTransfer
from kvd_client.v1 import common_pb2

Progress = Callable[[str, float], None]


class BenchFailure(Exception):
    """A pull delivered wrong bytes or failed: the bench's figures would be meaningless."""


@dataclasses.dataclass
class Session:
    """What every measurement needs: the daemons, clients to both, the engine, the raw agent."""

    daemons: Daemons
    local: AsyncKvdClient
    peer: AsyncKvdClient
    engine: Engine
    raw: RawReader
    seed: int = dataclasses.field(default_factory=lambda: random.randrange(1, 1 << 30))
    _patterns: dict[int, Any] = dataclasses.field(default_factory=dict)
    _scratch_size: int = 0

    def pattern(self, size: int) -> Any:
        from kvd.core import scratch  # noqa: PLC0415

        if size not in self._patterns:
            self._patterns = {size: scratch.Pattern(size, self.seed)}  # one at a time: up to 512 MiB each
        return self._patterns[size]

    async def hold(self, size: int, count: int = 1) -> list[Any]:
        held = await hold_many(self.peer, size, self.seed, count)
        if size != self._scratch_size:  # the holder replaced its scratch: aim the raw agent at it
            self._scratch_size = size
            await asyncio.get_running_loop().run_in_executor(
                None, self.raw.target, self.daemons.peer.tcp, scratch_engine_id(held[0])
            )
        return held

    def verify(self, first_block: int, size: int) -> None:
        bad = self.pattern(size).mismatches(self.engine.blocks(first_block, size // BLOCK_BYTES))
        if bad:
            raise BenchFailure(f"a pull of {size} bytes delivered {bad} wrong bytes")


async def sizes(session: Session, sizes_mb: list[int], samples: int, progress: Progress) -> list[dict[str, Any]]:
    """kvd pull vs raw NIXL read of the same bytes, per size."""
    out = []
    for n, size_mb in enumerate(sizes_mb):
        size = size_mb << 20
        held = await session.hold(size, samples + 1)
        kvd, raw, transfer_ids = [], [], []
        for i, hold in enumerate(held):
            session.engine.zero_blocks(0, size // BLOCK_BYTES)
            elapsed = await session.engine.pull(hold.kv_transfer_params, 0)
            session.verify(0, size)
            raw_s = session.raw.read()
            if i:  # the first of each size warms up (tables of a new geometry, a new registration)
                kvd.append(elapsed)
                raw.append(raw_s)
                transfer_ids.append(session.engine.last_transfer_id)
            progress(f"sizes {size_mb} MiB", (n + (i + 1) / len(held)) / len(sizes_mb))
        out.append({"size_bytes": size, "kvd_s": kvd, "raw_s": raw, "phase_s": await _phases(session, transfer_ids)})
    return out


async def overhead(session: Session, samples: int, progress: Progress) -> dict[str, Any]:
    """2 MiB pulls and raw reads interleaved: pull - raw, pair by pair (the control path's cost);
    then up to PAUSED_PAIRS more, each pull after PAUSE_S with nothing moving (``paused``).

    Beside each pair's raw READ (one descriptor of 2 MiB, the goal's baseline), two more
    baselines that attribute the overhead: the same bytes read with a pull's descriptors
    (``raw_layout_s``: what the layout itself costs any reader), and, in the paused section, a
    raw READ after the same pause as the pull (``raw_after_pause_s``: what a pause costs the
    bytes themselves on this machine, no control path at all)."""
    pairs = await _pairs(session, samples, 0.0, 2, "control overhead", progress)
    paused = await _pairs(session, min(samples, PAUSED_PAIRS), PAUSE_S, 0, "control overhead after a pause", progress)
    return {
        "size_bytes": BLOCK_BYTES,
        "kvd_s": pairs.kvd,
        "raw_s": pairs.raw,
        "overhead_s": _less(pairs.kvd, pairs.raw),
        "raw_layout_s": pairs.raw_layout,
        "overhead_vs_layout_s": _less(pairs.kvd, pairs.raw_layout),
        "phase_s": await _phases(session, pairs.transfer_ids),
        # The same pulls started by a StartPull call (the path before pulls on the engine stream),
        # each right after a pair: against the pair's raw read.
        "start_pull": {
            "kvd_s": pairs.by_call,
            "overhead_s": _less(pairs.by_call, pairs.raw),
        },
        "paused": {
            "pause_s": PAUSE_S,
            "kvd_s": paused.kvd,
            "raw_s": paused.raw,
            "overhead_s": _less(paused.kvd, paused.raw),
            "raw_after_pause_s": paused.raw_after_pause,
            "overhead_vs_paused_raw_s": _less(paused.kvd, paused.raw_after_pause),
        },
    }


def _less(minuends: list[float], subtrahends: list[float]) -> list[float]:
    return [a - b for a, b in zip(minuends, subtrahends, strict=True)]


PAUSE_S = 0.05
"""The pause before each of the overhead section's paused pulls: an engine pulls once per request,
not back to back, and every process on the path runs its code cold after a pause."""
PAUSED_PAIRS = 30


@dataclasses.dataclass
class _Pairs:
    """What :func:`_pairs` measured, sample by sample (seconds)."""

    kvd: list[float] = dataclasses.field(default_factory=list)
    raw: list[float] = dataclasses.field(default_factory=list)
    raw_layout: list[float] = dataclasses.field(default_factory=list)  # back to back only
    raw_after_pause: list[float] = dataclasses.field(default_factory=list)  # paused only
    transfer_ids: list[str] = dataclasses.field(default_factory=list)
    by_call: list[float] = dataclasses.field(default_factory=list)  # back to back only


async def _pairs(session: Session, pairs: int, pause_s: float, warm_up: int, label: str, progress: Progress) -> _Pairs:
    """``pairs`` 2 MiB pulls, each followed by a raw read of the same bytes and each after
    ``pause_s`` (0: back to back), the first ``warm_up`` more not kept. Back to back, each pair
    is followed by a raw read with a pull's descriptors and by the same pull started by a
    StartPull call; paused, by a raw read after the same pause. Each pull's bytes land in block
    0; the last's are checked."""
    held = await session.hold(BLOCK_BYTES, (pairs + warm_up) * (1 if pause_s else 2))
    out = _Pairs()
    holds = iter(held)
    for i in range(pairs + warm_up):
        if pause_s:
            await asyncio.sleep(pause_s)
        elapsed = await session.engine.pull(next(holds).kv_transfer_params, 0)
        transfer_id = session.engine.last_transfer_id
        raw_s = session.raw.read()
        if pause_s:
            await asyncio.sleep(pause_s)
            extra = session.raw.read()
            called = 0.0
        else:
            extra = session.raw.read(layout=True)
            called = await session.engine.pull(next(holds).kv_transfer_params, 0, how="single")
        if i >= warm_up:
            out.kvd.append(elapsed)
            out.raw.append(raw_s)
            out.transfer_ids.append(transfer_id)
            if pause_s:
                out.raw_after_pause.append(extra)
            else:
                out.raw_layout.append(extra)
                out.by_call.append(called)
        progress(label, (i + 1) / (pairs + warm_up))
    session.verify(0, BLOCK_BYTES)
    return out


async def _phases(session: Session, transfer_ids: list[str]) -> list[dict[str, float]]:
    """Where each pull's time went, as the reader daemon saw it (``TransferStatus.phase_s``).

    A daemon keeps only its last finished transfers (kvd.core.transfers.KEEP_FINISHED): a run of
    more pulls than that (``--overhead-samples 6000``) reads the phases of those still kept (an
    empty entry for each of the others)."""
    phases: list[dict[str, float]] = []
    for transfer_id in transfer_ids:
        try:
            status = await session.local.get_transfer(transfer_id)
        except UnknownTransfer:
            phases.append({})  # one entry per pull, in order: the report pairs them with its times
            continue
        phases.append({**dict(status.phase_s), "done": status.elapsed_s})
    return phases


async def concurrency(
    session: Session, levels: list[int], pulls_per_level: int, progress: Progress
) -> list[dict[str, Any]]:
    """2 MiB pulls with ``level`` in flight: latencies, pulls/s, and the CPU seconds each process
    spent over the level's windows (``cpu_s``: reader, holder, client = this process, all = their
    sum); divided by the pulls, the CPU a pull costs. The leases are held a chunk at a time,
    between windows (:func:`_pulls_held_ahead`)."""
    engine = session.engine
    out = []
    for n, level in enumerate(levels):
        level = min(level, engine.capacity_blocks)
        count = max(pulls_per_level, 4 * level)
        engine.buffer.zero_()

        def tick(done: int, n: int = n, level: int = level, count: int = count) -> None:
            progress(f"concurrency {level}", (n + done / count) / len(levels))

        window = await _pulls_held_ahead(session, engine.pull, count, level, tick)
        for block in range(level):  # every block a pull landed in holds the pattern
            session.verify(block, BLOCK_BYTES)
        out.append(
            {
                "in_flight": level,
                "pulls": count,
                "wall_s": window.wall_s,
                "latency_s": window.latency_s,
                "cpu_s": window.cpu_s,
            }
        )
    return out


HOLD_AHEAD_PULLS = 4096
"""Leases held at once, ahead of the pulls (or steps) that use them, outside every timed window (a
few seconds' pulls here, far inside a lease's TTL): held all up front, a long run's later leases
would expire before their pull (NOT_FOUND at the holder)."""


async def _pulls_held_ahead(
    session: Session, pull: PullOne, count: int, level: int, tick: Callable[[int], None]
) -> _Window:
    """``count`` 2 MiB pulls with ``level`` in flight (:func:`_in_flight`), their leases held
    HOLD_AHEAD_PULLS at a time between timed windows: the windows' wall time, latencies and CPU
    seconds per process (as in :func:`concurrency`), summed. In flight drains between windows,
    once per HOLD_AHEAD_PULLS pulls."""
    window = _Window()
    done = 0
    while done < count:
        held = collections.deque(await session.hold(BLOCK_BYTES, min(HOLD_AHEAD_PULLS, count - done)))
        cpu0 = session.daemons.cpu()  # /proc read outside the client's window (it is the bench's CPU)
        client0 = own_cpu_seconds()
        t0 = time.perf_counter()

        def tick_all(k: int, before: int = done) -> None:
            tick(before + k)

        window.latency_s += await _in_flight(pull, held, level, tick_all)
        window.add(time.perf_counter() - t0, _cpu_since(session, cpu0, client0))
        done = len(window.latency_s)
    return window


async def batched(
    session: Session, batches: list[int], pulls_per_level: int, progress: Progress
) -> list[dict[str, Any]]:
    """Engine steps of ``batch`` 2 MiB pulls, all started at once and waited for together, step
    after step: first with one StartPull per pull (``single``), then with one StartPulls per step
    (``batched``), then with one message per step on the engine stream (``stream``, the engine
    patch's way), so the three differ only in how the pulls start. Latencies run from the step's start to
    each pull's FinishedRecving; ``cpu_s`` as in :func:`concurrency`, summed over the steps.

    Each kvd step is followed by a raw step (``raw``): the same ``batch`` READs of 2 MiB from the
    holder's registration, posted together from the bench's bare NIXL agent and waited for
    together, so the machine's noise hits both. A row's ``vs_raw`` is kvd's pulls/s over raw's,
    and ``control_cpu_s`` kvd's CPU per pull (every process) less the raw READ's (this process
    and the holder over the raw steps): what the control path costs beyond the bytes' own copy.
    Both rates count step time only (the /proc reads between steps are outside every window).

    Then a raw step with the pulls' own descriptors (``raw_layout``: each READ 64 of 32 KiB, one per
    plane, as the layout makes anyone read a block; ``vs_raw_layout``): the bytes' own bound for
    this layout, which the one-descriptor raw step is not."""
    engine = session.engine
    out = []
    modes = ("single", "batched", "stream")
    for n, batch in enumerate(batches):
        batch = min(batch, engine.capacity_blocks)
        steps = max(4, -(-pulls_per_level // batch))
        for m, mode in enumerate(modes):
            # Held ahead of the timed steps, at most HOLD_AHEAD_PULLS at a time: a long run's
            # later leases would otherwise expire before their step (NOT_FOUND at the holder).
            held: list[Any] = await _hold_ahead(session, batch, steps)
            engine.buffer.zero_()
            session.raw.read_step(batch)  # untimed: the raw agent's first step of this geometry
            session.raw.read_step(batch, layout=True)
            kvd = _Window()
            raw = _Window()
            laid = _Window()
            for step in range(steps):
                if step * batch >= len(held):  # outside every window
                    held += await _hold_ahead(session, batch, steps - step)
                cpu0, client0, t0 = session.daemons.cpu(), own_cpu_seconds(), time.perf_counter()
                kvd.latency_s += await engine.pull_step(held[step * batch : (step + 1) * batch], 0, mode)
                kvd.add(time.perf_counter() - t0, _cpu_since(session, cpu0, client0))
                _raw_step(session, raw, batch, layout=False)
                _raw_step(session, laid, batch, layout=True)
                progress(f"batched {batch} ({mode})", (n + (m + (step + 1) / steps) / len(modes)) / len(batches))
            for block in range(batch):
                session.verify(block, BLOCK_BYTES)
            pulls = steps * batch
            raw_row = {"pulls": pulls, **raw.as_row()}
            out.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "pulls": pulls,
                    **kvd.as_row(),
                    "raw": raw_row,
                    "vs_raw": (pulls / kvd.wall_s) / (pulls / raw.wall_s),
                    "raw_layout": {"pulls": pulls, **laid.as_row()},
                    "vs_raw_layout": (pulls / kvd.wall_s) / (pulls / laid.wall_s),
                    "control_cpu_s": (kvd.cpu_s["all"] - raw.cpu_s["all"]) / pulls,
                }
            )
    return out


async def _hold_ahead(session: Session, batch: int, steps_left: int) -> list[Any]:
    """The kv_transfer_params of the next steps' leases, at most HOLD_AHEAD_PULLS of them."""
    count = min(steps_left, max(1, HOLD_AHEAD_PULLS // batch)) * batch
    return [h.kv_transfer_params for h in await session.hold(BLOCK_BYTES, count)]


def _raw_step(session: Session, window: _Window, batch: int, layout: bool) -> None:
    """One raw step of ``batch`` READs (``RawReader.read_step``) added to ``window``: its wall
    time, latencies, and the CPU of this process and of the holder, whose registration it reads."""
    holder0, client0, t0 = session.daemons.holder_cpu(), own_cpu_seconds(), time.perf_counter()
    window.latency_s += session.raw.read_step(batch, layout=layout)
    wall, client = time.perf_counter() - t0, own_cpu_seconds() - client0
    holder = session.daemons.holder_cpu() - holder0
    window.add(wall, {"holder": holder, "client": client, "all": holder + client})


@dataclasses.dataclass
class _Window:
    """Steps' wall time, latencies and CPU seconds per process, summed step by step."""

    wall_s: float = 0.0
    latency_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, wall_s: float, cpu_s: dict[str, float]) -> None:
        self.wall_s += wall_s
        for name, seconds in cpu_s.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + seconds

    def as_row(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "latency_s": self.latency_s, "cpu_s": self.cpu_s}


PullOne = Callable[[common_pb2.KvTransferParams, int], Awaitable[float]]
"""One pull of held params into a block, timed from its start to its end as the caller learns it."""


async def _in_flight(
    pull: PullOne, held: collections.deque[Any], level: int, tick: Callable[[int], None]
) -> list[float]:
    """Pull every hold in ``held`` with ``level`` pulls in flight, each into a block of its own."""
    free = collections.deque(range(level))
    latencies: list[float] = []

    async def worker() -> None:
        while held:
            hold = held.popleft()
            block = free.popleft()
            latencies.append(await pull(hold.kv_transfer_params, block))
            free.append(block)
            if len(latencies) % 16 == 0:
                tick(len(latencies))

    await asyncio.gather(*(worker() for _ in range(level)))
    return latencies


ROUTER_MODES = ("engine", "one stream", "stream per pull")
"""The router section's paths: the engine's (started and finished on its engine stream, on the Unix
socket), a router's started and waited on the client's one WatchTransfers stream (``pull``), and
a router's StartPull with a WatchTransfer stream per pull (how a router waited before 0.2.0)."""


async def router_path(
    session: Session, router: AsyncKvdClient, in_flight: int, pulls: int, rounds: int, progress: Progress
) -> list[dict[str, Any]]:
    """2 MiB pulls with ``in_flight`` in flight, each of :data:`ROUTER_MODES` in turn (each round
    starting with the next), ``rounds`` times (so the three share the machine's load), into the
    same engine's blocks from the same holder, leases held a chunk at a time between windows (as
    in the concurrency section), after an untimed window of each: pulls/s, p50/p99 and the CPU per pull
    of every process, per mode and round.

    A router's pull rides its client's one ``WatchTransfers`` stream on the reader's TCP port
    (``router.pull``: the start and the end, one message each way); before it, a StartPull and a
    ``WatchTransfer`` stream per pull."""
    engine = session.engine
    in_flight = min(in_flight, engine.capacity_blocks)

    async def one_stream(params: common_pb2.KvTransferParams, block: int) -> float:
        t0 = time.perf_counter()
        await router.pull(
            engine_id=engine.engine_id, request_id=params.request_id, local_block_ids=[block], remote=params
        )
        return time.perf_counter() - t0

    async def stream_per_pull(params: common_pb2.KvTransferParams, block: int) -> float:
        t0 = time.perf_counter()
        started = await router.start_pull(
            engine_id=engine.engine_id, request_id=params.request_id, local_block_ids=[block], remote=params
        )
        async for status in router.watch_transfer(started.transfer_id):
            if status.state == common_pb2.TRANSFER_STATE_DONE:
                break
            if status.state in (common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_ABORTED):
                raise BenchFailure(f"a router's pull failed: {status.error_code}: {status.error_message}")
        return time.perf_counter() - t0

    paths: dict[str, PullOne] = {"engine": engine.pull, "one stream": one_stream, "stream per pull": stream_per_pull}
    # Untimed, a window of each path first: the first window of 32 in flight after the sections
    # before paid for more than its pulls (its workers' CPU per pull was 2-4x the later ones'),
    # and it fell on whichever path came first.
    for mode in ROUTER_MODES:
        await _in_flight(
            paths[mode], collections.deque(await session.hold(BLOCK_BYTES, 2 * in_flight)), in_flight, lambda _: None
        )
    out = []
    steps = rounds * len(ROUTER_MODES)
    for r in range(rounds):
        # Each round starts with the next path: over len(ROUTER_MODES) rounds each path takes each
        # place once (a window's cost depends on what ran before it, e.g. a pre-fault still running).
        order = ROUTER_MODES[r % len(ROUTER_MODES) :] + ROUTER_MODES[: r % len(ROUTER_MODES)]
        for m, mode in enumerate(order):
            engine.buffer.zero_()
            step = r * len(ROUTER_MODES) + m

            def tick(done: int, step: int = step, mode: str = mode) -> None:
                progress(f"router path ({mode})", (step + done / pulls) / steps)

            window = await _pulls_held_ahead(session, paths[mode], pulls, in_flight, tick)
            for block in range(in_flight):
                session.verify(block, BLOCK_BYTES)
            out.append(
                {
                    "mode": mode,
                    "round": r,
                    "in_flight": in_flight,
                    "pulls": pulls,
                    "wall_s": window.wall_s,
                    "latency_s": window.latency_s,
                    "cpu_s": window.cpu_s,
                }
            )
    return out


async def first_contact(session: Session, fresh: list[Any], later: int, progress: Progress) -> dict[str, Any]:
    """The first pull from each never-contacted holder against later pulls from it (2 MiB)."""
    firsts: list[float] = []
    laters: list[float] = []
    for n, daemon in enumerate(fresh):
        async with AsyncKvdClient(daemon.tcp, timeout_s=60) as client:
            held = await hold_many(client, BLOCK_BYTES, session.seed, later + 1)
            for i, hold in enumerate(held):
                elapsed = await session.engine.pull(hold.kv_transfer_params, 0)
                (firsts if i == 0 else laters).append(elapsed)
                progress("first contact", (n + (i + 1) / len(held)) / len(fresh))
        session.verify(0, BLOCK_BYTES)
    return {"first_s": firsts, "later_s": laters}


async def idle(session: Session, seconds: float, settle_s: float, progress: Progress) -> dict[str, Any]:
    """Every daemon's CPU while no engine pulls: the reader (its engine still registered, its
    stream open, as an idle vLLM leaves it), the holder and any fresh holder, sampled over
    ``seconds`` after ``settle_s`` without a pull; this process (the client) beside them.

    Each figure is CPU seconds over wall seconds, as % of one core: what a daemon costs a node
    that has nothing to move. The event loop here only sleeps meanwhile.
    """
    if settle_s > 0:
        await asyncio.sleep(settle_s)
    cpu0 = session.daemons.every_cpu()
    client0 = own_cpu_seconds()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while (left := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(min(0.25, left))
        progress("idle daemons", 1.0 - max(0.0, deadline - time.perf_counter()) / seconds)
    wall = time.perf_counter() - t0
    client1 = own_cpu_seconds()
    cpu1 = session.daemons.every_cpu()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return {
        "wall_s": wall,
        "settle_s": settle_s,
        "cpu_s": cpu,
        "client_cpu_s": client1 - client0,
        "core_percent": {k: 100.0 * v / wall for k, v in cpu.items()},
        "client_core_percent": 100.0 * (client1 - client0) / wall,
    }


def router_rates(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Pulls/s of each path of the router section, over all its rounds (pulls over wall time)."""
    rates: dict[str, float] = {}
    for mode in dict.fromkeys(row["mode"] for row in rows):
        mine = [row for row in rows if row["mode"] == mode]
        rates[mode] = sum(row["pulls"] for row in mine) / sum(row["wall_s"] for row in mine)
    return rates


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _cpu_since(session: Session, cpu0: dict[str, float], client0: float) -> dict[str, float]:
    """CPU seconds of each process since ``cpu0`` / ``client0`` was read, and ``all`` of them."""
    client = own_cpu_seconds() - client0  # before the /proc reads: they are the bench's, not the pulls'
    cpu1 = session.daemons.cpu()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    cpu["client"] = client
    cpu["all"] = sum(cpu.values())
    return cpu
