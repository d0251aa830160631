"""`kvd selftest`: can two daemons move KV correctly, and how fast compared with raw NIXL?

1. Targets the local daemon (``--target``) or starts one; targets the peer (``--peer``) or
   starts a second daemon. With ``--tls-ca``/``--tls-cert``/``--tls-key`` (as `kvd status`) every
   TCP call speaks mTLS (to the peer; to ``--target`` when it is TCP), and a daemon the selftest
   starts gets the same files, so that it pulls from an mTLS-only peer over mTLS. The certificate
   needs the ``operator`` role (SelftestHold) and ``peer`` (the baseline's Handshake, the local
   daemon's pulls) at the peer: docs/security.md.
2. The peer holds a scratch KV cache filled with a checksummed pattern (SelftestHold).
3. This process creates a scratch shm KV cache of the same layout, registers it with the local
   daemon (a real zero-copy registration) and has the daemon pull the peer's cache through NIXL.
4. Every byte is checked against the pattern (generated once here, compared in bulk: the
   selftest measures moving bytes, not checking them). Then a raw NIXL agent in this process
   reads the same bytes from the peer's registration directly, and the two are compared side by
   side. Progress is printed as it goes.
With ``--vram`` (a CUDA machine), both engines' KV caches live in GPU memory instead: this
process allocates them on the GPU and registers them with the two daemons through CUDA IPC, and
the raw NIXL read is VRAM to VRAM (see kvd.cli.selftest_vram). ``--json PATH`` writes the
measurement for machines (the GPU check kit reads it).
Exit status 0 only if every pull verified; 2 for bad arguments (or ``--vram`` without CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvd.cli.selftest_parts import PatternMismatch, PullMeasurement, raw_nixl_reads, timed_pull
from kvd.cli.tls import TlsFlagsError, tls_flags, tls_from_args
from kvd.layout.spec import contiguous_placements
from kvd.spawn import launch_owned, stop_launches, wait_ready
from kvd_client import KvdClient, errors
from kvd_client.channel import TlsConfig, is_unix_target
from kvd_client.v1 import common_pb2

if TYPE_CHECKING:
    pass

MAX_SIZE_MB = 1024  # kvd.core.scratch.MAX_SCRATCH_BYTES, which the daemon enforces


def _say(message: str) -> None:
    print(message, flush=True)


def run_selftest(args: argparse.Namespace) -> int:
    if not 0 < args.size_mb <= MAX_SIZE_MB:
        print(f"kvd selftest: --size-mb must be in 1..{MAX_SIZE_MB}, got {args.size_mb}", file=sys.stderr)
        return 2
    if args.iterations < 1:
        print(f"kvd selftest: --iterations must be >= 1, got {args.iterations}", file=sys.stderr)
        return 2
    try:
        tls = tls_from_args(args)
    except TlsFlagsError as exc:
        print(f"kvd selftest: {exc}", file=sys.stderr)
        return 2
    if args.vram:
        from kvd.cli.selftest_vram import vram_refusal  # noqa: PLC0415 - torch: only for --vram

        refusal = vram_refusal(args)
        if refusal:
            print(f"kvd selftest: {refusal}", file=sys.stderr)
            return 2
    seed = args.seed or random.randrange(1, 1 << 30)
    size = args.size_mb << 20
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-selftest-")))
        wanted = [name for name, given in (("local", args.target), ("peer", args.peer)) if not given]
        if wanted:
            _say(f"starting {' and '.join(wanted)} daemon{'s' if len(wanted) > 1 else ''} ...")
        launches = launch_owned(stack, workdir, *wanted, extra_flags=tls_flags(args))
        # torch and NIXL (seconds of CPU to import: this process needs them for its engine's buffer
        # and the raw NIXL reads) load here while the daemons start, not after them on the way to
        # the first pull (docs/performance.md, "Start-up")
        import torch  # noqa: F401, PLC0415
        from nixl import _api  # noqa: F401, PLC0415

        from kvd.core import scratch  # noqa: F401, PLC0415
        from kvd.server import convert  # noqa: F401, PLC0415

        started = {launch.name: wait_ready(launch) for launch in launches}
        local_target = args.target or started["local"].unix_target
        peer_address = args.peer or started["peer"].tcp
        for name, daemon in started.items():
            _say(f"started {name} daemon {daemon.tcp:>21}  (unix {daemon.unix_socket})")
        local_tls = None if is_unix_target(local_target) else tls
        local_client = stack.enter_context(KvdClient(local_target, timeout_s=30, tls=local_tls))
        # --vram: the holder engine (this process) registers its GPU memory on the peer's Unix socket
        peer_target = started["peer"].unix_target if args.vram else peer_address
        peer_client = stack.enter_context(
            KvdClient(peer_target, timeout_s=60, tls=None if is_unix_target(peer_target) else tls)
        )
        try:
            ours = [launch for launch in launches if launch.name == "local"]  # only a daemon we started
            local_done = lambda: stop_launches(ours, wait=False)  # noqa: E731
            measure = _measure_vram(args.device) if args.vram else functools.partial(measure_pull, tls=tls)
            code, result = _selftest(
                stack, local_client, peer_client, peer_address, size, seed, args.iterations, local_done, measure
            )
        except errors.KvdError as exc:
            _say(f"FAIL: {type(exc).__name__} ({exc.code.name}): {exc.message}")
            code, result = 1, {"verified": False, "error": f"{type(exc).__name__} ({exc.code.name}): {exc.message}"}
    _say(f"selftest took {time.perf_counter() - t0:.1f} s")
    if args.json:
        result.update(seed=seed, iterations=args.iterations, size_mb=args.size_mb, passed=code == 0)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if code == 0:
        _say("PASS")
    return code


def measure_pull(
    stack: contextlib.ExitStack,
    local: KvdClient,
    peer: KvdClient,
    peer_address: str,
    size: int,
    seed: int,
    iterations: int,
    progress: Callable[[str], None] = lambda _: None,
    local_done: Callable[[], None] = lambda: None,
    tls: TlsConfig | None = None,
) -> PullMeasurement:
    """Pull the peer's scratch cache ``iterations`` (+1 warm-up) times, verifying every byte.

    ``local_done`` runs once the local daemon is no longer needed (its scratch engine
    unregistered, before the raw NIXL reads): `kvd selftest` stops a daemon it started there,
    so its exit overlaps the raw reads instead of adding to the wall time.
    """
    from kvd.core import scratch  # noqa: PLC0415 - torch: see run_selftest
    from kvd.server import convert  # noqa: PLC0415
    from kvd_client.shm import create_shm_tensor, unlink_shm  # noqa: PLC0415

    progress(f"peer fills a {size >> 20} MiB scratch KV cache with pattern {seed} ...")
    held = peer.selftest_hold(size_bytes=size, seed=seed)
    spec = convert.layout_from_pb(held.layout)
    nbytes = spec.total_bytes
    expected = scratch.Pattern(nbytes, seed)
    shm_name = f"kvd-selftest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    buffer = create_shm_tensor(shm_name, nbytes)
    stack.callback(unlink_shm, shm_name)
    engine_id = f"selftest-{uuid.uuid4().hex[:8]}"
    local.register_kv_cache(
        engine_id=engine_id,
        layout=held.layout,
        regions=[common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=nbytes, shm_name=shm_name)],
        layers=[convert.placement_to_pb(p) for p in contiguous_placements(spec)],
        engine_pid=os.getpid(),
    )
    registered = [True]

    def unregister() -> None:
        if registered.pop():
            local.unregister_kv_cache(engine_id=engine_id, tp_rank=0)

    stack.callback(lambda: unregister() if registered else None)

    kvd_times: list[float] = []
    descriptors = 0
    for iteration in range(iterations + 1):  # the first pull warms up (handshake, table preparation)
        params = (
            held.kv_transfer_params
            if iteration == 0
            else peer.selftest_hold(size_bytes=size, seed=seed).kv_transfer_params
        )
        buffer.zero_()
        status, elapsed = timed_pull(local, engine_id, params)
        bad = expected.mismatches(buffer)
        if bad:
            raise PatternMismatch(f"pull {iteration} delivered {bad} wrong bytes out of {nbytes}")
        descriptors = status.descriptors
        if iteration:
            kvd_times.append(elapsed)
        what = "warm-up pull" if iteration == 0 else f"kvd pull {iteration}/{iterations}"
        progress(f"{what:>16}: {elapsed * 1e3:8.2f} ms, {nbytes} bytes verified")
    unregister()
    local_done()
    raw_times = raw_nixl_reads(
        peer_address, held.kv_transfer_params.engine_id, buffer, expected.mismatches, iterations, progress, tls
    )
    return PullMeasurement(nbytes, descriptors, kvd_times, raw_times)


Measure = Callable[..., PullMeasurement]


def _measure_vram(device: int) -> Measure:
    from kvd.cli.selftest_vram import measure_pull_vram  # noqa: PLC0415

    return functools.partial(measure_pull_vram, device=device)


def _selftest(
    stack: contextlib.ExitStack,
    local: KvdClient,
    peer: KvdClient,
    peer_address: str,
    size: int,
    seed: int,
    iterations: int,
    local_done: Callable[[], None],
    measure: Measure = measure_pull,
) -> tuple[int, dict[str, object]]:
    try:
        m = measure(stack, local, peer, peer_address, size, seed, iterations, progress=_say, local_done=local_done)
    except PatternMismatch as exc:
        _say(f"FAIL: {exc}")
        return 1, {"verified": False, "error": str(exc)}
    kvd_ms = statistics.median(m.kvd_times) * 1e3
    raw_ms = statistics.median(m.raw_times) * 1e3
    where = f"{m.memory} on {m.device}" if m.memory == "VRAM" else m.memory
    _say(
        f"verified {iterations + 1} pulls of {m.nbytes} bytes ({where}), {m.descriptors} NIXL descriptors each: "
        "all bytes match"
    )
    _say(f"kvd pull      median {kvd_ms:8.2f} ms  {m.kvd_gbs:6.2f} GB/s  (StartPull -> DONE, over gRPC)")
    _say(f"raw NIXL read median {raw_ms:8.2f} ms  {m.raw_gbs:6.2f} GB/s  (same bytes, same peer, one agent)")
    _say(f"ratio kvd/raw {m.ratio:.2f}")
    return 0, m.to_json()
