"""The data-plane worker dies; the daemon does not.

``kvd serve`` is a control process and a data-plane worker (docs/architecture.md, "Processes").
These tests kill the worker from outside, as an abort or a segfault in UCX would (SIGKILL,
SIGSEGV) or as a hang would look (SIGSTOP: the heartbeat finds it and kills it), on the holder's
side and on the reader's, mid-read under concurrent pulls, and check what the issue promises:
the control process lives, engines keep their registrations and streams, failed pulls end
UNAVAILABLE within their deadline, no byte of a failed pull lands afterwards, the next pull is
byte-exact without the engine doing anything, and nothing leaks (fds, workers, /dev/shm, leases,
quarantined memory). A worker that keeps dying (killed ten times in a row, its spare with it)
does not end the daemon: it backs off, says NOT_SERVING while no worker serves, and serves the
same engines again; a control process that dies takes its workers with it.

**Cost.** A daemon pair takes seconds to start (three processes import torch and NIXL each), and
every chaos test runs ``--chaos-repeat`` times. The mid-read test therefore shares one daemon
pair per UCX transport across its rounds: each round kills one more worker (so the later rounds
also meet the restart back-off), which also checks that nothing accumulates over many restarts
(fds, children, admissions). The side and the signal rotate with the round: three rounds cover
every signal, six every signal on both sides, per transport (10 rounds in CI). The crash-loop
test starts its own pair each round (the killed side alternating by round, and the transport so
that two rounds cover both sides and both transports): a new worker must start from nothing ten
times, so it takes half a minute to two minutes a round; it runs two rounds at most.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtest import ShmEngine, llama_spec, metric_value, scrape, small_spec

from kvd.server.app import LIVENESS_SERVICE
from kvd.spawn import DaemonProcess, child_env, launch_daemon, wait_ready
from kvd_client import KvdClient, errors
from kvd_client.v1 import common_pb2, router_pb2

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

RESTART_TIMEOUT_S = 20.0
SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP)
NUM_BLOCKS = 256  # llama-shaped: 2 MiB a block, 512 MiB an engine
CONCURRENT = 4  # pulls in flight when the worker dies, 64 blocks (128 MiB) each
# Or as one engine step: STEP_PULLS of STEP_BLOCKS (8 MiB) each, eight to a step READ (64 MiB),
# so four transfers are in flight as in the other rounds. (Eight step READs of 64 MiB in flight
# over UCX TCP, 512 MiB, once had the holder's worker die of SIGSEGV in get_new_notifs when the
# reader's was killed: UCX purging the dead reader's endpoint, docs/performance.md, "Why it is off
# by default"; the daemon restarted it and lived, but this test counts the holder's restarts.)
STEP_PULLS = 32
STEP_BLOCKS = 4
DEADLINE_MS = 6000  # a hung worker is found within 2 s (heartbeat every 1 s, 1 s to answer)
HEARTBEAT_TIMEOUT_S = 1.0  # a SIGSTOPped worker is found hung within ~1.5 s
FD_SLACK = 4
# UCX 1.23 (bundled with NIXL 1.5.1) can crash a worker whose peer dies mid-read over TCP: purging
# the dead peer's TCP endpoint, it fast-forwards a pending send whose memory state was never set
# (SIGSEGV in ucp_request_memory_dereg under uct_tcp_ep_pending_purge) or hits the assertion stub
# its discard path leaves for pending sends. Not kvd's code, and not something a worker can refuse:
# kvd contains it (docs/failure-rules.md), and the test checks that, not its absence.
UCX_TCP_PURGE_CRASH = re.compile(r"uct_tcp_ep_pending_purge|stubs\.c:\d+ +Assertion `0' failed")
PATTERN = 0x5A
PATTERN64 = int.from_bytes(bytes([PATTERN] * 8), "little", signed=True)  # the pattern as torch.int64
LATE_S = {"tcp": 1.5, "default": 1.0}  # a whole 512 MiB pull takes under a second on loopback


# --- processes -------------------------------------------------------------------------------


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (every thread's children)."""
    found: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found.update(int(x) for x in path.read_text().split())
    return found


def proc_state(pid: int) -> str:
    """The process's state letter ("Z" for a zombie), "" once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_names(pids: set[int]) -> set[str]:
    """Names of the /dev/shm files the processes map (deleted ones included)."""
    names: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)").strip())
    return names


def running(pid: int) -> bool:
    """Whether any thread of ``pid`` still runs (a zombie leader may wait for its other threads,
    which still hold the process's memory)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
    return False


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """The processes still running after waiting up to ``timeout_s`` (a zombie has let go of
    everything; an orphan's is reaped by whatever init the machine has)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {pid for pid in pids if running(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def sysv_left(pids: set[int], timeout_s: float = 5.0) -> list[str]:
    """System V shared memory segments the processes created (UCX's sysv transport) that are still
    there after ``timeout_s``: one marked for removal goes with its last detach."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
        left = [row for row in rows if int(row.split()[4]) in pids]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def restart_reason(sig: signal.Signals) -> str:
    return "hung" if sig == signal.SIGSTOP else sig.name


# --- daemons ---------------------------------------------------------------------------------


def worker_pid(client: KvdClient) -> int:
    return int(client.get_status().dataplane_pid)


def wait_restarted(client: KvdClient, old_pid: int, restarts: int, timeout_s: float = RESTART_TIMEOUT_S) -> float:
    """Seconds until the daemon reports a new worker after its ``restarts``-th restart."""
    started = time.monotonic()
    while True:
        status = client.get_status()
        if status.dataplane_pid not in (0, old_pid) and status.dataplane_restarts >= restarts:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, "the data plane was not restarted"
        time.sleep(0.01)


def wait_worker_and_spare(daemon: DaemonProcess, worker: int, timeout_s: float = 30.0) -> set[int]:
    """The daemon's children once they are exactly its worker and one spare, none a zombie."""
    deadline = time.monotonic() + timeout_s
    while True:
        kids = children(daemon.process.pid)
        if len(kids) == 2 and worker in kids and all(proc_state(k) not in ("", "Z") for k in kids):
            return kids
        assert time.monotonic() < deadline, f"the daemon's children are {kids} ({worker} serves)"
        time.sleep(0.05)


@dataclass
class Pair:
    """A holder and a reader daemon, an engine on each with its stream open, for a whole module."""

    transport: str
    holder_daemon: DaemonProcess
    reader_daemon: DaemonProcess
    holder: ShmEngine
    reader: ShmEngine
    holder_stream: Any = None
    reader_stream: Any = None
    fds: dict[str, int] = field(default_factory=dict)  # control process fds once serving
    shm: set[str] = field(default_factory=set)  # /dev/shm files the workers mapped
    workers: set[int] = field(default_factory=set)  # every worker pid seen

    def side(self, name: str) -> tuple[DaemonProcess, ShmEngine]:
        return (self.holder_daemon, self.holder) if name == "holder" else (self.reader_daemon, self.reader)

    def note_workers(self) -> None:
        for daemon in (self.holder_daemon, self.reader_daemon):
            kids = children(daemon.process.pid)
            self.workers |= kids
            self.shm |= shm_names(kids)


@pytest.fixture(scope="module", params=["tcp", "default"], ids=["ucx-tcp", "ucx-default"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    transport = str(request.param)
    env = child_env(UCX_TLS="tcp") if transport == "tcp" else child_env()
    workdir = tmp_path_factory.mktemp(f"pair-{transport}")
    flags = ["--dataplane-heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), "--read-admission-margin-s", "1"]
    launches = [launch_daemon(workdir, name, flags, env=env) for name in ("holder", "reader")]
    daemons: list[DaemonProcess] = []
    engines: list[ShmEngine] = []
    the_pair: Pair | None = None
    try:
        daemons = [wait_ready(launch) for launch in launches]
        holder = ShmEngine(daemons[0].unix_target, "p", llama_spec(num_blocks=NUM_BLOCKS))
        engines.append(holder)
        reader = ShmEngine(daemons[1].unix_target, "d", llama_spec(num_blocks=NUM_BLOCKS))
        engines.append(reader)
        holder.register()
        reader.register()
        the_pair = Pair(transport, daemons[0], daemons[1], holder, reader)
        the_pair.holder_stream = holder.client.open_engine_stream("p", 0)
        the_pair.reader_stream = reader.client.open_engine_stream("d", 0)
        holder.fill_random(5)
        assert pull_until_done(reader, holder, list(range(8))) == 1
        # That pull's events are the fixture's: taken off the streams, so a test sees only its own.
        fixture_events = {"finished_recving": the_pair.reader_stream, "finished_sending": the_pair.holder_stream}
        for kind, stream in fixture_events.items():
            assert drain(stream, 10, until=lambda got, kind=kind: any(m.WhichOneof("kind") == kind for m in got))
        for name in ("holder", "reader"):
            daemon, engine = the_pair.side(name)
            wait_worker_and_spare(daemon, worker_pid(engine.client))
            the_pair.fds[name] = fd_count(daemon.process.pid)
        the_pair.note_workers()
        yield the_pair
        for stream in (the_pair.holder_stream, the_pair.reader_stream):
            stream.close()
    finally:
        for engine in engines:
            engine.close()
        crashes = []
        for launch in launches:
            daemon = next((d for d in daemons if d.process is launch.process), None)
            if daemon is None:
                launch.process.kill()
                launch.process.wait()
                continue
            daemon.terminate()
            if daemon.crash():
                crashes.append(daemon.crash())
    if crashes:
        pytest.fail("a daemon crashed:\n" + "\n\n".join(crashes), pytrace=False)
    if the_pair is None:
        return
    # Every worker the pair ever had is gone with it, and so is every /dev/shm file they mapped.
    assert not wait_gone(the_pair.workers, 10), "a worker outlived its daemon"
    engine_files = {engine.shm_name for engine in engines}
    assert not (the_pair.shm - engine_files) & set(os.listdir("/dev/shm")), "the workers left files in /dev/shm"
    assert not sysv_left(the_pair.workers), "the workers left System V segments"


# --- pulls -----------------------------------------------------------------------------------


def pull(reader: ShmEngine, holder: ShmEngine, request_id: str, blocks: list[int], deadline_ms: int = 20000):
    params = holder.client.hold_blocks(
        engine_id=holder.engine_id, request_id=request_id, block_ids=blocks, num_tokens=len(blocks) * 16
    )
    started = reader.client.start_pull(
        engine_id=reader.engine_id,
        tp_rank=0,
        request_id=request_id,
        local_block_ids=blocks,
        remote=params.kv_transfer_params,
        deadline_ms=deadline_ms,
    )
    return params, started


def pull_until_done(reader: ShmEngine, holder: ShmEngine, blocks: list[int], attempts: int = 5) -> int:
    """Pull (a router retries a pull that failed UNAVAILABLE); the attempts it took."""
    for attempt in range(1, attempts + 1):
        _, started = pull(reader, holder, f"again-{attempt}-{time.monotonic_ns()}", blocks)
        try:
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        except errors.Unavailable:
            continue
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes(blocks, len(blocks) * 16).equal(holder.token_bytes(blocks, len(blocks) * 16)))
        return attempt
    raise AssertionError(f"no pull succeeded in {attempts} attempts after the restart")


def wait_reading(client: KvdClient, transfer_ids: list[str], timeout_s: float = 10.0) -> None:
    """Until every pull is reading (NIXL READs posted), or one already ended."""
    deadline = time.monotonic() + timeout_s
    pending = set(transfer_ids)
    while pending:
        for transfer_id in list(pending):
            if client.get_transfer(transfer_id).state != common_pb2.TRANSFER_STATE_PLANNED:
                pending.discard(transfer_id)
        assert time.monotonic() < deadline, "the pulls never started reading"
        time.sleep(0.002)


def drain(stream, timeout_s: float, until=lambda got: False) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not until(got):
        got.extend(stream.poll(timeout_s=0.05))
    return got


def _pull_ends(messages: list, request_ids: set[str]) -> list:
    """The engine-stream messages that end one of these pulls (its load failed, or it was
    received); others (a pull of the fixture's, say) are not this check's."""
    ends = []
    for m in messages:
        kind = m.WhichOneof("kind")
        if kind in ("load_failed", "finished_recving") and getattr(m, kind).request_id in request_ids:
            ends.append(m)
    return ends


def ucx_tcp_purge_crash(daemon: DaemonProcess, logged_before: int) -> bool:
    """Whether the daemon's log, past ``logged_before`` bytes, shows a worker of it crashing in
    UCX's purge of a dead peer's TCP endpoint (:data:`UCX_TCP_PURGE_CRASH`)."""
    with open(daemon.log_path, "rb") as log:
        log.seek(logged_before)
        return UCX_TCP_PURGE_CRASH.search(log.read().decode(errors="replace")) is not None


def gauge_settles(daemon: DaemonProcess, name: str, timeout_s: float) -> float:
    """The gauge once 0, or its value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric_value(scrape(daemon.metrics), name)
        if not value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# --- tests -----------------------------------------------------------------------------------

# Round r kills MID_READ[r % 6]: three rounds cover every signal, six every signal on both sides.
MID_READ = [
    ("reader", signal.SIGKILL),
    ("holder", signal.SIGSEGV),
    ("reader", signal.SIGSTOP),
    ("holder", signal.SIGKILL),
    ("reader", signal.SIGSEGV),
    ("holder", signal.SIGSTOP),
]


def start_step(reader: ShmEngine, holder: ShmEngine, request_ids: list[str], chunks: list[list[int]]) -> list:
    """Hold each request's blocks, then start every pull with one StartPulls, as an engine step
    does (the READs from one holder engine go out as one step READ: kvd.core.step_reads)."""
    held = [
        holder.client.hold_blocks(
            engine_id=holder.engine_id, request_id=rid, block_ids=blocks, num_tokens=len(blocks) * 16
        )
        for rid, blocks in zip(request_ids, chunks, strict=True)
    ]
    results = reader.client.start_pulls(
        [
            router_pb2.StartPullRequest(
                engine_id=reader.engine_id,
                request_id=rid,
                local_block_ids=blocks,
                remote=params.kv_transfer_params,
                deadline_ms=DEADLINE_MS,
            )
            for rid, blocks, params in zip(request_ids, chunks, held, strict=True)
        ],
        timeout_s=30,
    )
    assert all(isinstance(r, str) for r in results), results
    return [
        (params, router_pb2.StartPullResponse(transfer_id=r), rid)
        for params, r, rid in zip(held, results, request_ids, strict=True)
    ]


def test_worker_killed_mid_read(pair: Pair, chaos_round: int) -> None:
    """A worker dies with CONCURRENT pulls reading (the side and signal rotate with the round).
    Rounds 0, 1, 4, 5 (of every 4: the first two) start STEP_PULLS of them as one engine step
    (one StartPulls: each step READ carries eight, kvd.core.step_reads), with the reader's worker
    and the holder's killed; rounds 2 and 3, CONCURRENT as StartPull calls."""
    side, sig = MID_READ[chaos_round % len(MID_READ)]
    holder, reader = pair.holder, pair.reader
    victim_daemon, victim = pair.side(side)
    tcp = pair.transport == "tcp"
    tag = f"{chaos_round}-{side}-{time.monotonic_ns()}"
    old = worker_pid(victim.client)
    assert old and old in children(victim_daemon.process.pid)
    # Each side's restarts so far, from the daemons themselves: a round that failed earlier
    # cannot shift this round's count.
    restarts_before = {name: pair.side(name)[1].client.get_status().dataplane_restarts for name in ("holder", "reader")}
    logged_before = {name: pair.side(name)[0].log_path.stat().st_size for name in ("holder", "reader")}
    step = chaos_round % 4 < 2  # rounds 0, 1 (both sides), 4, 5: one step; 2, 3: StartPull calls
    count = STEP_PULLS if step else CONCURRENT
    chunk = STEP_BLOCKS if step else NUM_BLOCKS // count
    pulls = []
    started_at = time.monotonic()
    chunks = [list(range(i * chunk, (i + 1) * chunk)) for i in range(count)]
    if step:
        pulls = start_step(reader, holder, [f"mid-{tag}-{i}" for i in range(count)], chunks)
    for i, blocks in enumerate([] if step else chunks):
        params, started = pull(reader, holder, f"mid-{tag}-{i}", blocks, deadline_ms=DEADLINE_MS)
        pulls.append((params, started, f"mid-{tag}-{i}"))
    wait_reading(reader.client, [started.transfer_id for _, started, _ in pulls])
    os.kill(old, sig)
    # Every pull ends within its deadline: UNAVAILABLE (its reads died with a worker), or DONE
    # where UCX's shared-memory transports finished the read before the kill.
    failed, done = [], []
    for params, started, request_id in pulls:
        try:
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=DEADLINE_MS / 1000 + 10)
        except errors.Unavailable:
            failed.append((params, request_id))
        else:
            assert status.state == common_pb2.TRANSFER_STATE_DONE, status
            done.append((params, request_id))
    ended_s = time.monotonic() - started_at
    assert ended_s < DEADLINE_MS / 1000 + 1, f"the pulls ended after {ended_s:.1f}s, past their deadline"
    if tcp:  # 256-512 MiB over TCP takes long enough that the kill cuts some read short, even under load
        assert failed, f"over TCP the kill should have cut at least one of the {count} reads short"
    took = wait_restarted(victim.client, old, restarts_before[side] + 1)
    # No byte lands late: the destination gets a pattern and, well past when the stale reads
    # would have ended (a whole 512 MiB pull takes under a second here), is intact.
    reader.fill(PATTERN)
    time.sleep(LATE_S[pair.transport])
    assert bool(reader.buffer.view(torch.int64).eq(PATTERN64).all()), "a byte of a failed pull landed late"
    # The control processes live; the engines keep their registrations and their streams.
    for name in ("holder", "reader"):
        daemon, engine = pair.side(name)
        assert daemon.process.poll() is None, f"the {name}'s control process died"
        status = engine.client.get_status()
        assert [e.engine_id for e in status.engines] == [engine.engine_id], f"the {name} engine lost its registration"
        expected = restarts_before[name] + (name == side)
        got = status.dataplane_restarts
        if name != side and tcp and got == expected + 1 and ucx_tcp_purge_crash(daemon, logged_before[name]):
            # The other side's worker died in UCX's TCP purge (see UCX_TCP_PURGE_CRASH): contained
            # like any lost worker, once, and everything below must hold all the same.
            print(f"the {name}'s worker died in UCX's purge of the dead peer's TCP endpoint and was replaced")
            expected += 1
        assert got == expected, f"the {name} restarted {got}x, not {expected}x"
    assert victim.client.get_status().dataplane_last_restart == restart_reason(sig)
    restarts = metric_value(scrape(victim_daemon.metrics), "kvd_dataplane_restarts_total", reason=restart_reason(sig))
    assert restarts >= 1
    # Each pull's end reaches the engine once: load_failed for a failed one, finished_recving for
    # one done before the kill (all of them done is possible under load: their messages must be
    # drained here, not left for the next pull's check).
    ours = {request_id for _, _, request_id in pulls}
    ended = _pull_ends(drain(pair.reader_stream, 5.0, until=lambda got: len(_pull_ends(got, ours)) >= len(ours)), ours)
    told = [m.load_failed.request_id for m in ended if m.WhichOneof("kind") == "load_failed"]
    assert sorted(told) == sorted(request_id for _, request_id in failed), "each failed pull is told once"
    finished = [m.finished_recving.request_id for m in ended if m.WhichOneof("kind") == "finished_recving"]
    assert sorted(finished) == sorted(request_id for _, request_id in done), "each done pull is told once"
    for params, _ in failed + done:
        with contextlib.suppress(errors.UnknownLease):
            holder.client.release_lease(lease_id=params.lease.lease_id)
    # The next pull is byte-exact, at the first try, without the engines re-registering; the
    # streams opened before the kill tell both engines about it.
    blocks = list(range(8))
    params, started = pull(reader, holder, f"next-{tag}", blocks)
    assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
    assert bool(reader.token_bytes(blocks, 8 * 16).equal(holder.token_bytes(blocks, 8 * 16)))
    got = drain(pair.reader_stream, 5.0, until=bool)
    assert [m.finished_recving.request_id for m in got] == [f"next-{tag}"], got
    sent = drain(
        pair.holder_stream, 5.0, until=lambda got: any(m.finished_sending.request_id == f"next-{tag}" for m in got)
    )
    assert f"next-{tag}" in [m.finished_sending.request_id for m in sent], sent
    # Nothing leaks.
    assert not gauge_settles(pair.holder_daemon, "kvd_admitted_reads", DEADLINE_MS / 1000 + 3), (
        "the holder still admits reads of the failed pulls"
    )
    for name in ("holder", "reader"):
        daemon, engine = pair.side(name)
        text = scrape(daemon.metrics)
        assert metric_value(text, "kvd_quarantined_bytes") == 0, f"the {name} quarantined memory"
        assert metric_value(text, "kvd_transfers_in_flight") == 0
        kids = wait_worker_and_spare(daemon, worker_pid(engine.client))
        assert old not in kids
        fds = fd_count(daemon.process.pid)
        assert fds <= pair.fds[name] + FD_SLACK, f"the {name}'s control process has {fds} fds, {pair.fds[name]} before"
    assert not proc_state(old), f"the killed worker {old} is still there ({proc_state(old)})"
    pair.note_workers()
    print(
        f"{pair.transport} {side} {sig.name}: {len(failed)} failed, {len(done)} done, restarted in {took * 1e3:.0f} ms"
    )


CRASH_LOOP_KILLS = 10
BACKOFF_MAX_S = 1.0  # ten kills (each worker started from nothing) fit in a minute even under load


def health(engine: ShmEngine) -> bool:
    return engine.client.health_check(timeout_s=2)


def kernel_states(pid: int) -> str:
    """Each child of ``pid`` with each thread's state and the kernel call it waits in."""
    lines = []
    for kid in sorted(children(pid)):
        threads = []
        for task in Path(f"/proc/{kid}/task").glob("*"):
            with contextlib.suppress(OSError, IndexError):
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                threads.append(f"{state}:{(task / 'wchan').read_text() or '-'}")
        lines.append(f"child {kid}: {' '.join(sorted(threads))}")
    return "\n".join(lines) or "no children"


def wait_health(daemon: DaemonProcess, engine: ShmEngine, serving: bool, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while health(engine) != serving:
        assert time.monotonic() < deadline, (
            f"health did not become {'SERVING' if serving else 'NOT_SERVING'} within {timeout_s:.0f}s; "
            f"the daemon's children:\n{kernel_states(daemon.process.pid)}\n{daemon.log_tail(40)}"
        )
        time.sleep(0.01)


@pytest.mark.chaos_rounds(2)  # 30-140 s a round; 2 rounds cover both transports, both sides and the loaded round
def test_worker_and_spare_killed_ten_times_the_daemon_backs_off_and_serves_the_same_engines(
    spawn_daemon, chaos_round: int
) -> None:
    """A crash loop: the serving worker and its spare are SIGKILLed together, again as soon as a
    new worker serves, ten times. The control process lives through it: health goes NOT_SERVING
    at each kill and SERVING again, only the serving workers' losses count as restarts (not the
    spares'), the engines keep their registrations and streams, and then a pull between the
    two daemons is byte-exact with nobody registering again. Nothing is left behind."""
    # Round 0: the reader's worker, default transports, under CPU load; round 1: the holder's, UCX TCP.
    env = child_env(UCX_TLS="tcp") if (chaos_round + chaos_round // 2) % 2 else child_env()
    side = ("reader", "holder")[chaos_round % 2]
    flags = ("--dataplane-restart-backoff-max-s", str(BACKOFF_MAX_S))
    daemons = {name: spawn_daemon(*flags, name=name, env=env) for name in ("holder", "reader")}
    engines = {
        "holder": ShmEngine(daemons["holder"].unix_target, "p", small_spec()),
        "reader": ShmEngine(daemons["reader"].unix_target, "d", small_spec()),
    }
    holder, reader = engines["holder"], engines["reader"]
    victim_daemon, victim = daemons[side], engines[side]
    try:
        for engine in engines.values():
            engine.register()
        streams = {name: engine.client.open_engine_stream(engine.engine_id, 0) for name, engine in engines.items()}
        holder.fill_random(chaos_round + 1)
        blocks = list(range(8))
        _, started = pull(reader, holder, "before", blocks)
        assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert drain(streams["reader"], 10, until=bool)
        kids = wait_worker_and_spare(victim_daemon, worker_pid(victim.client))
        fds = fd_count(victim_daemon.process.pid)
        killed: set[int] = set()
        shm = shm_names(kids)

        first_kill = time.monotonic()
        for kill in range(1, CRASH_LOOP_KILLS + 1):
            old = worker_pid(victim.client)
            others = children(victim_daemon.process.pid) - {old}  # the spare (ready or still starting)
            for pid in [*others, old]:  # the spare first: the daemon must not take it as the next worker
                os.kill(pid, signal.SIGKILL)
            killed |= {old, *others}
            wait_health(victim_daemon, victim, False, 10)
            # Readiness follows the worker; liveness (the probe that restarts a pod) does not.
            assert victim.client.health_check(timeout_s=2, service=LIVENESS_SERVICE), "liveness failed at a kill"
            wait_health(victim_daemon, victim, True, 30)
            new = worker_pid(victim.client)
            assert new not in killed and new in children(victim_daemon.process.pid)
            assert victim_daemon.process.poll() is None, f"the daemon exited at kill {kill}: {victim_daemon.log_tail()}"
            shm |= shm_names(children(victim_daemon.process.pid))
        took = time.monotonic() - first_kill

        for name, engine in engines.items():
            status = engine.client.get_status()
            assert [e.engine_id for e in status.engines] == [engine.engine_id], (
                f"the {name} engine lost its registration"
            )
            restarts = CRASH_LOOP_KILLS if name == side else 0
            assert status.dataplane_restarts == restarts, f"the {name} counted {status.dataplane_restarts} restarts"
            text = scrape(daemons[name].metrics)
            assert metric_value(text, "kvd_dataplane_serving") == 1 and metric_value(text, "kvd_serving") == 1
        assert victim.client.get_status().dataplane_last_restart == "SIGKILL"
        text = scrape(victim_daemon.metrics)
        assert metric_value(text, "kvd_dataplane_restarts_total", reason="SIGKILL") == CRASH_LOOP_KILLS

        # The same registrations, the same streams: a byte-exact pull at the first try.
        holder.fill_random(chaos_round + 100)
        reader.fill(PATTERN)
        _, started = pull(reader, holder, "after", blocks)
        assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert bool(reader.token_bytes(blocks, 8 * 16).equal(holder.token_bytes(blocks, 8 * 16)))
        got = drain(streams["reader"], 10, until=bool)
        assert [m.finished_recving.request_id for m in got] == ["after"], got
        sent = drain(
            streams["holder"], 10, until=lambda got: any(m.finished_sending.request_id == "after" for m in got)
        )
        assert "after" in [m.finished_sending.request_id for m in sent], sent

        # Nothing is left: one worker and one spare, every killed one gone, no fd more.
        kids = wait_worker_and_spare(victim_daemon, worker_pid(victim.client))
        assert not kids & killed and not wait_gone(killed, 10), "a killed worker is still there"
        assert fd_count(victim_daemon.process.pid) <= fds + FD_SLACK
        print(f"{side} ({'tcp' if chaos_round % 2 else 'default'}): {CRASH_LOOP_KILLS} kills in {took:.1f}s")
        for stream in streams.values():
            with contextlib.suppress(errors.KvdError):
                stream.close()
    finally:
        for engine in engines.values():
            engine.close()
    for daemon in daemons.values():
        assert daemon.terminate() == 0
    assert not wait_gone(killed, 10), "a worker outlived its daemon"
    assert not (shm - {e.shm_name for e in engines.values()}) & set(os.listdir("/dev/shm")), "files left in /dev/shm"
    assert not sysv_left(killed), "the killed workers left System V segments"


def test_control_process_killed_takes_its_workers(spawn_daemon, chaos_round: int) -> None:
    """The control process is SIGKILLed: its worker and its spare die with it (PR_SET_PDEATHSIG)."""
    daemon = spawn_daemon(name="ctl")
    engine = ShmEngine(daemon.unix_target, "e", small_spec())
    try:
        engine.register()
        kids = wait_worker_and_spare(daemon, worker_pid(engine.client))
        shm = shm_names(kids)
        daemon.kill()
        engine.registered = False
        assert not wait_gone(kids, 10), "a worker outlived its control process"
        assert not (shm - {engine.shm_name}) & set(os.listdir("/dev/shm")), "the workers left files in /dev/shm"
        assert not sysv_left(kids), "the workers left System V segments"
    finally:
        engine.close()
