"""Benchmark of heterogeneous pulls: descriptors per request and conversion speed.

Part of ``kvd bench`` (its conversion table, :func:`measure_pairs`), and on its own:
``python -m kvd.bench.convert [--tokens 1024] [--repeat 5] [--device cpu|cuda] [--json PATH]``
(``--json``: the rows of :func:`measure_pairs` for machines; the GPU check kit runs it on CUDA).

For each pair of engines (Llama-3-8B's KV: 32 layers, 8 KV heads, head_dim 128, bf16; MLA rows
use DeepSeek-V3's 576-wide latent), one 1k-token request with contiguous blocks:

* the plan: direct or staged, NIXL descriptors posted, mean descriptor size, staging bytes,
  planning time;
* for staged pairs, the conversion (``plan.postprocess.run``) on the engine's device against
  torch ``copy_`` of the same bytes (staging -> a buffer of the same size), measured in the same
  run on the same bytes, samples interleaved so both see the same machine load; the ratio is
  conversion GB/s / copy GB/s (goal >= 0.8 on host memory);
* with NIXL importable (host memory only), a real pull: two NIXL agents in this process (UCX
  loopback), descriptor tables prepared once per geometry as the daemon does, then per pull the
  READs, the wait and the conversion; pull GB/s, and its ratio to the same-layout pull (the
  first row), interleaved sample by sample. Loopback makes reads cheap, so this exposes the
  per-descriptor and conversion costs rather than a network's.

Direct pairs have no conversion: NIXL writes the engine's blocks, so their cost is the reads.
Not a timed test: numbers depend on the machine; the script prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvd.layout.geometry import DescGeometry
from kvd.layout.plan import EngineView, PullPlan, Target, plan_pull
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements

SPLIT, JOINT, MLA = KvFormat.SPLIT, KvFormat.JOINT, KvFormat.MLA
NHD, HND = KvLayout.NHD, KvLayout.HND


@dataclasses.dataclass(frozen=True)
class Engine:
    kv_format: KvFormat
    layout: KvLayout
    block_size: int
    tp_size: int = 1

    def label(self) -> str:
        return f"{self.kv_format.name[0]}{self.layout.name}{self.block_size}/tp{self.tp_size}"


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    remote: Engine
    local: Engine
    local_rank: int = 0


PAIRS = [
    Pair("same layout (baseline)", Engine(SPLIT, NHD, 16), Engine(SPLIT, NHD, 16)),
    Pair("NHD -> HND", Engine(SPLIT, NHD, 16), Engine(SPLIT, HND, 16)),
    Pair("HND -> NHD", Engine(SPLIT, HND, 16), Engine(SPLIT, NHD, 16)),
    Pair("joint HND -> split NHD", Engine(JOINT, HND, 16), Engine(SPLIT, NHD, 16)),
    Pair("block 16 -> 64 (NHD)", Engine(SPLIT, NHD, 16), Engine(SPLIT, NHD, 64)),
    Pair("block 64 -> 16 (NHD)", Engine(SPLIT, NHD, 64), Engine(SPLIT, NHD, 16)),
    Pair("block 16 -> 64 (HND)", Engine(SPLIT, HND, 16), Engine(SPLIT, HND, 64)),
    Pair("block 64 -> 16 + HND -> NHD", Engine(SPLIT, HND, 64), Engine(SPLIT, NHD, 16)),
    Pair("TP 2 -> 1 (NHD)", Engine(SPLIT, NHD, 16, 2), Engine(SPLIT, NHD, 16, 1)),
    Pair("TP 2 -> 1 (HND)", Engine(SPLIT, HND, 16, 2), Engine(SPLIT, HND, 16, 1)),
    Pair("TP 1 -> 2 (HND)", Engine(SPLIT, HND, 16, 1), Engine(SPLIT, HND, 16, 2)),
    Pair("TP 1 -> 2 (NHD)", Engine(SPLIT, NHD, 16, 1), Engine(SPLIT, NHD, 16, 2)),
    Pair("TP 16 -> 8 (replicas)", Engine(SPLIT, NHD, 16, 16), Engine(SPLIT, NHD, 16, 8)),
    Pair("TP 4 HND 64 -> TP 2 NHD 16", Engine(JOINT, HND, 64, 4), Engine(SPLIT, NHD, 16, 2)),
    Pair("MLA block 64 -> 16, TP 8 -> 1", Engine(MLA, NHD, 64, 8), Engine(MLA, NHD, 16, 1)),
]


def spec_of(engine: Engine, rank: int, num_blocks: int) -> LayoutSpec:
    mla = engine.kv_format is MLA
    total = 1 if mla else 8
    return LayoutSpec(
        num_layers=32,
        kv_format=engine.kv_format,
        layout=engine.layout,
        block_size=engine.block_size,
        num_kv_heads=1 if mla else max(1, total // engine.tp_size),
        head_dim=576 if mla else 128,
        dtype="bfloat16",
        num_blocks=num_blocks,
        total_num_kv_heads=total,
        tp_rank=rank,
        tp_size=engine.tp_size,
    )


def view_of(spec: LayoutSpec) -> EngineView:
    return EngineView(spec, tuple(contiguous_placements(spec)))


def plan_for(
    pair: Pair, tokens: int, threshold: int, repeat: int = 5
) -> tuple[PullPlan, EngineView, dict[int, EngineView], float, float]:
    """Plan the pull; blocks contiguous on both sides, the engines twice the request's size.

    Returns the plan, the views, and the planning seconds: first call (descriptor tables built)
    and the median of ``repeat`` more (tables cached, as for every later pull between the pair).
    """
    remote_blocks = -(-tokens // pair.remote.block_size)
    local_blocks = -(-tokens // pair.local.block_size)
    remote = {rank: view_of(spec_of(pair.remote, rank, 2 * remote_blocks)) for rank in range(pair.remote.tp_size)}
    local = view_of(spec_of(pair.local, pair.local_rank, 2 * local_blocks))
    args = (remote, local, list(range(remote_blocks)), list(range(local_blocks, 2 * local_blocks)), tokens)
    start = time.perf_counter()
    plan = plan_pull(*args, direct_read_min_bytes=threshold)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(repeat):
        start = time.perf_counter()
        plan_pull(*args, direct_read_min_bytes=threshold)
        warm.append(time.perf_counter() - start)
    return plan, local, remote, cold, statistics.median(warm)


def interleaved(fns: list[Callable[[], object]], repeat: int, device: torch.device) -> list[float]:
    """Median seconds of each of ``fns``, sampled in turn so that all see the same load."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up
        fn()
    sync()
    for _ in range(repeat):
        for fn, out in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - start)
    return [statistics.median(out) for out in samples]


def measure_conversion(plan: PullPlan, local: EngineView, repeat: int, device: torch.device) -> tuple[float, float]:
    """(conversion GB/s, copy_ GB/s) over the bytes the conversion writes, on the same staging."""
    assert plan.postprocess is not None
    staging = torch.randint(0, 256, (plan.staging_bytes,), dtype=torch.uint8, device=device)
    engine = [torch.zeros(local.spec.total_bytes, dtype=torch.uint8, device=device)]
    buffer = torch.empty_like(staging)
    nbytes = plan.postprocess.nbytes  # type: ignore[attr-defined]
    postprocess = plan.postprocess
    convert, copy = interleaved(
        [lambda: postprocess.run(staging, engine), lambda: buffer.copy_(staging)], repeat, device
    )
    return nbytes / convert / 1e9, staging.numel() / copy / 1e9


class NixlPull:
    """One pull's memory on two NIXL agents (UCX loopback), tables prepared once, as the daemon does."""

    _serial = 0

    def __init__(self, plan: PullPlan, remote: dict[int, EngineView], local: EngineView) -> None:
        # One pair of agents for every pair of engines: creating agents costs far more than the
        # pulls measured here. New registrations reach the puller by loading the holder's
        # metadata again (NIXL merges it; docs/lifetimes.md).
        self.holder, self.puller = NixlPull._agents()
        self.plan = plan
        self.remote_mem = {
            rank: torch.randint(0, 256, (v.spec.total_bytes,), dtype=torch.uint8) for rank, v in remote.items()
        }
        self.local_mem = torch.zeros(local.spec.total_bytes, dtype=torch.uint8)
        self.staging = torch.zeros(max(plan.staging_bytes, 1), dtype=torch.uint8)
        self.registrations = [(self.holder, self.holder.register_memory(t)) for t in self.remote_mem.values()]
        self.registrations += [(self.puller, self.puller.register_memory(t)) for t in (self.local_mem, self.staging)]
        self.puller.add_remote_agent(self.holder.get_agent_metadata())
        self.tables: dict[tuple[str, int, DescGeometry], object] = {}
        for group in plan.reads:  # prepared once per geometry (the daemon caches these)
            self._table("remote", group.remote_rank, group.remote_geometry)
            if group.local_target is Target.ENGINE:
                self._table("local", 0, group.local_geometry)

    _shared: tuple[Any, Any] | None = None

    @classmethod
    def _agents(cls) -> tuple[Any, Any]:
        if cls._shared is None:
            from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

            config = nixl_agent_config(backends=["UCX"])
            cls._serial += 1
            cls._shared = (
                nixl_agent(f"bench-holder-{cls._serial}", config),
                nixl_agent(f"bench-puller-{cls._serial}", config),
            )
        return cls._shared

    def _table(self, side: str, rank: int, geometry: DescGeometry) -> object:
        key = (side, rank, geometry)
        if key not in self.tables:
            if side == "remote":
                rows = geometry.descriptors([self.remote_mem[rank].data_ptr()])
                self.tables[key] = self.puller.prep_xfer_dlist(self.holder.name, rows, "DRAM")
            else:
                rows = geometry.descriptors([self.local_mem.data_ptr()])
                self.tables[key] = self.puller.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        return self.tables[key]

    def pull(self) -> None:
        """The reads (one transfer per group), the wait, then the conversion."""
        handles, oneoff = [], []
        for group in self.plan.reads:
            remote = self._table("remote", group.remote_rank, group.remote_geometry)
            if group.local_target is Target.ENGINE:
                local, local_idx = self._table("local", 0, group.local_geometry), group.local_indices
            else:
                rows = group.local_geometry.rows_for(group.local_indices, [self.staging.data_ptr()])
                local = self.puller.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
                local_idx = np.arange(rows.shape[0], dtype=np.int32)
                oneoff.append(local)
            handle = self.puller.make_prepped_xfer("READ", local, local_idx, remote, group.remote_indices)
            if self.puller.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer failed")
            handles.append(handle)
        for handle in handles:
            while (state := self.puller.check_xfer_state(handle)) == "PROC":
                pass
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")
            self.puller.release_xfer_handle(handle)
        for local in oneoff:
            self.puller.release_dlist_handle(local)
        if self.plan.postprocess is not None:
            self.plan.postprocess.run(self.staging, [self.local_mem])

    def close(self) -> None:
        for table in self.tables.values():
            self.puller.release_dlist_handle(table)
        for agent, registration in self.registrations:
            agent.deregister_memory(registration)


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401, PLC0415 - optional: the conversions run without it
    except ImportError:
        return False
    return True


def measure_pairs(
    tokens: int,
    repeat: int,
    threshold: int,
    device: torch.device,
    use_nixl: bool,
    progress: Callable[[str, float], None] = lambda _what, _done: None,
    pairs: list[Pair] | None = None,
) -> list[dict[str, object]]:
    """Every pair's plan, conversion vs ``copy_`` and (with NIXL) pull vs the same-layout pull,
    as JSON-ready rows (seconds as samples' medians; ratios as in the module docstring)."""
    rows: list[dict[str, object]] = []
    baseline: NixlPull | None = None
    pairs = PAIRS if pairs is None else pairs
    try:
        for n, pair in enumerate(pairs):
            progress(f"conversion {pair.name}", n / len(pairs))
            plan, local, remote, cold, warm = plan_for(pair, tokens, threshold, repeat)
            row: dict[str, object] = {
                "pair": pair.name,
                "remote": pair.remote.label(),
                "local": pair.local.label(),
                "mode": "direct" if plan.direct else "staged",
                "descriptors": plan.num_descriptors,
                "bytes": plan.total_bytes,
                "staging_bytes": plan.staging_bytes,
                "plan_cold_s": cold,
                "plan_warm_s": warm,
            }
            if plan.postprocess is not None:
                conv_gbs, copy_gbs = measure_conversion(plan, local, repeat, device)
                row.update(convert_gbs=conv_gbs, copy_gbs=copy_gbs, vs_copy=conv_gbs / copy_gbs)
            if use_nixl:
                rig = NixlPull(plan, remote, local)
                if baseline is None:
                    baseline = rig
                mine, same = interleaved([rig.pull, baseline.pull], repeat, device)
                pull_gbs = plan.total_bytes / mine / 1e9
                row.update(pull_gbs=pull_gbs, vs_same_layout=pull_gbs / (baseline.plan.total_bytes / same / 1e9))
                if rig is not baseline:
                    rig.close()
            rows.append(row)
    finally:
        if baseline is not None:
            baseline.close()
    progress("conversions", 1.0)
    return rows


def write_json(path: str, tokens: int, repeat: int, threshold: int, device: torch.device, use_nixl: bool) -> None:
    """Measure every pair (:func:`measure_pairs`) and write the rows, with the device, as JSON."""
    rows = measure_pairs(tokens, repeat, threshold, device, use_nixl)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} torch threads"
    document = {"device": str(device), "device_name": name, "tokens": tokens, "repeat": repeat, "rows": rows}
    with open(path, "w") as out:
        json.dump(document, out, indent=2)
    for row in rows:
        ratio = f"{row['vs_copy']:.2f}" if "vs_copy" in row else "-"
        print(f"{row['pair']:32} {row['mode']:>7}  conversion/copy_ {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threshold", type=int, default=4096, help="direct_read_min_bytes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-nixl", action="store_true", help="skip the NIXL loopback pulls")
    parser.add_argument("--json", default="", metavar="PATH", help="write every pair's row as JSON to PATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    use_nixl = device.type == "cpu" and not args.no_nixl and nixl_available()
    if use_nixl:
        logging.getLogger("nixl").setLevel(logging.WARNING)
    if args.json:
        write_json(args.json, args.tokens, args.repeat, args.threshold, device, use_nixl)
        return
    print(
        f"{args.tokens}-token request, Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16), "
        f"direct_read_min_bytes {args.threshold}, device {device}"
        + (
            f" ({torch.get_num_threads()} torch threads)"
            if device.type == "cpu"
            else f" ({torch.cuda.get_device_name(device)})"
        )
    )
    header = (
        f"{'pair':32} {'remote':>12} {'local':>12} {'mode':>7} {'descs':>6} {'avg B':>8} {'MB':>6} "
        f"{'staging MB':>10} {'plan ms c/w':>11} {'conv GB/s':>9} {'copy GB/s':>9} {'ratio':>6}"
        + (f" {'pull GB/s':>9} {'vs same':>7}" if use_nixl else "")
    )
    print(header)
    print("-" * len(header))
    baseline: NixlPull | None = None
    for pair in PAIRS:
        plan, local, remote, cold, warm = plan_for(pair, args.tokens, args.threshold, args.repeat)
        mode = "direct" if plan.direct else "staged"
        conv = copy = ratio = "-"
        if plan.postprocess is not None:
            conv_gbs, copy_gbs = measure_conversion(plan, local, args.repeat, device)
            conv, copy, ratio = f"{conv_gbs:.1f}", f"{copy_gbs:.1f}", f"{conv_gbs / copy_gbs:.2f}"
        pull = ""
        if use_nixl:
            rig = NixlPull(plan, remote, local)
            if baseline is None:
                baseline = rig
            mine, same = interleaved([rig.pull, baseline.pull], args.repeat, device)
            speedup = (plan.total_bytes / mine) / (baseline.plan.total_bytes / same)
            pull = f" {plan.total_bytes / mine / 1e9:>9.1f} {speedup:>7.2f}"
            if rig is not baseline:
                rig.close()
        print(
            f"{pair.name:32} {pair.remote.label():>12} {pair.local.label():>12} {mode:>7} "
            f"{plan.num_descriptors:>6} {plan.total_bytes // plan.num_descriptors:>8} "
            f"{plan.total_bytes / 2**20:>6.0f} {plan.staging_bytes / 2**20:>10.0f} "
            f"{cold * 1e3:>5.1f}/{warm * 1e3:<4.1f} "
            f"{conv:>9} {copy:>9} {ratio:>6}" + pull
        )
    if baseline is not None:
        baseline.close()


if __name__ == "__main__":
    main()
