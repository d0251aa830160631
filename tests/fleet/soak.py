"""The soak: two daemons, 2 MiB pulls both ways for N minutes; is each daemon's memory flat?

    python scripts/soak.py --minutes 30

Two ``kvd serve`` processes (default config, a spare worker each) and one engine on each
(``tests/fleet/engine.py``: shm KV, registered with its daemon, different layouts so that every
pull converts through the staging pool). Each iteration moves a fresh 512-token prompt (2 MiB of
KV) from each engine into the other at once, through the router's code (``fleet.router``: hold,
pull, per-chunk checksums verified). Every 10th iteration also makes a pull that is refused (a
lease that does not exist) and one that is cancelled right after it starts; every 25th, once
the traffic is idle, both engines unregister and register again on fresh shm files.

Every ``--sample-s`` seconds it reads, per daemon, the private memory (``RssAnon`` of
/proc/PID/status) of the control process and of each data-plane worker (its children, the spare
included), their open fds, and how many pulls the daemon has ended (``kvd_transfers_total``).

**Warm-up** lasts until both daemons have ended ``KEEP_FINISHED`` (4096) pulls, and at least
``max(2 min, 20 %)`` of the run: until then the daemon keeps a record of every finished pull (for
``GetTransfer`` and the watches after the end: docs/lifetimes.md, "Bounded caches and pools"), so
its memory grows with each pull by design, and the staging pool and the allocators' arenas fill.
At this machine's pace (3-4 pulls a second into each daemon) that takes about 20 minutes: a
shorter soak cannot say whether memory is flat, and says so. **Flat** means: for each daemon, the
least-squares slope of its total RssAnon (control + workers) over the samples after warm-up (at
least 5 minutes of them) is at most ``--flat-mib-per-min`` (0.25 MiB a minute: 15 MiB an hour),
and its fds at the end are at most their level at the end of warm-up + 4. The exit code is 0
only when both daemons are flat, every pull that should have been exact was, and every
refused/cancelled pull ended as documented.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet.router import ENGINE_SIDE, EngineRef, Router, engine_call
from kvd.core import metrics_text
from kvd.core.transfers import KEEP_FINISHED
from kvd.spawn import DaemonProcess, launch_daemon, wait_ready
from kvd_client import errors
from kvd_client.v1 import common_pb2

ENGINE_PY = Path(__file__).with_name("engine.py")
TOKENS = 512  # 512 tokens x 4 layers x K,V x 4 heads x 64 x 2 bytes = 2 MiB
SHAPES = (
    {"engine_id": "soak-a", "tp_size": 1, "block_size": 16, "layout": "NHD", "kv_format": "SPLIT", "num_blocks": 129},
    {"engine_id": "soak-b", "tp_size": 1, "block_size": 32, "layout": "HND", "kv_format": "JOINT", "num_blocks": 65},
)
MIB = 2**20


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (its data-plane workers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def pulls_ended(metrics: str) -> int:
    """How many pulls the daemon has ended (every outcome), from its /metrics."""
    text = metrics_text.fetch(metrics)
    return int(
        sum(
            v
            for n, lab, v in metrics_text.samples(text)
            if n == "kvd_transfers_total" and lab.get("direction") == "pull"
        )
    )


def sample(pid: int, metrics: str) -> dict[str, int]:
    """RssAnon and fds of the control process and its workers together (and apart), pulls ended."""
    control = rss_anon(pid)
    control_fds = len(os.listdir(f"/proc/{pid}/fd"))
    workers = workers_fds = 0
    for child in children(pid):
        with contextlib.suppress(OSError):
            workers += rss_anon(child)
            workers_fds += len(os.listdir(f"/proc/{child}/fd"))
    return {
        "control": control,
        "workers": workers,
        "total": control + workers,
        "fds": control_fds,
        "worker_fds": workers_fds,
        "pulls_ended": pulls_ended(metrics),
    }


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, in value per minute."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.duration = args.minutes * 60.0
        self.min_warmup = max(120.0, 0.2 * self.duration)
        self.warmup = self.duration  # learned from the samples (report)
        self.daemons: list[DaemonProcess] = []
        self.engines: list[subprocess.Popen[bytes]] = []
        self.refs: list[EngineRef] = []
        self.samples: list[tuple[float, list[dict[str, int]]]] = []
        self.iterations = 0
        self.reregistrations = 0
        self.refused: dict[str, int] = {}
        self.cancelled: dict[str, int] = {}
        self.problems: list[str] = []
        self.t0 = 0.0

    async def start(self) -> None:
        launches = [launch_daemon(self.work, name, ["--log-level", "WARNING"]) for name in ("d0", "d1")]
        self.daemons = [await asyncio.to_thread(wait_ready, launch, 120.0) for launch in launches]
        for i, (shape, daemon) in enumerate(zip(SHAPES, self.daemons, strict=True)):
            control = self.work / f"e{i}.ctl"
            config = {
                "shape": shape,
                "daemon_socket": daemon.unix_target,
                "control_socket": str(control),
                "shm_prefix": f"kvdsoak-{os.getpid()}-e{i}",
            }
            log = open(self.work / f"e{i}.log", "ab")  # noqa: SIM115 - the child owns it
            self.engines.append(
                subprocess.Popen([sys.executable, str(ENGINE_PY), json.dumps(config)], stdout=log, stderr=log)
            )
            log.close()
            self.refs.append(EngineRef(str(shape["engine_id"]), i, ("prefill", "decode")[i], 1, control))
        for ref, process in zip(self.refs, self.engines, strict=True):
            limit = time.monotonic() + 60.0
            while True:
                with contextlib.suppress(Exception):
                    if (await engine_call(ref, "status", timeout_s=2.0)).get("registered"):
                        break
                if process.poll() is not None or time.monotonic() > limit:
                    raise RuntimeError(f"engine {ref.engine_id} did not register")
                await asyncio.sleep(0.2)

    async def sampler(self) -> None:
        while True:
            row = [await asyncio.to_thread(sample, d.process.pid, d.metrics) for d in self.daemons]
            self.samples.append((time.monotonic() - self.t0, row))
            await asyncio.sleep(self.args.sample_s)

    async def odd_pulls(self, router: Router) -> None:
        """A refused pull (no such lease) and a cancelled one, each way's reader: daemon 1."""
        holder, reader = self.refs
        client = router.clients[1]
        alloc = await engine_call(reader, "alloc", req="odd", n=64)
        blocks = list(alloc["blocks"])
        try:
            remote = common_pb2.KvTransferParams(
                daemon_address=self.daemons[0].tcp, lease_id="no-such-lease", block_ids=[1, 2, 3, 4], num_tokens=64
            )
            outcome = await self._pull_outcome(client, "odd-refused", blocks[:4], remote, cancel=False)
            self.refused[outcome] = self.refused.get(outcome, 0) + 1
            if outcome not in ("UnknownLease", "InvalidArgument", "FailedPrecondition"):
                self.problems.append(f"refused pull ended {outcome}")
            tokens = [random.randrange(32000) for _ in range(TOKENS)]
            answer = await engine_call(holder, "prefill", req="odd-held", tokens=tokens, ttl_ms=10_000)
            params = common_pb2.KvTransferParams.FromString(base64.b64decode(answer["params"]))
            more = await engine_call(reader, "alloc", req="odd2", n=TOKENS)
            outcome = await self._pull_outcome(client, "odd-cancelled", list(more["blocks"]), params, cancel=True)
            self.cancelled[outcome] = self.cancelled.get(outcome, 0) + 1
            if outcome not in ("ABORTED", "DONE"):
                self.problems.append(f"cancelled pull ended {outcome}")
            with contextlib.suppress(errors.UnknownLease):
                await router.clients[0].release_lease(params.lease_id, timeout_s=5.0)
            await engine_call(reader, "free", req="odd2")
        finally:
            await engine_call(reader, "free", req="odd")

    async def _pull_outcome(
        self, client: Any, req: str, blocks: list[int], remote: common_pb2.KvTransferParams, cancel: bool
    ) -> str:
        try:
            started = await client.start_pull(
                engine_id=self.refs[1].engine_id,
                tp_rank=0,
                request_id=f"{req}{self.iterations}",
                local_block_ids=blocks,
                remote=remote,
                deadline_ms=8000,
            )
        except errors.KvdError as err:
            return type(err).__name__
        if cancel:
            with contextlib.suppress(errors.KvdError):
                await client.cancel_transfer(started.transfer_id)
        try:
            status = await client.wait_transfer(started.transfer_id, timeout_s=15.0)
        except errors.KvdError as err:
            if not cancel:
                return type(err).__name__
            status = await client.get_transfer(started.transfer_id)
            if status.state == common_pb2.TRANSFER_STATE_ABORTED:
                return "ABORTED"
            return status.error_class or common_pb2.TransferState.Name(status.state)
        return "DONE" if status.state == common_pb2.TRANSFER_STATE_DONE else status.error_class

    async def traffic(self, router: Router) -> None:
        a, b = self.refs
        end = self.t0 + self.duration
        while time.monotonic() < end:
            self.iterations += 1
            results = await asyncio.gather(router.probe(a, b, TOKENS), router.probe(b, a, TOKENS))
            if not all(results):
                self.problems.append(f"iteration {self.iterations}: moves {results} (True = pulled, exact)")
            if self.iterations % 10 == 0:
                await self.odd_pulls(router)
            if self.iterations % 25 == 0:
                await asyncio.gather(*(engine_call(r, "reregister", timeout_s=60.0) for r in self.refs))
                self.reregistrations += 1

    async def run(self) -> dict[str, Any]:
        await self.start()
        router = Router(
            self.refs,
            [d.tcp for d in self.daemons],
            None,  # type: ignore[arg-type] - plaintext: the soak's daemons have no TLS
            lambda _node: 1,
            random.Random(self.args.seed),
            4.0,
            8.0,
        )
        await router.open()
        self.t0 = time.monotonic()
        sampler = asyncio.create_task(self.sampler())
        try:
            await self.traffic(router)
        finally:
            sampler.cancel()
            await router.close()
        return self.report(router)

    def report(self, router: Router) -> dict[str, Any]:
        t = router.tally
        warm = [
            s for s, row in self.samples if s >= self.min_warmup and min(r["pulls_ended"] for r in row) >= KEEP_FINISHED
        ]
        self.warmup = warm[0] if warm else self.duration
        window_s = self.samples[-1][0] - self.warmup if warm else 0.0
        if not warm:
            ended = [r["pulls_ended"] for r in self.samples[-1][1]]
            self.problems.append(
                f"warm-up not over: the daemons ended {ended} pulls, {KEEP_FINISHED} each are needed: run longer"
            )
        elif window_s < 300.0:
            self.problems.append(
                f"warm-up ended at {self.warmup:.0f}s ({KEEP_FINISHED} pulls ended by each daemon): "
                f"{window_s:.0f}s after it, less than the 5 minutes flatness needs: run longer"
            )
        daemons = []
        for i in range(len(self.daemons)):
            settled = [(s, row[i]) for s, row in self.samples if s >= self.warmup]
            slope = slope_per_min([(s, row["total"] / MIB) for s, row in settled])
            first = settled[0][1] if settled else self.samples[-1][1][i]
            last = self.samples[-1][1][i]
            fds_ok = last["fds"] <= first["fds"] + 4 and last["worker_fds"] <= first["worker_fds"] + 4
            flat = bool(settled) and slope <= self.args.flat_mib_per_min and fds_ok
            daemons.append(
                {
                    "daemon": f"d{i}",
                    "start_mib": round(self.samples[0][1][i]["total"] / MIB, 1),
                    "after_warmup_mib": round(first["total"] / MIB, 1),
                    "end_mib": round(last["total"] / MIB, 1),
                    "slope_after_warmup_mib_per_min": round(slope, 3),
                    "control_mib": [
                        round(self.samples[0][1][i]["control"] / MIB, 1),
                        round(first["control"] / MIB, 1),
                        round(last["control"] / MIB, 1),
                    ],
                    "pulls_ended": last["pulls_ended"],
                    "fds": [self.samples[0][1][i]["fds"], first["fds"], last["fds"]],
                    "worker_fds": [self.samples[0][1][i]["worker_fds"], first["worker_fds"], last["worker_fds"]],
                    "flat": flat,
                }
            )
            if not flat:
                self.problems.append(
                    f"d{i}: not flat after warm-up: slope {slope:.3f} MiB/min "
                    f"(at most {self.args.flat_mib_per_min}), fds {first['fds']} -> {last['fds']}, "
                    f"worker fds {first['worker_fds']} -> {last['worker_fds']}"
                )
        if t.wrong or t.undocumented:
            self.problems += [f"wrong={t.wrong}", *t.undocumented[:10]]
        failures = {k: v for k, v in t.failures.items() if k not in ENGINE_SIDE}
        if failures or t.engine_side:
            self.problems.append(f"pulls failed on a quiet machine: {failures} {dict(t.engine_side)}")
        return {
            "minutes": self.args.minutes,
            "seed": self.args.seed,
            "warmup_s": self.warmup,
            "flatness": f"slope of RssAnon (control + workers) after warm-up (>= 5 min of it) <= "
            f"{self.args.flat_mib_per_min} MiB/min, fds at the end <= after warm-up + 4",
            "iterations": self.iterations,
            "pulls": t.pulls_done,
            "pulls_failed": t.pulls_failed,
            "bytes": t.bytes,
            "wrong": t.wrong,
            "refused": self.refused,
            "cancelled": self.cancelled,
            "reregistrations": self.reregistrations,
            "daemons": daemons,
            "samples": [{"t": round(s, 1), **{f"d{i}": row[i] for i in range(len(row))}} for s, row in self.samples],
            "problems": self.problems,
        }

    def stop(self) -> None:
        for e in self.engines:
            if e.poll() is None:
                e.send_signal(signal.SIGTERM)
        for e in self.engines:
            with contextlib.suppress(subprocess.TimeoutExpired):
                e.wait(15)
            if e.poll() is None:
                e.kill()
        codes = [d.terminate() for d in self.daemons]
        if any(codes):
            self.problems.append(f"daemons exited {codes} on SIGTERM")
        for path in Path("/dev/shm").glob(f"kvdsoak-{os.getpid()}-*"):
            self.problems.append(f"/dev/shm file left: {path.name}")
            path.unlink(missing_ok=True)


def print_report(r: dict[str, Any], every_s: float = 60.0) -> None:
    print(
        f"soak: {r['minutes']} min, {r['iterations']} iterations, {r['pulls']} pulls exact "
        f"({r['bytes'] / MIB:.0f} MiB), failed {r['pulls_failed']}, wrong {r['wrong']}, "
        f"refused {r['refused']}, cancelled {r['cancelled']}, re-registrations {r['reregistrations']}"
    )
    print(f"  warm-up {r['warmup_s']:.0f}s (until {KEEP_FINISHED} pulls ended by each daemon); flat: {r['flatness']}")
    print("  t(min)  " + "  ".join(f"{d:>30}" for d in ("d0 RssAnon MiB ctl+wrk, fds", "d1 RssAnon MiB ctl+wrk, fds")))
    next_t = 0.0
    for s in r["samples"]:
        if s["t"] + 1e-9 < next_t and s is not r["samples"][-1]:
            continue
        next_t = s["t"] + every_s
        cells = []
        for d in ("d0", "d1"):
            x = s[d]
            cells.append(
                f"{x['total'] / MIB:7.1f} ({x['control'] / MIB:5.1f}+{x['workers'] / MIB:5.1f}) "
                f"{x['fds']:3d}/{x['worker_fds']:3d}"
            )
        print(f"  {s['t'] / 60:6.1f}  " + "  ".join(f"{c:>30}" for c in cells))
    for d in r["daemons"]:
        print(
            f"  {d['daemon']}: {d['start_mib']} -> {d['after_warmup_mib']} (after warm-up) -> {d['end_mib']} MiB, "
            f"slope after warm-up {d['slope_after_warmup_mib_per_min']} MiB/min (control process "
            f"{' -> '.join(map(str, d['control_mib']))} MiB), {d['pulls_ended']} pulls ended, fds {d['fds']}, "
            f"worker fds {d['worker_fds']}: {'flat' if d['flat'] else 'NOT FLAT'}"
        )
    for p in r["problems"]:
        print(f"  PROBLEM: {p}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvd soak: two daemons, 2 MiB pulls both ways; memory flat?")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--flat-mib-per-min", type=float, default=0.25)
    p.add_argument("--json", default="", help="report file (default: soak-<seed>.json here)")
    args = p.parse_args(argv)
    random.seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
    soak = Soak(args, work)
    print(f"soak: {args.minutes:g} min, seed {args.seed}, logs in {work}", flush=True)
    try:
        result = asyncio.run(soak.run())
    finally:
        soak.stop()
    result["problems"] = soak.problems
    out = Path(args.json) if args.json else Path.cwd() / f"soak-{args.seed}.json"
    out.write_text(json.dumps(result, indent=2))
    print_report(result)
    ok = not soak.problems
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    print(f"soak: report {out}; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1
