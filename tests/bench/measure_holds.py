"""What holds cost a decode engine, and how fast an abort frees a prefill's blocks.

``python tests/bench/measure_holds.py [--requests 200] [--aborts 20]`` runs vLLM 0.33's real
Scheduler (the harness of tests/vllm_connector, stand-in runner) against two real daemons:

1. a sustained P -> D run (the toy proxy's flow: prefill with max_tokens 1, then decode) for
   each decode hold mode, sampling after every decode step how many decode blocks are pinned by
   holds (blocks vLLM cannot allocate that no running or waiting request owns), and after the
   run how many remain pinned and how many blocks are free;
2. aborts: decode aborts a request before pulling; the time until the prefill engine's blocks
   are free (vLLM freed them after finished_sending), prefill stepping every millisecond.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_connector"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.v1.request import RequestStatus  # noqa: E402
from vllm_harness import VllmEngine, tiny_model_dir  # noqa: E402

from kvd.spawn import DaemonProcess, start_daemon  # noqa: E402


def _engine(model: Path, daemon: DaemonProcess, role: str, **extra: Any) -> VllmEngine:
    config = {"kvd_socket": daemon.unix_socket, "rpc_timeout_s": 5.0, **extra}
    engine = VllmEngine(model, f"{role}-{uuid.uuid4().hex[:6]}", config)
    deadline = time.monotonic() + 30
    while not engine.worker.worker.link.connected or not engine.connector._scheduler._stream.stream_connected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{role} did not connect to its daemon")
        time.sleep(0.01)
    return engine


def _pinned_by_holds(engine: VllmEngine) -> int:
    """Decode blocks pinned by holds: those of finished requests vLLM keeps for a lease (hard
    holds delay their free), plus those the connector pinned for soft reads in flight."""
    sched = engine.scheduler
    kept = sum(
        len(sched.kv_cache_manager.get_block_ids(rid)[0]) for rid, req in sched.requests.items() if req.is_finished()
    )
    return kept + int(engine.connector._scheduler.pinned_blocks)


def _run(*engines: VllmEngine, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(e.has_work() for e in engines):
        if time.monotonic() > deadline:
            raise RuntimeError("engines did not settle")
        for e in engines:
            e.step()


def sustained(model: Path, a: DaemonProcess, b: DaemonProcess, mode: str, requests: int) -> dict[str, float]:
    p = _engine(model, a, "prefill")
    d = _engine(model, b, "decode", decode_hold_mode=mode)
    try:
        peak = 0
        wave = 8
        started = time.monotonic()
        for first in range(0, requests, wave):
            ids = [f"r{i}" for i in range(first, min(first + wave, requests))]
            for rid in ids:
                prompt = [(hash((rid, t)) % 900) + 1 for t in range(40)]
                p.add_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            _run(p)
            for rid in ids:
                prompt = p.tokens[rid][:40]
                d.add_request(rid, prompt, max_tokens=4, kv_transfer_params=p.outputs[rid].kv_transfer_params)
            while d.has_work() or p.has_work():
                d.step()
                p.step()
                peak = max(peak, _pinned_by_holds(d))
        elapsed = time.monotonic() - started
        pool = d.scheduler.kv_cache_manager.block_pool
        return {
            "requests": requests,
            "decode_blocks": pool.num_gpu_blocks - 1,
            "peak_pinned_by_holds": peak,
            "pinned_by_holds_after": _pinned_by_holds(d),
            "free_after": pool.get_num_free_blocks(),
            "run_s": round(elapsed, 2),
        }
    finally:
        d.close()
        p.close()


def aborts(model: Path, a: DaemonProcess, b: DaemonProcess, count: int) -> list[float]:
    p = _engine(model, a, "prefill")
    d = _engine(model, b, "decode")
    times = []
    try:
        for i in range(count):
            rid = f"a{i}"
            prompt = [(7 * i + t) % 900 + 1 for t in range(40)]
            p.add_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            _run(p)
            d.add_request(rid, prompt, max_tokens=2, kv_transfer_params=p.outputs[rid].kv_transfer_params)
            t0 = time.monotonic()
            d.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            while rid in p.scheduler.requests:
                p.step()
                time.sleep(0.001)
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("abort did not free the prefill's blocks")
            times.append(time.monotonic() - t0)
    finally:
        d.close()
        p.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--aborts", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_model_dir(root / "model")
        a, b = start_daemon(root, "node-a"), start_daemon(root, "node-b")
        try:
            for mode in ("soft", "hard"):
                print(f"sustained P->D, decode_hold_mode={mode}:", sustained(model, a, b, mode, args.requests))
            times = sorted(aborts(model, a, b, args.aborts))
            print(
                f"abort -> prefill blocks free over {len(times)} aborts: p50 {statistics.median(times) * 1e3:.1f} ms, "
                f"max {times[-1] * 1e3:.1f} ms"
            )
        finally:
            a.terminate()
            b.terminate()


if __name__ == "__main__":
    main()
