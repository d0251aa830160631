"""The fleet orchestrator: nodes, daemons, engines, the router, faults, invariants, the report.

See docs/fleet.md. ``python scripts/fleet.py --nodes 6 --minutes 3 --seed 1`` (root).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fleet import load, netns, procinfo
from fleet.netns import Network
from fleet.procfaults import ProcessFaults

LEASE_TTL_S = 4.0
DEADLINE_S = 6.0
PORT = 50151
METRICS_PORT = 9464
STAGING_POOL_BYTES = 256 << 20  # the daemon's default: its RSS behaviour is what the run watches
FAULT_KINDS = (
    "engine_kill",
    "daemon_kill",
    "link_cut",
    "daemon_stop",
    "netem",
    "bad_cert",
    "worker_kill",
    "worker_segv",
    "worker_hang",
    "daemon_restart",
    "rolling_restart",
)
WORKER_FAULTS = ("worker_kill", "worker_segv", "worker_hang")
TESTS_DIR = Path(__file__).resolve().parents[1]
ENGINE_PY = TESTS_DIR / "fleet" / "engine.py"

logger = logging.getLogger("fleet")


@dataclasses.dataclass
class EngineProc:
    engine_id: str
    node: int
    role: str
    shape: dict[str, Any]
    control: Path
    process: subprocess.Popen[bytes] | None = None
    generation: int = 0
    expect_exit: bool = False
    shm: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class DaemonProc:
    node: int
    address: str
    metrics: str
    config: Path
    process: subprocess.Popen[bytes] | None = None
    epoch: int = 0
    started_at: float = 0.0
    incarnation: str = ""
    expect_exit: bool = False
    stopped: bool = False
    clean_stops: set[int] = dataclasses.field(default_factory=set)  # epochs the run ended by SIGTERM
    ready: bool = False  # its ready file was written (samples are taken only then)
    fd_peaks: dict[int, tuple[int, dict[str, int]]] = dataclasses.field(default_factory=dict)  # epoch -> fds, kinds
    samples: dict[int, list[procinfo.Sample]] = dataclasses.field(default_factory=dict)  # epoch -> samples


@dataclasses.dataclass
class FaultRecord:
    kind: str
    node: int
    at_s: float
    detail: str = ""
    healed_at_s: float = 0.0
    recovered_at_s: float = 0.0


def plan_engines(nodes: int, rng: random.Random, run_dir: Path, owner: int) -> list[EngineProc]:
    """One or two engines per node, of differing layouts, block sizes and TP; both roles present."""
    out = []
    for i in range(nodes):
        for j in range(rng.choice((1, 2))):
            role = ("prefill", "decode")[i % 2] if j == 0 else rng.choice(("prefill", "decode"))
            block = rng.choice((8, 16, 32))
            engine_id = f"n{i}e{j}-{role[0]}"
            shape = dict(
                engine_id=engine_id,
                tp_size=rng.choice((1, 1, 2)),
                block_size=block,
                layout=rng.choice(("NHD", "HND")),
                kv_format=rng.choice(("SPLIT", "JOINT")),
                num_blocks=2048 // block + 1,  # 2048 tokens: 8 MiB of KV per engine
            )
            out.append(EngineProc(engine_id, i, role, shape, run_dir / f"{engine_id}.ctl"))
    return out


class Fleet:
    def __init__(self, args: argparse.Namespace, net: Network, run_dir: Path) -> None:
        self.args = args
        self.net = net
        self.run_dir = run_dir
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.duration = args.minutes * 60.0
        self.warmup = min(30.0, max(12.0, self.duration * 0.15))
        self.quiet = min(30.0, max(15.0, self.duration * 0.15))
        self.engines = plan_engines(args.nodes, self.rng, run_dir, net.owner_pid)
        self.daemons = [
            DaemonProc(i, f"{net.node_addr(i)}:{PORT}", f"{net.node_addr(i)}:{METRICS_PORT}", run_dir / f"n{i}.toml")
            for i in range(args.nodes)
        ]
        self.faults: list[FaultRecord] = []
        self.crashed: list[str] = []
        self.engine_crashes: list[str] = []
        self.violations: list[str] = []
        self.refusals: Counter[str] = Counter()
        self.router: Any = None
        self.stop = asyncio.Event()
        self.planned_done = asyncio.Event()  # every kind of fault has been injected once
        self.hogs: list[subprocess.Popen[bytes]] = []
        self.process_faults = ProcessFaults(self)
        self.kinds = tuple(args.faults.split(",")) if args.faults else FAULT_KINDS

    def ref(self, e: EngineProc) -> Any:
        """The router's view of engine ``e``."""
        from fleet.router import EngineRef

        return EngineRef(e.engine_id, e.node, e.role, int(e.shape["tp_size"]), e.control)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- certificates and config ---------------------------------------------------------------

    def make_pki(self) -> None:
        sys.path.insert(0, str(TESTS_DIR))
        from pki import make_identities

        identities: dict[str, list[str]] = {
            f"node-{i}": [f"DNS:node-{i}.fleet", f"IP:{self.net.node_addr(i)}"] for i in range(self.args.nodes)
        }
        identities["router"] = ["DNS:router.fleet"]
        identities["intruder"] = ["DNS:intruder.fleet"]  # our CA's, but no role
        identities["foreign-router"] = ["DNS:router.fleet"]  # claims the router's name, another CA
        make_identities(self.run_dir, identities)
        for d in self.daemons:
            i = d.node
            d.config.write_text(
                "\n".join(
                    [
                        "[kvd]",
                        f'unix_socket = "{self.run_dir}/n{i}/engine.sock"',
                        f'host = "{self.net.node_addr(i)}"',
                        f"port = {PORT}",
                        f'metrics_host = "{self.net.node_addr(i)}"',
                        f"metrics_port = {METRICS_PORT}",
                        f"lease_ttl_s = {LEASE_TTL_S}",
                        f"transfer_deadline_s = {DEADLINE_S}",
                        f"staging_pool_bytes = {STAGING_POOL_BYTES}",
                        "shutdown_grace_s = 5.0",
                        f'tls_cert = "{self.run_dir}/node-{i}.pem"',
                        f'tls_key = "{self.run_dir}/node-{i}.key"',
                        f'tls_ca = "{self.run_dir}/ca.pem"',
                        'tls_peer_names = ["node-*.fleet"]',
                        'tls_router_names = ["router.fleet"]',
                        'tls_operator_names = ["router.fleet"]',
                        f'nixl_net_devices = "{self.net.node_dev(i)}"',
                        f'ready_file = "{self.run_dir}/n{i}.ready.json"',
                    ]
                )
                + "\n"
            )

    # -- processes ----------------------------------------------------------------------------

    def launch_daemon(self, d: DaemonProc) -> None:
        ready = self.run_dir / f"n{d.node}.ready.json"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "UCX_TLS": "tcp"}
        log = open(self.run_dir / f"n{d.node}.daemon.log", "ab")  # noqa: SIM115 - the child owns it
        d.process = subprocess.Popen(
            [*self.net.netns_prefix(d.node), sys.executable, "-m", "kvd.cli.main", "serve", "--config", str(d.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        d.epoch += 1
        d.expect_exit = False
        d.stopped = False
        d.ready = False
        d.started_at = self.now()
        d.samples[d.epoch] = []

    async def wait_daemon(self, d: DaemonProc, timeout_s: float = 90.0) -> None:
        ready = self.run_dir / f"n{d.node}.ready.json"
        limit = time.monotonic() + timeout_s
        while not ready.exists():
            assert d.process is not None
            if d.process.poll() is not None:
                raise RuntimeError(f"daemon n{d.node} exited {d.process.returncode} at start:\n{self.log_tail(d)}")
            if time.monotonic() > limit:
                raise RuntimeError(f"daemon n{d.node} not ready after {timeout_s}s:\n{self.log_tail(d)}")
            await asyncio.sleep(0.1)
        d.incarnation = json.loads(ready.read_text()).get("incarnation", "")
        d.ready = True

    def log_tail(self, d: DaemonProc, lines: int = 30) -> str:
        path = self.run_dir / f"n{d.node}.daemon.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def launch_engine(self, e: EngineProc) -> None:
        e.generation += 1
        prefix = f"{netns.PREFIX}-{self.net.owner_pid}-{e.engine_id}-g{e.generation}"
        e.shm = [f"{prefix}-r{r}" for r in range(int(e.shape["tp_size"]))]
        config = {
            "shape": e.shape,
            "daemon_socket": f"unix://{self.run_dir}/n{e.node}/engine.sock",
            "control_socket": str(e.control),
            "shm_prefix": prefix,
        }
        log = open(self.run_dir / f"{e.engine_id}.log", "ab")  # noqa: SIM115 - the child owns it
        e.process = subprocess.Popen(
            [*self.net.netns_prefix(e.node), sys.executable, str(ENGINE_PY), json.dumps(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        e.expect_exit = False

    async def wait_engine(self, e: EngineProc, timeout_s: float = 60.0) -> None:
        from fleet.router import EngineDown, EngineRef, engine_call

        ref = EngineRef(e.engine_id, e.node, e.role, int(e.shape["tp_size"]), e.control)
        limit = time.monotonic() + timeout_s
        while time.monotonic() < limit:
            assert e.process is not None
            if e.process.poll() is not None:
                raise RuntimeError(f"engine {e.engine_id} exited {e.process.returncode} at start")
            with contextlib.suppress(EngineDown):
                if (await engine_call(ref, "status", timeout_s=2.0)).get("registered"):
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"engine {e.engine_id} not registered after {timeout_s}s")

    def unlink_engine_shm(self, e: EngineProc) -> None:
        """What a supervisor does for a SIGKILLed engine: its shm files (the daemon keeps its mapping)."""
        for name in e.shm:
            with contextlib.suppress(FileNotFoundError):
                (netns.SHM_DIR / name).unlink()

    # -- watchers -----------------------------------------------------------------------------

    async def watch_processes(self) -> None:
        """A daemon or engine that exits without the run asking is a crash; it is restarted."""
        while True:
            for d in self.daemons:
                if d.process is not None and not d.expect_exit and d.process.poll() is not None:
                    self.crashed.append(
                        f"daemon n{d.node} (epoch {d.epoch}) exited {d.process.returncode} at {self.now():.1f}s:\n"
                        + self.log_tail(d)
                    )
                    logger.error("daemon n%d died unasked (exit %s)", d.node, d.process.returncode)
                    self.launch_daemon(d)
                    with contextlib.suppress(RuntimeError):
                        await self.wait_daemon(d)
            for e in self.engines:
                if e.process is not None and not e.expect_exit and e.process.poll() is not None:
                    self.engine_crashes.append(
                        f"engine {e.engine_id} exited {e.process.returncode} at {self.now():.1f}s"
                    )
                    self.unlink_engine_shm(e)
                    self.launch_engine(e)
            await asyncio.sleep(0.5)

    async def sample_daemons(self) -> None:
        while True:
            for d in self.daemons:
                # Not while the run stops or restarts it: its quiet level is measured while it serves.
                alive = d.process is not None and d.process.poll() is None
                if alive and d.ready and not d.stopped and not d.expect_exit:
                    assert d.process is not None
                    s = await asyncio.to_thread(procinfo.sample, d.process.pid, self.now(), STAGING_POOL_BYTES)
                    if s is not None:
                        d.samples[d.epoch].append(s)
                        first = d.samples[d.epoch][0]
                        peak = d.fd_peaks.get(d.epoch, (first.fds + 16, {}))[0]
                        if s.fds > peak:  # what the fds are, for a report on their growth
                            kinds = await asyncio.to_thread(procinfo.fd_kinds, d.process.pid)
                            d.fd_peaks[d.epoch] = (s.fds, kinds)
            await asyncio.sleep(3.0)

    async def progress(self) -> None:
        tty = sys.stdout.isatty()
        while True:
            await asyncio.sleep(5.0)
            t = self.router.tally
            last = self.faults[-1] if self.faults else None
            line = (
                f"[{self.now():6.1f}s/{self.duration:.0f}s] pulls={t.pulls_done} failed={t.pulls_failed} "
                f"recomputed={t.recomputed} wrong={t.wrong} in_flight={t.in_flight} faults={len(self.faults)}"
                + (f" last={last.kind}(n{last.node})" if last else "")
            )
            print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)

    # -- faults -------------------------------------------------------------------------------

    def fault_plan(self) -> list[str]:
        """Every kind once, in an order drawn from the seed, then random ones while time is left."""
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        repeatable = [k for k in self.kinds if k != "rolling_restart"] or list(self.kinds)  # one is enough
        return kinds + [self.rng.choice(repeatable) for _ in range(200)]

    async def inject_faults(self) -> None:
        await asyncio.sleep(max(0.0, self.warmup - self.now()))
        end = self.duration - self.quiet
        for index, kind in enumerate(self.fault_plan()):
            # Every kind once, however long that takes (into the quiet tail if need be: traffic
            # goes on until every fault is over); then more while time is left.
            if index >= len(self.kinds) and self.now() > end - 8.0:
                return
            node = self.rng.randrange(self.args.nodes)
            record = FaultRecord(kind, node, round(self.now(), 1))
            self.faults.append(record)
            try:
                await getattr(self, f"fault_{kind}")(record)
            except Exception as err:  # noqa: BLE001 - a fault that could not be injected is reported
                record.detail += f" (injection failed: {err!r})"
                self.violations.append(f"fault {kind} on n{node} could not be injected: {err!r}")
            record.healed_at_s = round(self.now(), 1)
            if index + 1 == len(self.kinds):
                self.planned_done.set()
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))

    async def fault_engine_kill(self, r: FaultRecord) -> None:
        e = self.rng.choice(self.engines)
        r.node = e.node
        r.detail = e.engine_id
        e.expect_exit = True
        assert e.process is not None
        e.process.kill()
        await asyncio.to_thread(e.process.wait)
        self.unlink_engine_shm(e)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        self.launch_engine(e)
        await self.wait_engine(e)

    async def fault_daemon_kill(self, r: FaultRecord) -> None:
        d = self.daemons[r.node]
        d.expect_exit = True
        assert d.process is not None
        d.process.kill()
        await asyncio.to_thread(d.process.wait)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        self.launch_daemon(d)
        await self.wait_daemon(d)

    async def fault_link_cut(self, r: FaultRecord) -> None:
        hold = self.rng.uniform(2.0, 5.0)
        r.detail = f"{hold:.1f}s"
        self.net.cut(r.node)
        try:
            await asyncio.sleep(hold)
        finally:
            self.net.heal(r.node)

    async def fault_daemon_stop(self, r: FaultRecord) -> None:
        d = self.daemons[r.node]
        hold = LEASE_TTL_S + self.rng.uniform(1.5, 3.0)  # past its leases' TTL
        r.detail = f"{hold:.1f}s"
        assert d.process is not None
        d.stopped = True
        d.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(hold)
        finally:
            d.process.send_signal(signal.SIGCONT)
            d.stopped = False

    async def fault_netem(self, r: FaultRecord) -> None:
        delay, loss, hold = self.rng.choice((10, 30, 60)), self.rng.choice((0.5, 2.0, 5.0)), self.rng.uniform(4.0, 8.0)
        r.detail = f"{self.net.degrade(r.node, delay, loss)} for {hold:.1f}s"
        try:
            await asyncio.sleep(hold)
        finally:
            self.net.restore(r.node)

    async def fault_worker_kill(self, r: FaultRecord) -> None:
        await self.process_faults.worker(r)

    async def fault_worker_segv(self, r: FaultRecord) -> None:
        await self.process_faults.worker(r)

    async def fault_worker_hang(self, r: FaultRecord) -> None:
        await self.process_faults.worker(r)

    async def fault_daemon_restart(self, r: FaultRecord) -> None:
        await self.process_faults.daemon_restart(r)

    async def fault_rolling_restart(self, r: FaultRecord) -> None:
        await self.process_faults.rolling_restart(r)

    async def fault_bad_cert(self, r: FaultRecord) -> None:
        """Callers the daemon must refuse: a certificate of our CA without a role, and one of
        another CA that claims the router's name. Neither may learn or change anything."""
        from kvd_client import errors
        from kvd_client.aio import AsyncKvdClient
        from kvd_client.channel import TlsConfig
        from kvd_client.v1 import common_pb2

        address = self.daemons[r.node].address
        ca = self.run_dir / "ca.pem"
        for who, expected in (("intruder", errors.PermissionDenied), ("foreign-router", errors.Unavailable)):
            tls = TlsConfig.from_files(ca, self.run_dir / f"{who}.pem", self.run_dir / f"{who}.key")
            async with AsyncKvdClient(address, tls=tls, timeout_s=3.0) as client:
                calls = {
                    "get_status": client.get_status(),
                    "lookup_held": client.lookup_held(),
                    "start_pull": client.start_pull(
                        engine_id="x",
                        tp_rank=0,
                        request_id="intrusion",
                        local_block_ids=[1],
                        remote=common_pb2.KvTransferParams(daemon_address=address, lease_id="x", block_ids=[1]),
                    ),
                }
                for name, call in calls.items():
                    try:
                        await call
                    except expected:
                        self.refusals[f"{who}:{expected.__name__}"] += 1
                        continue
                    except errors.KvdError as err:
                        if isinstance(err, errors.Unavailable) and expected is errors.PermissionDenied:
                            continue  # the node is cut off or stopped right now: nothing learned
                        self.violations.append(f"{who} calling {name} on n{r.node}: {type(err).__name__}: {err}")
                        continue
                    self.violations.append(f"{who} calling {name} on n{r.node} was ACCEPTED")
        r.detail = "intruder, foreign-router"

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        from fleet.router import EngineRef, Router
        from kvd_client.channel import TlsConfig

        if self.args.load:
            self.hogs = load.start_hogs()
            print(f"fleet: --load: {len(self.hogs)} busy processes (one per core) beside the fleet", flush=True)
        self.make_pki()
        for d in self.daemons:
            self.launch_daemon(d)
        await asyncio.gather(*(self.wait_daemon(d) for d in self.daemons))
        for e in self.engines:
            self.launch_engine(e)
        await asyncio.gather(*(self.wait_engine(e) for e in self.engines))
        setup_s = self.now()
        print(
            f"fleet: {self.args.nodes} nodes, {len(self.engines)} engines up in {setup_s:.1f}s: "
            + ", ".join(
                "{}(tp{} {} {} bs{})".format(
                    e.engine_id, e.shape["tp_size"], e.shape["layout"], e.shape["kv_format"], e.shape["block_size"]
                )
                for e in self.engines
            ),
            flush=True,
        )
        self.t0 = time.monotonic()  # the clock of the run starts with traffic
        refs = [EngineRef(e.engine_id, e.node, e.role, int(e.shape["tp_size"]), e.control) for e in self.engines]
        tls = TlsConfig.from_files(self.run_dir / "ca.pem", self.run_dir / "router.pem", self.run_dir / "router.key")
        self.router = Router(
            refs,
            [d.address for d in self.daemons],
            tls,
            lambda n: self.daemons[n].epoch,
            random.Random(self.args.seed + 1),
            LEASE_TTL_S,
            DEADLINE_S,
        )
        await self.router.open()
        helpers = [
            asyncio.create_task(c)
            for c in (self.watch_processes(), self.sample_daemons(), self.progress(), self.inject_faults())
        ]
        traffic = asyncio.create_task(self.router.run(self.stop, 2 * self.args.nodes))
        try:
            await asyncio.sleep(max(0.0, self.duration - self.quiet * 0.5 - self.now()))
            if not self.planned_done.is_set():  # the first round of faults ran late: see it through
                await self.planned_done.wait()
                await asyncio.sleep(10.0)  # and a short quiet tail after it
            self.stop.set()
            await asyncio.wait_for(traffic, timeout=DEADLINE_S + 90.0)
        finally:
            for task in helpers[2:]:
                task.cancel()
        print("", flush=True)
        traffic_s = self.now()
        leaks = await self.quiesce()
        helpers[0].cancel()
        helpers[1].cancel()
        metrics = await self.check_metrics()
        rss = self.check_rss()
        shutdown = await self.shutdown()
        await self.router.close()
        return self.report(traffic_s, setup_s, leaks, metrics, rss, shutdown)

    async def quiesce(self) -> dict[str, Any]:
        """After the traffic: wait until nothing is held, admitted, in flight or quarantined."""
        from fleet.router import EngineDown, EngineRef, engine_call
        from kvd.core import metrics_text

        limit = time.monotonic() + LEASE_TTL_S + DEADLINE_S + 20.0
        problems: list[str] = []
        while True:
            problems = []
            for d in self.daemons:
                try:
                    status = await self.router.clients[d.node].get_status(timeout_s=3.0)
                except Exception as err:  # noqa: BLE001
                    problems.append(f"n{d.node}: status: {err!r}")
                    continue
                for field in (
                    "leases_held",
                    "leases_draining",
                    "admitted_reads",
                    "quarantined_bytes",
                    "transfers_in_flight",
                ):
                    if getattr(status, field):
                        problems.append(f"n{d.node}: {field}={getattr(status, field)}")
                try:
                    text = await asyncio.to_thread(metrics_text.fetch, d.metrics)
                except OSError as err:
                    problems.append(f"n{d.node}: metrics: {err!r}")
                    continue
                for name in ("kvd_nixl_reads_in_flight", "kvd_staging_bytes_in_use"):
                    value = sum(v for n, _, v in metrics_text.samples(text) if n == name)
                    if value:
                        problems.append(f"n{d.node}: {name}={value:g}")
                assert d.process is not None
                live = {n for e in self.engines if e.node == d.node for n in e.shm}
                stale = {m for m in procinfo.shm_maps(d.process.pid) if m.split(" ")[0] not in live}
                if stale:
                    problems.append(f"n{d.node}: maps shm of no live engine: {sorted(stale)}")
            for e in self.engines:
                ref = EngineRef(e.engine_id, e.node, e.role, 1, e.control)
                try:
                    st = await engine_call(ref, "status", timeout_s=3.0)
                except EngineDown as err:
                    problems.append(f"{e.engine_id}: {err}")
                    continue
                if st["requests"] or st["leases"] or st["free_blocks"] != st["total_blocks"]:
                    problems.append(
                        f"{e.engine_id}: {st['requests']} requests, {st['leases']} leases, "
                        f"{st['total_blocks'] - st['free_blocks']} blocks not given back"
                    )
            if not problems or time.monotonic() > limit:
                break
            await asyncio.sleep(1.0)
        fds = {}
        for d in self.daemons:
            assert d.process is not None
            with contextlib.suppress(OSError):
                fds[f"n{d.node}"] = procinfo.fd_count(d.process.pid)
        self.violations += [f"leak after quiescence: {p}" for p in problems]
        return {"problems": problems, "fds_at_end": fds}

    async def check_metrics(self) -> dict[str, Any]:
        """Each daemon's counters against the router's tally for that daemon's incarnation."""
        from kvd.core import metrics_text

        tally = self.router.tally
        out = {}
        for d in self.daemons:
            key = (d.node, d.epoch)
            text = await asyncio.to_thread(metrics_text.fetch, d.metrics)
            samples = metrics_text.samples(text)

            def total(name: str, samples: Any = samples, **labels: str) -> float:
                return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items()))

            done = total("kvd_transfers_total", direction="pull", outcome="done")
            pulled = total("kvd_transfer_bytes_total", direction="pull")
            row = {
                "epoch": d.epoch,
                "daemon_done": done,
                "router_done": tally.done_by_epoch[key],
                "daemon_bytes": pulled,
                "router_bytes": tally.bytes_by_epoch[key],
                "ambiguous": key in tally.ambiguous_epochs,
            }
            out[f"n{d.node}"] = row
            if row["ambiguous"]:
                continue
            if done != row["router_done"]:
                self.violations.append(
                    f"n{d.node}: daemon counted {done:g} pulls done, the router {row['router_done']}"
                )
            if pulled != row["router_bytes"]:
                self.violations.append(
                    f"n{d.node}: daemon pulled {pulled:g} bytes, the router saw {row['router_bytes']}"
                )
        return out

    def check_rss(self) -> dict[str, Any]:
        """Per daemon incarnation: RSS after warm-up vs at the end, the staging pool apart."""
        out = {}
        for d in self.daemons:
            for epoch, samples in d.samples.items():
                settled = [s for s in samples if s.t >= max(self.warmup, samples[0].t + 15.0)] if samples else []
                if len(settled) < 4:
                    continue
                first, last = settled[0], settled[-1]
                growth = last.rest - first.rest
                allowed = 24 * 2**20 + first.rest // 10
                row = {
                    "from_s": first.t,
                    "to_s": last.t,
                    "rss_mib": [round(first.rss / 2**20, 1), round(last.rss / 2**20, 1)],
                    "staging_mib": [round(first.staging_rss / 2**20, 1), round(last.staging_rss / 2**20, 1)],
                    "engine_shm_mib": [round(first.shmem / 2**20, 1), round(last.shmem / 2**20, 1)],
                    "rest_mib": [round(first.rest / 2**20, 1), round(last.rest / 2**20, 1)],
                    "fds": [first.fds, last.fds],
                }
                out[f"n{d.node}.{epoch}"] = row
                if growth > allowed:
                    self.violations.append(
                        f"n{d.node} (epoch {epoch}): own RSS (less staging, engine shm) grew {growth / 2**20:.1f} MiB "
                        f"after warm-up ({row['rest_mib'][0]} -> {row['rest_mib'][1]} MiB)"
                    )
                if last.staging_rss > STAGING_POOL_BYTES:
                    self.violations.append(f"n{d.node}: staging RSS {last.staging_rss} over its pool")
                if epoch in d.fd_peaks:
                    row["fd_peak"] = {"fds": d.fd_peaks[epoch][0], "kinds": d.fd_peaks[epoch][1]}
                if last.fds > first.fds + 32:
                    self.violations.append(
                        f"n{d.node} (epoch {epoch}): fds grew {first.fds} -> {last.fds} (at their peak: "
                        f"{row.get('fd_peak')})"
                    )
        return out

    async def shutdown(self) -> dict[str, Any]:
        """SIGTERM engines (they unregister and unlink), then daemons (they must exit 0)."""
        for e in self.engines:
            e.expect_exit = True
            if e.process is not None and e.process.poll() is None:
                e.process.send_signal(signal.SIGTERM)
        for e in self.engines:
            if e.process is not None:
                try:
                    await asyncio.wait_for(asyncio.to_thread(e.process.wait), 15.0)
                except TimeoutError:
                    self.violations.append(f"engine {e.engine_id} did not stop on SIGTERM")
                    e.process.kill()
        codes = {}
        for d in self.daemons:
            d.expect_exit = True
            if d.process is not None and d.process.poll() is None:
                d.process.send_signal(signal.SIGTERM)
        for d in self.daemons:
            assert d.process is not None
            try:
                codes[f"n{d.node}"] = await asyncio.wait_for(asyncio.to_thread(d.process.wait), 30.0)
            except TimeoutError:
                d.process.kill()
                codes[f"n{d.node}"] = "timeout"
            if codes[f"n{d.node}"] != 0:
                self.violations.append(f"daemon n{d.node} exited {codes[f'n{d.node}']} on SIGTERM:\n{self.log_tail(d)}")
        left = sorted(p.name for p in netns.SHM_DIR.glob(f"{netns.PREFIX}-{self.net.owner_pid}-*"))
        if left:
            self.violations.append(f"/dev/shm files left: {left}")
        return {"exit_codes": codes, "shm_left": left}

    def report(
        self,
        traffic_s: float,
        setup_s: float,
        leaks: dict[str, Any],
        metrics: dict[str, Any],
        rss: dict[str, Any],
        shutdown: dict[str, Any],
    ) -> dict[str, Any]:
        t = self.router.tally
        for record in self.faults:  # recovered: the first verified turn through that node after it healed
            times = t.ok_times_by_node.get(record.node, [])
            index = bisect.bisect_left(times, self.t0 + record.healed_at_s)
            if index < len(times):
                record.recovered_at_s = round(times[index] - self.t0, 1)
        lat = sorted(t.latencies)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else 0.0

        self.violations += t.undocumented
        for d in self.daemons:  # a daemon stopped by SIGTERM tells every pull's outcome before it exits
            for epoch in sorted(d.clean_stops):
                if t.unseen_by_epoch[(d.node, epoch)]:
                    self.violations.append(
                        f"n{d.node} (epoch {epoch}, stopped by SIGTERM): {t.unseen_by_epoch[(d.node, epoch)]} pulls "
                        "ended without a final outcome the router saw"
                    )
        worker = self.process_faults.worker_recovery
        self.violations += [f"CRASHED: {c}" for c in self.crashed]
        self.violations += [f"engine died unasked: {c}" for c in self.engine_crashes]
        unrecovered = [f"{r.kind}@n{r.node}" for r in self.faults if not r.recovered_at_s]
        if unrecovered:
            self.violations.append(f"no verified pull through the node after: {unrecovered}")
        return {
            "seed": self.args.seed,
            "nodes": self.args.nodes,
            "minutes": self.args.minutes,
            "setup_s": round(setup_s, 1),
            "traffic_s": round(traffic_s, 1),
            "engines": [dict(e.shape, node=e.node, role=e.role, restarts=e.generation - 1) for e in self.engines],
            "pulls": t.pulls_done,
            "pulls_started": t.pulls_started,
            "pulls_failed": t.pulls_failed,
            "pulls_per_s": round(t.pulls_done / max(traffic_s, 1e-9), 1),
            "p50_ms": round(pct(0.50), 2),
            "p99_ms": round(pct(0.99), 2),
            "bytes": t.bytes,
            "wrong": t.wrong,
            "stale_reads": t.stale_reads,
            "done_after_lease_lost": t.done_after_lease_lost,
            "lost": t.pulls_lost,
            "crashed": len(self.crashed),
            "engine_crashes": len(self.engine_crashes),
            "conversations": t.conversations,
            "second_turns": t.second_turns,
            "turns_verified": t.turns_ok,
            "recomputed": t.recomputed,
            "retries": t.retries,
            "renewals": t.renewals,
            "releases": t.releases,
            "failures": dict(t.failures),
            "failures_by_op": dict(t.failure_ops),
            "engine_side": dict(t.engine_side),
            "refusals": dict(self.refusals),
            "faults": [dataclasses.asdict(r) for r in self.faults],
            "faults_by_kind": dict(Counter(r.kind for r in self.faults)),
            "recovered": sum(1 for r in self.faults if r.recovered_at_s),
            "recovery_s": sorted(round(r.recovered_at_s - r.healed_at_s, 1) for r in self.faults if r.recovered_at_s),
            "worker_recovery": worker,
            "worker_exact_pull_s": {
                kind: sorted(w["exact_pull_s"] for w in worker if w["kind"] == kind and w["exact_pull_s"] is not None)
                for kind in WORKER_FAULTS
            },
            "restarts": self.process_faults.restarts,
            "unseen_outcomes": {f"n{n}.{e}": c for (n, e), c in sorted(t.unseen_by_epoch.items())},
            "unseen": t.unseen,
            "probes": t.probes,
            "load": {"hogs": len(self.hogs), "loadavg_at_end": list(os.getloadavg())},
            "leaks": leaks,
            "metrics": metrics,
            "rss": rss,
            "shutdown": shutdown,
            "violations": self.violations,
        }


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("pulls done / started", f"{r['pulls']} / {r['pulls_started']}  ({r['pulls_per_s']}/s)"),
        ("latency p50 / p99", f"{r['p50_ms']} ms / {r['p99_ms']} ms"),
        ("bytes pulled", f"{r['bytes']:,}"),
        (
            "conversations / 2nd turns",
            f"{r['conversations']} / {r['second_turns']}  (verified turns {r['turns_verified']})",
        ),
        ("recomputed / retries", f"{r['recomputed']} / {r['retries']}"),
        ("lease renewals / releases", f"{r['renewals']} / {r['releases']}"),
        ("failures by class", ", ".join(f"{k}={v}" for k, v in sorted(r["failures"].items())) or "-"),
        ("engine-side", ", ".join(f"{k}={v}" for k, v in sorted(r["engine_side"].items())) or "-"),
        ("faults injected", ", ".join(f"{k}={v}" for k, v in sorted(r["faults_by_kind"].items())) or "-"),
        ("recoveries", f"{r['recovered']} of {len(r['faults'])}"),
        (
            "load",
            f"{r['load']['hogs']} busy processes, load average at the end "
            + "/".join(f"{x:.1f}" for x in r["load"]["loadavg_at_end"]),
        ),
        ("refused callers", ", ".join(f"{k}={v}" for k, v in sorted(r["refusals"].items())) or "-"),
    ]
    for name, row in r["rss"].items():
        rows.append(
            (
                f"RSS {name} MiB",
                "{} -> {} (staging {} -> {}, engine shm {} -> {}, own {} -> {}), fds {}".format(
                    *row["rss_mib"], *row["staging_mib"], *row["engine_shm_mib"], *row["rest_mib"], row["fds"]
                ),
            )
        )
    for w in r["worker_recovery"]:
        rows.append(
            (
                f"{w['kind']} n{w['node']} @{w['at_s']}s",
                f"{'mid-read' if w['mid_read'] else 'no pull in flight'}"
                f"{'' if w['spare'] else ', no spare worker yet'}: worker replaced in {w.get('replaced_s')}s "
                f"({w.get('reason')}), exact pull again after {w['exact_pull_s']}s",
            )
        )
    for row in r["restarts"]:
        rows.append(
            (
                f"restart n{row['node']} @{row['at_s']}s",
                f"exit {row['exit']} in {row['stop_s']}s, ready +{row['start_s']}s, engines registered "
                f"+{row['reregister_s']}s, exact pull {row['exact_pull_s']}s after SIGTERM",
            )
        )
    width = max(len(n) for n, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for v in r["violations"]:
        print(f"  VIOLATION: {v}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A fleet in a box: kvd daemons, engines, a router and faults.")
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="", help="report file (default: fleet-<seed>.json in the run folder's parent)")
    p.add_argument("--keep", action="store_true", help="keep the run folder (logs, certs) even when all held")
    p.add_argument("--load", action="store_true", help="one busy CPU hog per core beside the fleet, the whole run")
    p.add_argument(
        "--faults",
        default="",
        help=f"comma-separated fault kinds to inject (default: all of {','.join(FAULT_KINDS)})",
    )
    args = p.parse_args(argv)
    if args.nodes < 2:
        p.error("--nodes must be at least 2 (a prefill and a decode node)")
    unknown = sorted(set(filter(None, args.faults.split(","))) - set(FAULT_KINDS))
    if unknown or (args.faults and not args.faults.strip(",")):
        p.error(f"--faults: unknown kinds {unknown}; known: {', '.join(FAULT_KINDS)}")
    return args


_cleanups: list[Any] = []


def _interrupt(signum: int, _frame: object) -> None:
    """SIGINT, SIGTERM, SIGHUP: kill what the run started, remove its namespaces and shm, exit.

    Done right here, in the handler, rather than by unwinding: an interrupted event loop may wait
    on threads (a child's wait, a scrape) before any ``finally`` runs, and an interrupted run must
    leave nothing behind however it was stopped.
    """
    signal.signal(signum, signal.SIG_IGN)
    for cleanup in reversed(_cleanups):
        with contextlib.suppress(Exception):
            cleanup()
    print(f"\nfleet: interrupted by signal {signum}; everything it made was removed", flush=True)
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.geteuid() != 0:
        print("fleet: needs root (network namespaces)", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    print(
        f"fleet: seed {args.seed} (reproduce: scripts/fleet.py --nodes {args.nodes} --minutes {args.minutes:g} "
        f"--seed {args.seed}{' --load' if args.load else ''}{' --faults ' + args.faults if args.faults else ''})",
        flush=True,
    )
    netns.ensure_tools()
    removed = netns.clean_leftovers()
    if removed:
        print(f"fleet: removed leftovers of an earlier run: {len(removed)}", flush=True)
    run_dir = Path(f"/tmp/kvd-fleet-{os.getpid()}")
    run_dir.mkdir(parents=True)
    net = Network(args.nodes)
    fleet: Fleet | None = None
    result: dict[str, Any] | None = None

    def remove_shm() -> None:
        for path in netns.SHM_DIR.glob(f"{netns.PREFIX}-{os.getpid()}-*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    _cleanups.extend([remove_shm, lambda: shutil.rmtree(run_dir, ignore_errors=True), net.destroy])
    try:
        net.create()
        netns.enter(net.hub)
        fleet = Fleet(args, net, run_dir)
        _cleanups.append(lambda: _kill_all(fleet) if fleet is not None else None)
        result = asyncio.run(fleet.run())
    finally:
        if fleet is not None:
            _kill_all(fleet)
        net.destroy()
        remove_shm()
        _cleanups.clear()
    assert result is not None
    out = Path(args.json) if args.json else Path.cwd() / f"fleet-{args.seed}.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    print_table(result)
    ok = not result["violations"] and result["wrong"] == 0 and result["lost"] == 0 and result["crashed"] == 0
    if ok and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        (run_dir / netns.KEPT).touch()
        print(f"fleet: logs in {run_dir}")
    print(f"fleet: report {out}")
    print(
        f"fleet: pulls={result['pulls']} wrong={result['wrong']} lost={result['lost']} crashed={result['crashed']} "
        f"failed={result['pulls_failed']} recomputed={result['recomputed']} faults={len(result['faults'])} "
        f"recovered={result['recovered']} violations={len(result['violations'])} "
        f"pulls/s={result['pulls_per_s']} p50={result['p50_ms']}ms p99={result['p99_ms']}ms "
        f"seed={result['seed']}{' load' if args.load else ''} " + ("OK" if ok else "FAILED")
    )
    return 0 if ok else 1


def _kill_all(fleet: Fleet) -> None:
    """Whatever is still running (an interrupted run): SIGCONT, SIGKILL, by pid."""
    load.stop_hogs(fleet.hogs)
    procs = [e.process for e in fleet.engines] + [d.process for d in fleet.daemons]
    for p in procs:
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
    for p in procs:
        if p is not None:
            with contextlib.suppress(Exception):
                p.wait(10)


if __name__ == "__main__":
    sys.exit(main())
