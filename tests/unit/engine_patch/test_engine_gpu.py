"""On a CUDA device: no host sync on the commit path (sync debug mode), CUDA IPC registration,
signals that wait for the step's kernels off the step path. Skipped without CUDA."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from engine_fakes import FakeDaemon, wait_until

from kvd.demo.reference_engine import AcceptancePattern, ReferenceEngine
from kvd_engine.cache_layout import CacheGeometry
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.hostcopy import AsyncHostCopy
from kvd_engine.metadata import KvdConnectorMetadata
from kvd_engine.nwor import DeferredWriteManager, acceptance_mask, committed_watermarks, num_valid_tokens
from kvd_engine.signals import StepSignal, StepSignaler
from kvd_engine.worker import KvdWorker
from kvd_engine.worker_link import DaemonLink

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GEOMETRY = CacheGeometry(num_layers=2, num_blocks=32, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def test_nwor_commit_path_never_syncs_on_the_device() -> None:
    io = GEOMETRY.slot_io()
    cache = torch.zeros(GEOMETRY.layer_shape, dtype=GEOMETRY.dtype, device="cuda")
    manager = DeferredWriteManager("stage")
    slots = torch.arange(16, 28, device="cuda")
    key = torch.randn(12, 2, 64, device="cuda").to(GEOMETRY.dtype)
    starts = torch.tensor([0, 4, 12], dtype=torch.int32, device="cuda")
    positions = torch.arange(12, device="cuda")
    sched, drafts, sampled = (torch.tensor(v, device="cuda") for v in ([4, 8], [3, 0], [2, 1]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call below raises
    try:
        manager.begin_window(12)
        manager.write("l0", key, key, cache, slots, io.write)
        num_valid = num_valid_tokens(sched, drafts, sampled)
        manager.commit(acceptance_mask(starts, num_valid, 12))
        marks = committed_watermarks(positions, starts, num_valid)
        copy = AsyncHostCopy(marks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    copy.wait()
    assert copy.numpy().tolist() == [2, 12]
    torch.cuda.synchronize()
    stats = manager.poll()  # folded in once the counter copy landed
    assert (stats.committed_tokens, stats.rejected_tokens) == (10, 2)


def test_reference_engine_on_cuda_matches_the_model() -> None:
    with ReferenceEngine(
        num_blocks=64,
        block_size=16,
        device="cuda",
        use_shm=False,
        num_speculative_tokens=3,
        acceptance=AcceptancePattern.random(2),
    ) as engine:
        engine.add_request("a", list(range(40)), max_tokens=12)
        engine.run()
        for layer in range(engine.num_layers):
            got, want = engine.request_kv("a", layer), engine.expected_request_kv("a", layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cuda_kv_registers_by_ipc_handle() -> None:
    daemon = FakeDaemon()
    flat = torch.zeros(GEOMETRY.total_bytes, dtype=torch.uint8, device="cuda")
    caches = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(GEOMETRY.layer_views(flat))}
    link = DaemonLink("unix:///fake", "gpu", 0, client_factory=daemon.client)
    worker = KvdWorker(KvdConnectorConfig(), "gpu", 0, geometry=GEOMETRY, link=link)
    worker.register_kv_caches(caches)
    assert wait_until(lambda: link.connected)
    (region,) = daemon.registrations[("gpu", 0)].regions
    assert region.WhichOneof("source") == "cuda_ipc" and region.cuda_ipc.handle
    assert region.size_bytes >= GEOMETRY.total_bytes
    worker.bind_connector_metadata(KvdConnectorMetadata(host_commits={"r": 5}))
    worker.wait_for_save()
    assert wait_until(lambda: ("post_forward", 1, ()) in daemon.stream("gpu").sent)
    worker.shutdown()


def test_signals_wait_for_the_steps_kernels_off_the_step_path() -> None:
    sent: list[Any] = []
    signaler = StepSignaler(
        lambda r, t: sent.append((r, t)) or True,
        lambda s, f: sent.append(("pf", s)) or True,
        background=True,
        commit_every_steps=1,
    )
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU work queued before the event
    event = torch.cuda.Event()
    event.record()
    started = time.perf_counter()
    signaler.submit(StepSignal(step=1, commits={"r": 3}, event=event))
    assert time.perf_counter() - started < 0.05 and sent == []  # the step path did not wait for the ~100 ms
    assert wait_until(lambda: sent == [("r", 3), ("pf", 1)], timeout_s=5)
    signaler.close()
