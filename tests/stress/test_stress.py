"""Stress: real daemons, real NIXL, pulls in flight while engines come and go.

Three ``kvd serve`` processes; on each a holder engine and a reader engine, each its own
process (so it can be SIGKILLed). Eight workers keep pulls in flight from one daemon's holder
into another daemon's reader, while a chaos thread kills engines and brings them back under the
same id (holders with another TP size too), registers new engines on holders (readers then
re-handshake), races two readers for one lease, releases leases and lets short ones expire
mid-read. Holders overwrite their blocks the moment ``finished_sending`` arrives, as a real
engine reusing them would. Every DONE pull is verified against the bytes that were held.

Asserted: no daemon exits; no DONE with wrong bytes; no INTERNAL/UNKNOWN; every pull ends within
its deadline (plus the admission margin a re-map may wait for); afterwards no lease, read, pull
or staging byte is left and fds and threads did not grow.

Seeded (``KVD_STRESS_SEED``) and bounded: ``KVD_STRESS_S`` seconds of churn per transport
(default 30; run it for 600 to soak).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_proc import engine_spec
from kvtest import metric_value, scrape

from kvd.layout import oracle
from kvd.layout.plan import EngineView
from kvd.layout.spec import contiguous_placements
from kvd.spawn import DaemonProcess, child_env
from kvd_client import KvdClient, errors
from kvd_client.shm import unlink_shm
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]

STRESS_S = float(os.environ.get("KVD_STRESS_S", "20"))
SEED = int(os.environ.get("KVD_STRESS_SEED", "20261123"))
NUM_BLOCKS = 64
WORKERS = 8
DEADLINE_S = 8.0
MARGIN_S = 2.0
ENGINE_PROC = Path(__file__).with_name("engine_proc.py")
# Each engine process keeps a connection (an fd) to its daemon: the extra engines the chaos adds
# are capped, so a long run's fd check measures the daemon, not how many engines are connected.
MAX_EXTRA_ENGINES = 3


@dataclasses.dataclass(eq=False)
class Engine:
    """One engine process (all its ranks), the test's view of its memory, and its free blocks."""

    daemon: DaemonProcess
    engine_id: str
    tp_size: int
    process: subprocess.Popen[bytes]
    prefix: str
    buffers: list[torch.Tensor]
    free: set[int]
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    leases: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # lease id -> held blocks
    alive: bool = True

    @property
    def views(self) -> list[EngineView]:
        specs = [engine_spec(NUM_BLOCKS, r, self.tp_size) for r in range(self.tp_size)]
        return [EngineView(spec, tuple(contiguous_placements(spec))) for spec in specs]

    def take(self, n: int) -> list[int] | None:
        with self.lock:
            if len(self.free) < n or not self.alive:
                return None
            blocks = sorted(random.sample(sorted(self.free), n))
            self.free.difference_update(blocks)
            return blocks

    def give(self, blocks: list[int]) -> None:
        with self.lock:
            self.free.update(blocks)

    def logical(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """The held tokens as model-global heads (TP ranks concatenated along the head axis)."""
        parts = [
            oracle.gather([buf], view, blocks, num_tokens) for buf, view in zip(self.buffers, self.views, strict=True)
        ]
        return torch.cat(parts, dim=3)

    def scribble(self, blocks: list[int], rng: random.Random) -> None:
        """Write fresh random bytes into the blocks of every rank (before a hold, after its end)."""
        for buf, view in zip(self.buffers, self.views, strict=True):
            stride = view.spec.block_stride
            for placement in view.placements:
                for plane in view.spec.plane_offsets(placement):
                    for b in blocks:
                        start = plane + b * stride
                        buf[start : start + stride] = torch.randint(
                            0,
                            256,
                            (stride,),
                            dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(rng.getrandbits(31)),
                        )


class World:
    """The daemons and their current engines; the chaos thread swaps engines under a lock."""

    def __init__(self, daemons: list[DaemonProcess], rng: random.Random) -> None:
        self.daemons = daemons
        self.rng = rng
        self.lock = threading.Lock()
        self.holders: dict[int, Engine] = {}
        self.readers: dict[int, Engine] = {}
        self.clients = {i: KvdClient(d.unix_target, timeout_s=30) for i, d in enumerate(daemons)}
        self.prefixes: list[str] = []
        self.extras: list[Engine] = []

    def start_engine(self, i: int, engine_id: str, tp_size: int) -> Engine:
        daemon = self.daemons[i]
        prefix = f"kvdstress-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.prefixes.append(prefix)
        deadline = time.monotonic() + 20
        while True:  # the daemon may not have noticed the previous holder of the id died yet
            process = subprocess.Popen(
                [
                    sys.executable,
                    str(ENGINE_PROC),
                    daemon.unix_target,
                    engine_id,
                    str(tp_size),
                    str(NUM_BLOCKS),
                    prefix,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            line = process.stdout.readline() if process.stdout else b""
            if line.strip() == b"ready":
                break
            process.wait()
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {engine_id} never registered: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.3)
        buffers = []
        for rank in range(tp_size):
            spec = engine_spec(NUM_BLOCKS, rank, tp_size)
            storage = torch.UntypedStorage.from_file(f"/dev/shm/{prefix}-{rank}", shared=True, nbytes=spec.total_bytes)
            buffers.append(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (spec.total_bytes,), (1,)))
        return Engine(daemon, engine_id, tp_size, process, prefix, buffers, set(range(NUM_BLOCKS)))

    def kill(self, engine: Engine) -> None:
        with engine.lock:
            engine.alive = False
        engine.process.send_signal(signal.SIGKILL)
        engine.process.wait()

    def stop_all(self) -> None:
        for engine in [*self.holders.values(), *self.readers.values(), *self.extras]:
            if engine.process.poll() is None:
                engine.process.send_signal(signal.SIGTERM)
                engine.process.wait(20)
        for client in self.clients.values():
            client.close()
        for prefix in self.prefixes:
            for rank in range(2):
                unlink_shm(f"{prefix}-{rank}")


@dataclasses.dataclass
class Tally:
    started: int = 0
    done_verified: int = 0
    wrong_bytes: int = 0
    refused: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    failed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    late: list[float] = dataclasses.field(default_factory=list)
    violations: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, field: str, key: str = "") -> None:
        with self.lock:
            if key:
                getattr(self, field)[key] += 1
            else:
                setattr(self, field, getattr(self, field) + 1)


def _holder_stream(world: World, engine: Engine, stop: threading.Event) -> None:
    """Overwrite a lease's blocks the moment its finished_sending arrives (a reusing engine)."""
    client = world.clients[world.daemons.index(engine.daemon)]
    rng = random.Random(world.rng.getrandbits(31))
    try:
        stream = client.open_engine_stream(engine.engine_id, 0)
    except errors.KvdError:
        return
    try:
        while not stop.is_set() and engine.alive and not stream.closed:
            for message in stream.poll(timeout_s=0.05):
                if message.WhichOneof("kind") != "finished_sending":
                    continue
                with engine.lock:
                    blocks = engine.leases.pop(message.finished_sending.lease_id, None)
                if blocks is not None:
                    engine.scribble(blocks, rng)
                    engine.give(blocks)
    finally:
        stream.close()


def _one_pull(world: World, tally: Tally, rng: random.Random) -> None:
    n = len(world.daemons)
    i = rng.randrange(n)
    j = (i + rng.randrange(1, n)) % n
    with world.lock:
        holder, reader = world.holders[i], world.readers[j]
        racer = world.readers[(j + 1) % n] if (j + 1) % n != i else None
    nblocks = rng.randint(1, 6)
    held = holder.take(nblocks)
    if held is None:
        time.sleep(0.01)
        return
    num_tokens = (nblocks - 1) * 16 + rng.randint(1, 16)
    holder.scribble(held, rng)
    expected = holder.logical(held, num_tokens).clone()
    ttl_ms = 300 if rng.random() < 0.1 else 4000
    try:
        with holder.lock:
            response = world.clients[i].hold_blocks(
                engine_id=holder.engine_id,
                request_id=uuid.uuid4().hex[:8],
                block_ids=held,
                num_tokens=num_tokens,
                ttl_ms=ttl_ms,
            )
            holder.leases[response.lease.lease_id] = held
    except errors.KvdError as exc:
        holder.give(held)
        tally.add("refused", type(exc).__name__)
        return
    params = response.kv_transfer_params
    started: list[tuple[Engine, int, list[int], str]] = []
    for target in [reader] + ([racer] if racer is not None and rng.random() < 0.15 else []):
        local = target.take(nblocks)
        if local is None:
            continue
        k = world.daemons.index(target.daemon)
        try:
            transfer = world.clients[k].start_pull(
                engine_id=target.engine_id,
                tp_rank=0,
                request_id="stress",
                local_block_ids=local,
                remote=params,
                deadline_ms=int(DEADLINE_S * 1000),
            )
        except errors.KvdError as exc:
            target.give(local)
            tally.add("refused", type(exc).__name__)
            continue
        tally.add("started")
        started.append((target, k, local, transfer.transfer_id))
    if started and rng.random() < 0.08:  # released while it is being read
        with contextlib.suppress(errors.KvdError):
            world.clients[i].release_lease(lease_id=params.lease_id)
    for target, k, local, transfer_id in started:
        t0 = time.monotonic()
        try:
            status = world.clients[k].wait_transfer(transfer_id, timeout_s=DEADLINE_S + 30)
            ok, error_name = status.state == common_pb2.TRANSFER_STATE_DONE, ""
        except errors.KvdError as exc:
            ok, error_name = False, type(exc).__name__
        if time.monotonic() - t0 > DEADLINE_S + MARGIN_S + 6.0:
            tally.late.append(time.monotonic() - t0)
        if ok:
            if target.logical(local, num_tokens).equal(expected):
                tally.add("done_verified")
            else:
                tally.add("wrong_bytes")
                tally.violations.append(f"DONE with wrong bytes: {holder.engine_id}@{i} -> {target.engine_id}@{k}")
        else:
            tally.add("failed", error_name)
            if error_name in ("Internal", "KvdError", "Unknown"):
                tally.violations.append(f"pull failed with {error_name}")
        target.give(local)


def _chaos(world: World, stop: threading.Event, spawn_stream: Callable[[Engine], None]) -> None:
    rng = random.Random(world.rng.getrandbits(31))
    extra = 0
    while not stop.wait(rng.uniform(0.8, 1.6)):
        action = rng.choice(["kill_holder", "kill_reader", "new_engine", "kill_holder", "kill_reader"])
        i = rng.randrange(len(world.daemons))
        if action == "kill_holder":
            old = world.holders[i]
            world.kill(old)
            fresh = world.start_engine(i, old.engine_id, rng.choice([1, 2]))
            with world.lock:
                world.holders[i] = fresh
            spawn_stream(fresh)
        elif action == "kill_reader":
            old = world.readers[i]
            world.kill(old)
            fresh = world.start_engine(i, old.engine_id, 1)
            with world.lock:
                world.readers[i] = fresh
        else:  # a new engine on a holder (readers re-handshake); the oldest extra one leaves
            extra += 1
            world.extras.append(world.start_engine(i, f"x{extra}", 1))
            if len(world.extras) > MAX_EXTRA_ENGINES:
                leaving = world.extras.pop(0)
                leaving.process.send_signal(signal.SIGTERM)  # it unregisters, then exits
                leaving.process.wait(20)


def _fds_and_threads(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    return fds, threads


def _fd_targets(pid: int) -> collections.Counter[str]:
    """What the process's fds point at, by kind (socket, anon_inode:..., a path)."""
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":[", 1)[0] if ":[" in target else target] += 1
    return kinds


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.timeout(STRESS_S + 240)  # set-up, the churn itself, then draining and checks
@pytest.mark.parametrize("transport", ["tcp", "default"])
def test_pulls_stay_correct_while_engines_and_leases_churn(spawn_daemon, transport: str) -> None:
    env = child_env(UCX_TLS="tcp") if transport == "tcp" else None
    flags = ("--transfer-deadline-s", str(DEADLINE_S), "--read-admission-margin-s", str(MARGIN_S), "--lease-ttl-s", "4")
    daemons = [spawn_daemon(*flags, name=f"n{i}", env=env) for i in range(3)]
    world = World(daemons, random.Random(SEED))
    stop = threading.Event()
    streams: list[threading.Thread] = []

    def spawn_stream(engine: Engine) -> None:
        thread = threading.Thread(target=_holder_stream, args=(world, engine, stop), daemon=True)
        thread.start()
        streams.append(thread)

    try:
        for i in range(len(daemons)):
            world.holders[i] = world.start_engine(i, f"h{i}", 1)
            world.readers[i] = world.start_engine(i, f"r{i}", 1)
            spawn_stream(world.holders[i])
        tally = Tally()
        warm = random.Random(SEED + 1)
        for _ in range(12):  # every pair handshaken before the baseline is taken
            _one_pull(world, tally, warm)
        baseline = {d.name: _fds_and_threads(d.process.pid) for d in daemons}
        fd_kinds0 = {d.name: _fd_targets(d.process.pid) for d in daemons}
        rss0 = {d.name: _rss_mib(d.process.pid) for d in daemons}

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                _one_pull(world, tally, rng)

        workers = [threading.Thread(target=worker, args=(SEED + 10 + w,), daemon=True) for w in range(WORKERS)]
        chaos = threading.Thread(target=_chaos, args=(world, stop, spawn_stream), daemon=True)
        for thread in [*workers, chaos]:
            thread.start()
        time.sleep(STRESS_S)
        stop.set()
        for thread in [*workers, chaos]:
            thread.join(DEADLINE_S + 60)
            assert not thread.is_alive(), "a pull or an engine restart hung"

        exits = {d.name: d.process.poll() for d in daemons}
        print(
            f"\nstress[{transport}] {STRESS_S:.0f}s: started {tally.started}, DONE+verified {tally.done_verified}, "
            f"wrong {tally.wrong_bytes}, failed {dict(tally.failed)}, refused {dict(tally.refused)}, exits {exits}"
        )
        assert all(code is None for code in exits.values()), f"a daemon exited: {exits}"
        assert tally.violations == [], tally.violations[:10]
        assert tally.wrong_bytes == 0
        assert tally.late == [], f"pulls that ended long after their deadline: {tally.late[:10]}"
        assert tally.done_verified > 20, "too few pulls completed to mean anything"

        # Quiet: every lease released, nothing in flight, pinned, draining or staged anywhere.
        for client in world.clients.values():
            for params in client.lookup_held().held:
                with contextlib.suppress(errors.KvdError):
                    client.release_lease(lease_id=params.lease_id)
        gauges = (
            "kvd_transfers_in_flight",
            "kvd_leases_held",
            "kvd_leases_draining",
            "kvd_admitted_reads",
            "kvd_staging_bytes_in_use",
            "kvd_nixl_reads_in_flight",
        )
        deadline = time.monotonic() + DEADLINE_S + MARGIN_S + 10
        while True:
            left = {(d.name, g): metric_value(scrape(d.metrics), g) for d in daemons for g in gauges}
            left = {k: v for k, v in left.items() if v}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"left behind after the run: {left}"
        for d in daemons:
            fds, threads = _fds_and_threads(d.process.pid)
            fds0, threads0 = baseline[d.name]
            rss = _rss_mib(d.process.pid)
            print(
                f"{d.name}: fds {fds0} -> {fds}, threads {threads0} -> {threads}, RSS {rss0[d.name]:.0f} -> {rss:.0f} M"
            )
            grown = _fd_targets(d.process.pid) - fd_kinds0[d.name]
            assert fds <= fds0 + 8, f"{d.name} leaks fds: {fds0} -> {fds}, new: {dict(grown)}"
            assert threads <= threads0 + 2, f"{d.name} leaks threads: {threads0} -> {threads}"
    finally:
        stop.set()
        world.stop_all()
