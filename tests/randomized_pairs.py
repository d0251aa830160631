"""Randomized cross-check: engines that come and go on both daemons, pulls between them, every byte checked.

Two real daemons. Workers (1 or several in parallel) each loop over *cases*: a random model
(format, heads, head size, dtype, layers), a holder engine of random layout / block size / TP
registered on one daemon *now* (after the other daemon first handshook it), a reader engine of
its own layout / block size / TP on the other daemon (a quarter of the cases: on the same daemon,
both engines on one node), then one to a few pulls of random blocks
and token counts, or (half the cases) 2-6 pulls as one engine step, one StartPulls per reader
rank, into disjoint blocks that are adjacent across pulls in half of those steps (their READs
share NIXL transfers: kvd.core.step_reads); the holder engine is unregistered (or left to a later
case) afterwards, so the holder's registered memory changes under the reader's cached handshake
all the time.

Each pull's result is compared, head by head, with the holder's logical KV computed by
:mod:`kvd.layout.oracle` straight from the layouts' definition (no descriptor, plan or run), and
bytes outside the pulled tokens must keep their fill. A failing case prints its seed and case
number: ``python tests/randomized_pairs.py --seed S --parallel P`` replays the same cases (each
case's randomness comes from ``(seed, worker, case)`` alone).

Used by ``tests/integration/test_randomized_pairs.py`` (bounded in CI; longer on demand).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvd.layout import oracle
from kvd.layout.plan import EngineView
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements
from kvd.server import convert
from kvd.spawn import DaemonProcess, launch_daemon, wait_ready
from kvd_client import KvdClient, errors
from kvd_client.shm import create_shm_tensor, new_shm_name, unlink_shm
from kvd_client.v1 import common_pb2, router_pb2

FILL = 0x5A


@dataclasses.dataclass(frozen=True)
class Model:
    kv_format: KvFormat
    total_heads: int
    head_dim: int
    dtype: str
    num_layers: int


@dataclasses.dataclass(frozen=True)
class Side:
    layout: KvLayout
    block_size: int
    tp_size: int


@dataclasses.dataclass
class Outcome:
    pulls: int = 0
    exact: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)


def random_model(rng: random.Random) -> Model:
    kv_format = rng.choice([KvFormat.SPLIT, KvFormat.SPLIT, KvFormat.JOINT, KvFormat.MLA])
    return Model(
        kv_format=kv_format,
        total_heads=1 if kv_format is KvFormat.MLA else rng.choice([1, 2, 4, 8]),
        head_dim=rng.choice([16, 32, 64]),
        dtype=rng.choice(["float16", "bfloat16", "float32"]),
        num_layers=rng.randint(1, 3),
    )


def random_side(rng: random.Random, model: Model) -> Side:
    mla = model.kv_format is KvFormat.MLA
    heads = model.total_heads
    tp_choices = [1, 2, 4] if mla else [t for t in (1, 2, 4) if t % heads == 0 or heads % t == 0]
    return Side(
        layout=KvLayout.NHD if mla else rng.choice([KvLayout.NHD, KvLayout.HND]),
        block_size=rng.choice([8, 16, 32, 64]),
        tp_size=rng.choice(tp_choices),
    )


def spec_of(model: Model, side: Side, rank: int, num_blocks: int) -> LayoutSpec:
    mla = model.kv_format is KvFormat.MLA
    return LayoutSpec(
        num_layers=model.num_layers,
        kv_format=model.kv_format,
        layout=side.layout,
        block_size=side.block_size,
        num_kv_heads=1 if mla else max(1, model.total_heads // side.tp_size),
        total_num_kv_heads=1 if mla else model.total_heads,
        head_dim=model.head_dim,
        dtype=model.dtype,
        num_blocks=num_blocks,
        tp_rank=rank,
        tp_size=side.tp_size,
    )


class Engine:
    """One engine rank whose KV lives in POSIX shared memory: one region for every layer, or one
    region per layer (as vLLM allocates it), created in a random order so their addresses are too."""

    def __init__(self, target: str, engine_id: str, spec: LayoutSpec, per_layer: bool, rng: random.Random) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.client = KvdClient(target, timeout_s=30)
        self.registered = False
        if per_layer:
            one = dataclasses.replace(spec, num_layers=1)
            sizes = [one.total_bytes] * spec.num_layers
            self.placements = [
                dataclasses.replace(contiguous_placements(one)[0], region=layer) for layer in range(spec.num_layers)
            ]
        else:
            sizes = [spec.total_bytes]
            self.placements = list(contiguous_placements(spec))
        self.names = [new_shm_name("kvdrand") for _ in sizes]
        order = list(range(len(sizes)))
        rng.shuffle(order)
        buffers: dict[int, torch.Tensor] = {i: create_shm_tensor(self.names[i], sizes[i]) for i in order}
        self.buffers = [buffers[i] for i in range(len(sizes))]

    @property
    def view(self) -> EngineView:
        return EngineView(self.spec, tuple(self.placements))

    def register(self) -> None:
        self.client.register_kv_cache(
            engine_id=self.engine_id,
            layout=convert.layout_to_pb(self.spec),
            regions=[
                common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=b.numel(), shm_name=name)
                for b, name in zip(self.buffers, self.names, strict=True)
            ],
            layers=[convert.placement_to_pb(p) for p in self.placements],
        )
        self.registered = True

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for buffer in self.buffers:
            buffer.copy_(torch.randint(0, 256, (buffer.numel(),), dtype=torch.uint8, generator=generator))

    def copy_from(self, other: Engine) -> None:
        for mine, theirs in zip(self.buffers, other.buffers, strict=True):
            mine.copy_(theirs)

    def fill(self, value: int) -> None:
        for buffer in self.buffers:
            buffer.fill_(value)

    def outside_all_untouched(self, pulls: Sequence[tuple[Sequence[int], int]], value: int) -> bool:
        """Every byte outside the tokens of every pull (its blocks, its token count) holds ``value``."""
        sizes = [b.numel() for b in self.buffers]
        masks = [oracle.token_mask(sizes, self.view, block_ids, num_tokens) for block_ids, num_tokens in pulls]
        return all(
            bool((buffer[~torch.from_numpy(np.logical_or.reduce([m[i] for m in masks]))] == value).all())
            for i, buffer in enumerate(self.buffers)
        )

    def close(self) -> None:
        if self.registered:
            with contextlib.suppress(errors.KvdError):
                self.client.unregister_kv_cache(engine_id=self.engine_id, tp_rank=self.spec.tp_rank)
        self.client.close()
        for name in self.names:
            unlink_shm(name)


def _wait_done(reader: Engine, transfer_ids: Sequence[str]) -> None:
    """Wait for each transfer on ``reader``; AssertionError for one that did not end DONE."""
    for transfer_id in transfer_ids:
        status = reader.client.wait_transfer(transfer_id, timeout_s=60)
        if status.state != common_pb2.TRANSFER_STATE_DONE:
            raise AssertionError(f"transfer ended {status.state}: {status.error_message}")


def logical_heads(engines: Sequence[Engine], block_ids: Sequence[int], num_tokens: int) -> dict[int, torch.Tensor]:
    """Model-global head -> its logical KV ``[layers, planes, tokens, head_bytes]`` (oracle)."""
    heads: dict[int, torch.Tensor] = {}
    for engine in engines:
        data = oracle.gather(engine.buffers, engine.view, block_ids, num_tokens)
        for i, head in enumerate(oracle.head_ids(engine.view)):
            heads.setdefault(head, data[:, :, :, i])
    return heads


SAME_DAEMON_SHARE = 0.25  # cases whose reader engine is on the holder's daemon (one node)
STEP_SHARE = 0.5  # cases whose pulls are one engine step (one StartPulls per reader rank)


class Worker:
    """One loop of cases between two daemons; its randomness is ``(seed, index, case)`` only."""

    def __init__(self, daemons: Sequence[DaemonProcess], seed: int, index: int, outcome: Outcome) -> None:
        self.daemons = daemons
        self.seed = seed
        self.index = index
        self.outcome = outcome
        self.lock = threading.Lock()
        self.kept: list[list[Engine]] = []  # holder engines left registered for later cases

    def run(self, until: Callable[[], bool]) -> None:
        case = 0
        try:
            while not until():
                self.run_case(case)
                case += 1
        finally:
            self.close_kept(0)

    def close_kept(self, keep: int) -> None:
        while len(self.kept) > keep:
            for engine in self.kept.pop(0):
                engine.close()

    def run_case(self, case: int) -> None:
        rng = random.Random(f"{self.seed}/{self.index}/{case}")
        model = random_model(rng)
        holder_side, reader_side = random_side(rng, model), random_side(rng, model)
        holder_at = rng.randrange(len(self.daemons))
        holder_daemon, reader_daemon = self.daemons[holder_at], self.daemons[1 - holder_at]
        if rng.random() < SAME_DAEMON_SHARE:  # both engines on one node: the daemon pulls from itself
            reader_daemon = holder_daemon
        tag = f"w{self.index}c{case}"
        span = rng.choice([256, 1024, 4096, 16384])  # tokens each engine can hold
        per_layer = rng.random() < 0.5, rng.random() < 0.5

        def ranks(daemon: DaemonProcess, engine_id: str, side: Side, one_region_per_layer: bool) -> list[Engine]:
            return [
                Engine(
                    daemon.unix_target,
                    engine_id,
                    spec_of(model, side, r, span // side.block_size),
                    one_region_per_layer,
                    rng,
                )
                for r in range(side.tp_size)
            ]

        holders = ranks(holder_daemon, f"p-{tag}", holder_side, per_layer[0])
        readers = ranks(reader_daemon, f"d-{tag}", reader_side, per_layer[1])
        describe = (
            f"seed {self.seed} worker {self.index} case {case}: {model.kv_format.name} heads {model.total_heads} "
            f"head_dim {model.head_dim} {model.dtype} layers {model.num_layers}; holder "
            f"{holder_side.layout.name}/{holder_side.block_size}/TP{holder_side.tp_size} on {holder_daemon.name}, "
            f"reader {reader_side.layout.name}/{reader_side.block_size}/TP{reader_side.tp_size} "
            f"on {reader_daemon.name}"
        )
        try:
            for engine in holders:
                engine.register()
                engine.fill_random(rng.randrange(1 << 30) + engine.spec.head_range()[0])
            if model.kv_format is not KvFormat.MLA:
                # Replicas of one head (TP above the head count) hold the same KV, as in a real engine.
                first_of: dict[int, Engine] = {}
                for engine in holders:
                    source = first_of.setdefault(engine.spec.head_range()[0], engine)
                    if source is not engine:
                        engine.copy_from(source)
            else:
                for engine in holders[1:]:
                    engine.copy_from(holders[0])
            for engine in readers:
                engine.register()
            if rng.random() < STEP_SHARE:  # the case's pulls as one engine step: one StartPulls per reader rank
                self.step_pulls(rng, holders, readers, f"{describe}, one step")
            else:
                for pull in range(rng.randint(1, 4)):
                    self.one_pull(rng, holders, readers, f"{describe}, pull {pull}")
        finally:
            keep = rng.random() < 0.5
            for engine in readers if keep else holders + readers:
                engine.close()
        if keep:  # the holder stays registered for a few more cases: memory comes and goes unevenly
            self.kept.append(holders)
            self.close_kept(rng.randint(0, 4))

    def one_pull(self, rng: random.Random, holders: list[Engine], readers: list[Engine], describe: str) -> None:
        h_spec, r_spec = holders[0].spec, readers[0].spec
        capacity = min(h_spec.num_blocks * h_spec.block_size, r_spec.num_blocks * r_spec.block_size)
        num_tokens = rng.randint(1, min(600, capacity))
        remote_blocks = rng.sample(range(h_spec.num_blocks), h_spec.blocks_for(num_tokens))
        local_blocks = rng.sample(range(r_spec.num_blocks), r_spec.blocks_for(num_tokens))
        for engine in readers:
            engine.fill(FILL)
        request = f"req-{rng.randrange(1 << 40):x}"
        with self.lock:
            self.outcome.pulls += 1
        try:
            params = (
                holders[0]
                .client.hold_blocks(
                    engine_id=holders[0].engine_id, request_id=request, block_ids=remote_blocks, num_tokens=num_tokens
                )
                .kv_transfer_params
            )
            started = [
                reader.client.start_pull(
                    engine_id=reader.engine_id,
                    tp_rank=reader.spec.tp_rank,
                    request_id=request,
                    local_block_ids=local_blocks,
                    remote=params,
                )
                for reader in readers
            ]
            for reader, transfer in zip(readers, started, strict=True):
                _wait_done(reader, [transfer.transfer_id])
        except (errors.KvdError, AssertionError) as exc:
            self.fail(f"{describe}: {type(exc).__name__}: {exc}")
            return
        self._check_exact(holders, readers, [(remote_blocks, local_blocks, num_tokens)], describe)

    def step_pulls(self, rng: random.Random, holders: list[Engine], readers: list[Engine], describe: str) -> None:
        """2-6 pulls of one engine step (one StartPulls per reader rank: their READs from one holder
        rank may share a NIXL transfer, kvd.core.step_reads), into disjoint local blocks; in half
        the steps both sides' blocks are handed out in order (adjacent across pulls), else at random."""
        h_spec, r_spec = holders[0].spec, readers[0].spec
        count = min(rng.randint(2, 6), h_spec.num_blocks, r_spec.num_blocks)
        if count < 2:  # engines of one or two large blocks: a step of one
            self.one_pull(rng, holders, readers, describe)
            return
        most = min(
            300, (h_spec.num_blocks // count) * h_spec.block_size, (r_spec.num_blocks // count) * r_spec.block_size
        )
        tokens = [rng.randint(1, most) for _ in range(count)]
        local_need = [r_spec.blocks_for(n) for n in tokens]
        remote_need = [h_spec.blocks_for(n) for n in tokens]
        adjacent = rng.random() < 0.5
        if adjacent:
            local_start = rng.randrange(r_spec.num_blocks - sum(local_need) + 1)
            remote_start = rng.randrange(h_spec.num_blocks - sum(remote_need) + 1)
            local_pool = list(range(local_start, local_start + sum(local_need)))
            remote_pool = list(range(remote_start, remote_start + sum(remote_need)))
        else:
            local_pool = rng.sample(range(r_spec.num_blocks), sum(local_need))
            remote_pool = rng.sample(range(h_spec.num_blocks), sum(remote_need))
        cuts_l = [sum(local_need[:i]) for i in range(count + 1)]
        cuts_r = [sum(remote_need[:i]) for i in range(count + 1)]
        pulls = [
            (
                f"req-{rng.randrange(1 << 40):x}",
                remote_pool[cuts_r[i] : cuts_r[i + 1]],
                local_pool[cuts_l[i] : cuts_l[i + 1]],
                tokens[i],
            )
            for i in range(count)
        ]
        describe = f"{describe} of {count} pulls ({'adjacent' if adjacent else 'random'} blocks)"
        for engine in readers:
            engine.fill(FILL)
        with self.lock:
            self.outcome.pulls += count
        try:
            params = [
                holders[0]
                .client.hold_blocks(
                    engine_id=holders[0].engine_id, request_id=request, block_ids=remote, num_tokens=num_tokens
                )
                .kv_transfer_params
                for request, remote, _, num_tokens in pulls
            ]
            started = []
            for reader in readers:
                results = reader.client.start_pulls(
                    [
                        router_pb2.StartPullRequest(
                            engine_id=reader.engine_id,
                            tp_rank=reader.spec.tp_rank,
                            request_id=request,
                            local_block_ids=local,
                            remote=held,
                        )
                        for (request, _, local, _), held in zip(pulls, params, strict=True)
                    ]
                )
                for result in results:
                    if isinstance(result, errors.KvdError):
                        raise result
                started.append(results)
            for reader, transfer_ids in zip(readers, started, strict=True):
                _wait_done(reader, transfer_ids)
        except (errors.KvdError, AssertionError) as exc:
            self.fail(f"{describe}: {type(exc).__name__}: {exc}")
            return
        self._check_exact(holders, readers, [(remote, local, n) for _, remote, local, n in pulls], describe)

    def _check_exact(
        self,
        holders: list[Engine],
        readers: list[Engine],
        pulls: Sequence[tuple[Sequence[int], Sequence[int], int]],
        describe: str,
    ) -> None:
        """Every pull's (remote blocks, local blocks, tokens) against the oracle, and every byte
        outside all of them kept: counted exact, or one failure named after the first difference."""
        for index, (remote, local, num_tokens) in enumerate(pulls):
            expected = logical_heads(holders, remote, num_tokens)
            got = logical_heads(readers, local, num_tokens)
            for head, tensor in got.items():
                if not torch.equal(tensor, expected[head]):
                    which = f"pull {index}, " if len(pulls) > 1 else ""
                    self.fail(f"{describe}: {which}head {head} differs from the holder's ({num_tokens} tokens)")
                    return
        for reader in readers:
            if not reader.outside_all_untouched([(local, n) for _, local, n in pulls], FILL):
                self.fail(f"{describe}: bytes outside the pulled tokens were written on rank {reader.spec.tp_rank}")
                return
        with self.lock:
            self.outcome.exact += len(pulls)

    def fail(self, message: str) -> None:
        with self.lock:
            self.outcome.failures.append(message)
        print(f"FAILED {message}", flush=True)


def run(
    daemons: Sequence[DaemonProcess],
    seed: int,
    parallel: int,
    *,
    pulls: int = 0,
    seconds: float = 0.0,
    cases: int = 0,
) -> Outcome:
    """Run ``parallel`` workers until ``pulls`` pulls were started or ``seconds`` passed (or each ran
    ``cases`` cases, for a replay). Every case's randomness depends on the seed alone."""
    outcome = Outcome()
    started = time.monotonic()
    workers = [Worker(daemons, seed, i, outcome) for i in range(parallel)]

    def done() -> bool:
        return bool((pulls and outcome.pulls >= pulls) or (seconds and time.monotonic() - started >= seconds))

    def loop(worker: Worker) -> None:
        try:
            if cases:
                for case in range(cases):
                    worker.run_case(case)
            else:
                worker.run(done)
        except Exception:  # noqa: BLE001 - a broken worker is a failed check, never a silent thread
            worker.fail(f"seed {seed} worker {worker.index} broke:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=loop, args=(w,), name=f"case-worker-{w.index}") for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 31))
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--pulls", type=int, default=0, help="stop after this many pulls (default: --seconds)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cases", type=int, default=0, help="replay exactly this many cases per worker")
    parser.add_argument("--ucx-tls", default="", help="UCX_TLS for both daemons (e.g. tcp)")
    args = parser.parse_args()
    env = None
    if args.ucx_tls:
        import os

        env = {**os.environ, "UCX_TLS": args.ucx_tls}
    print(f"randomized pairs: seed {args.seed}, {args.parallel} in parallel", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvd-random-") as workdir:
        launches = [launch_daemon(Path(workdir), name, env=env) for name in ("a", "b")]
        daemons = [wait_ready(launch) for launch in launches]
        try:
            outcome = run(
                daemons,
                args.seed,
                args.parallel,
                pulls=args.pulls,
                seconds=0.0 if (args.pulls or args.cases) else args.seconds,
                cases=args.cases,
            )
        finally:
            codes = [daemon.terminate() for daemon in daemons]
    print(
        f"randomized pairs: seed {args.seed}: {outcome.pulls} pulls, {outcome.exact} exact, "
        f"{len(outcome.failures)} failed; daemons exited {codes}"
    )
    return 0 if not outcome.failures and all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
