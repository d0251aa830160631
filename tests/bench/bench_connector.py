"""Per-step cost of kvd's connector on the engine's critical path.

``python tests/bench/bench_connector.py [--requests 64] [--steps 3000] [--speculative]`` times, per
engine step with N running decode requests, what the engine's threads pay for kvd: the
scheduler half's ``build_connector_meta`` plus the worker half's hooks (bind, start_load_kv,
get_transfer_results, the watermark hand-off, wait_for_save, clear), with the commits and
post-forward signal going into a real ``kvd_client`` engine stream to a gRPC server in
another process (a stand-in daemon that drains the stream). The same step with no connector
is the baseline. Prints p50/p99 in microseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import torch

from kvd_engine.cache_layout import CacheGeometry
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.engine_api import NullSchedulerConnector, NullWorkerConnector, ScheduledRequest, StepView
from kvd_engine.scheduler import KvdScheduler
from kvd_engine.shm import create_shm_region
from kvd_engine.worker import KvdWorker

logger = logging.getLogger(__name__)

__all__ = ["BenchResult", "main", "run"]


@dataclasses.dataclass(frozen=True)
class BenchResult:
    requests: int
    steps: int
    speculative: bool
    connector_p50_us: float
    connector_p99_us: float
    baseline_p50_us: float
    baseline_p99_us: float
    messages_sent: int
    messages_received: int
    steps_run: int  # measured steps plus warm-up

    def describe(self) -> str:
        kind = "spec-decode" if self.speculative else "plain"
        return (
            f"{self.requests} running requests, {self.steps} steps ({kind}): connector + commit routing "
            f"p50 {self.connector_p50_us:.1f} us, p99 {self.connector_p99_us:.1f} us "
            f"(no connector: p50 {self.baseline_p50_us:.1f} us, p99 {self.baseline_p99_us:.1f} us); "
            f"{self.messages_sent / self.steps_run:.1f} stream messages per step "
            f"({self.messages_received} of {self.messages_sent} had reached the server at the end)"
        )


def _serve(socket_path: str, ready: Any, stop: Any, received: Any) -> None:
    """Child process: an EngineService that accepts registrations and drains engine streams."""
    import grpc

    from kvd_client.v1 import engine_pb2, engine_pb2_grpc

    class Engine(engine_pb2_grpc.EngineServiceServicer):
        def RegisterKvCache(self, request: Any, context: Any) -> Any:
            return engine_pb2.RegisterKvCacheResponse(daemon_incarnation="bench", agent_name="bench")

        def UnregisterKvCache(self, request: Any, context: Any) -> Any:
            return engine_pb2.UnregisterKvCacheResponse()

        def EngineStream(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
            for _ in request_iterator:
                with received.get_lock():
                    received.value += 1
            return iter(())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    engine_pb2_grpc.add_EngineServiceServicer_to_server(Engine(), server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    ready.set()
    stop.wait()
    server.stop(grace=None)


def _start_server(socket_path: str) -> tuple[Callable[[], None], Any]:
    """The stand-in daemon in its own process (sharing the engine's GIL would skew the numbers)."""
    ctx = multiprocessing.get_context("spawn")
    ready, stop, received = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    child = ctx.Process(target=_serve, args=(socket_path, ready, stop, received), daemon=True)
    child.start()
    if not ready.wait(30):
        child.kill()
        raise RuntimeError("bench: the stand-in daemon did not start")

    def shutdown() -> None:
        stop.set()
        child.join(10)
        if child.is_alive():
            child.kill()

    return shutdown, received


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _step(scheduler: Any, worker: Any, view: StepView, ids: list[str], marks: torch.Tensor | None) -> None:
    meta = scheduler.build_connector_meta(view)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.get_transfer_results(set())
    if marks is not None:
        worker.set_step_watermarks(ids, marks)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def run(requests: int = 64, steps: int = 3000, speculative: bool = False, warmup: int = 200) -> BenchResult:
    """Measure; returns the numbers (also used by ``kvd bench``)."""
    geometry = CacheGeometry(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=16)
    region = create_shm_region(geometry.total_bytes, prefix="kvd-bench")
    tmp = tempfile.mkdtemp(prefix="kvd-bench-")
    socket_path = os.path.join(tmp, "engine.sock")
    stop_server, received = _start_server(socket_path)
    config = KvdConnectorConfig(kvd_socket=socket_path)
    worker = KvdWorker(config, "bench", 0, geometry=geometry)
    scheduler = KvdScheduler(config, "bench", block_size=16, hold_client=None, speculative=speculative)
    try:
        worker.register_kv_caches({f"layer.{i}": t for i, t in enumerate(geometry.layer_views(region.tensor))})
        deadline = time.monotonic() + 10
        while not worker.link.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        if not worker.link.connected:
            raise RuntimeError("bench: the worker did not connect to the in-process server")
        ids = [f"req-{i}" for i in range(requests)]
        null_s, null_w = NullSchedulerConnector(), NullWorkerConnector()
        connector: list[float] = []
        baseline: list[float] = []
        for step in range(warmup + steps):
            computed = 100 + step * 4
            view = StepView(
                scheduled=[
                    ScheduledRequest(rid, computed + i, 4 if speculative else 1, 3 if speculative else 0)
                    for i, rid in enumerate(ids)
                ]
            )
            marks = torch.arange(computed, computed + requests, dtype=torch.int64) + 2 if speculative else None
            t0 = time.perf_counter_ns()
            _step(scheduler, worker, view, ids, marks)
            t1 = time.perf_counter_ns()
            _step(null_s, null_w, view, ids, marks)
            t2 = time.perf_counter_ns()
            if step >= warmup:
                connector.append((t1 - t0) / 1000.0)
                baseline.append((t2 - t1) / 1000.0)
        time.sleep(0.2)
        c50, c99 = _percentiles(connector)
        b50, b99 = _percentiles(baseline)
        signaler = worker._signaler
        sent = signaler.commits_sent + signaler.signals_sent if signaler is not None else 0
        return BenchResult(requests, steps, speculative, c50, c99, b50, b99, sent, int(received.value), steps + warmup)
    finally:
        worker.shutdown()
        stop_server()
        region.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/bench/bench_connector.py", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--speculative", action="store_true", help="watermarks from the device (NWOR path)")
    args = parser.parse_args(argv)
    print(run(args.requests, args.steps, args.speculative).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
