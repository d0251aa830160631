"""What `kvd selftest` measures, shared by its host-memory and GPU-memory runs.

A measurement (kvd pulls beside raw NIXL reads of the same bytes) and the raw read itself: a
bare NIXL agent reading an engine's registration at the peer, host memory or VRAM.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvd_client import KvdClient, errors
from kvd_client.channel import TlsConfig, create_channel
from kvd_client.v1 import common_pb2, peer_pb2, peer_pb2_grpc

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class PullMeasurement:
    """kvd pulls and raw NIXL reads of the same bytes from the same peer, in one run."""

    nbytes: int
    descriptors: int
    kvd_times: list[float]
    raw_times: list[float]
    memory: str = "DRAM"  # NIXL's memory type of both engines' KV: DRAM (shm) or VRAM (CUDA IPC)
    device: str = "cpu"

    @property
    def kvd_gbs(self) -> float:
        return self.nbytes / statistics.median(self.kvd_times) / 1e9

    @property
    def raw_gbs(self) -> float:
        return self.nbytes / statistics.median(self.raw_times) / 1e9

    @property
    def ratio(self) -> float:
        return self.kvd_gbs / self.raw_gbs

    def to_json(self) -> dict[str, object]:
        """Every sample and the medians, for ``--json``."""
        return {
            "verified": True,
            "memory": self.memory,
            "device": self.device,
            "bytes": self.nbytes,
            "descriptors": self.descriptors,
            "kvd_times_s": self.kvd_times,
            "raw_times_s": self.raw_times,
            "kvd_gbs": self.kvd_gbs,
            "raw_gbs": self.raw_gbs,
            "ratio": self.ratio,
        }


class PatternMismatch(Exception):
    """A pull delivered bytes that differ from the pattern."""


def raw_nixl_reads(
    peer_address: str,
    engine_id: str,
    buffer: torch.Tensor,
    mismatches: Callable[[torch.Tensor], int],
    iterations: int,
    progress: Callable[[str], None],
    tls: TlsConfig | None = None,
) -> list[float]:
    """Read an engine's registration at the peer with a bare NIXL agent: the baseline.

    ``buffer`` (a flat uint8 tensor, host or GPU) receives the bytes of the engine's first
    region; ``mismatches`` counts its wrong bytes after each read. GPU memory is VRAM on both
    sides, with NIXL's device ids (the GPU index), as vLLM's NIXL connector registers it.
    """
    import torch  # noqa: PLC0415 - see run_selftest
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415

    with create_channel(peer_address, tls=tls) as channel:
        info = peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=30)
    engine = next(e for e in info.engines if e.engine_id == engine_id)
    region = engine.regions[0]
    local_mem, local_dev = ("VRAM", int(buffer.device.index or 0)) if buffer.is_cuda else ("DRAM", 0)
    remote_mem, remote_dev = ("VRAM", int(region.device_index)) if region.vram else ("DRAM", 0)
    agent = nixl_agent(f"kvd-selftest-raw-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
    registration = agent.register_memory(buffer)
    remote_name = agent.add_remote_agent(info.agent_metadata)
    nbytes = buffer.numel()
    local_h = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.array([[buffer.data_ptr(), nbytes, local_dev]], dtype=np.int64), local_mem
    )
    remote_h = agent.prep_xfer_dlist(
        remote_name, np.array([[region.address, nbytes, remote_dev]], dtype=np.int64), remote_mem
    )
    times: list[float] = []
    try:
        for iteration in range(iterations + 1):
            buffer.zero_()
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # the zeroing lands before NIXL writes
            t0 = time.perf_counter()
            handle = agent.make_prepped_xfer(
                "READ", local_h, np.array([0], np.int32), remote_h, np.array([0], np.int32)
            )
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            elapsed = time.perf_counter() - t0
            handle.release()
            if state != "DONE":
                raise errors.PeerUnavailable(f"raw NIXL read from {peer_address} failed ({state})")
            if mismatches(buffer):
                raise errors.Internal("raw NIXL read delivered wrong bytes")
            if iteration:
                times.append(elapsed)
            what = "raw warm-up" if iteration == 0 else f"raw NIXL read {iteration}/{iterations}"
            progress(f"{what:>16}: {elapsed * 1e3:8.2f} ms, {nbytes} bytes verified")
    finally:
        local_h.release()
        remote_h.release()
        agent.remove_remote_agent(remote_name)
        agent.deregister_memory(registration)
    return times


def timed_pull(local: KvdClient, engine_id: str, params: common_pb2.KvTransferParams) -> tuple[Any, float]:
    """Pull held blocks into the same block ids of ``engine_id`` rank 0, as an engine does:
    StartPull, then wait for the end; returns the final status and the seconds it took."""
    t0 = time.perf_counter()
    started = local.start_pull(
        engine_id=engine_id,
        tp_rank=0,
        request_id=params.request_id,
        local_block_ids=list(params.block_ids),
        remote=params,
    )
    status = local.wait_transfer(started.transfer_id, timeout_s=120)
    return status, time.perf_counter() - t0
