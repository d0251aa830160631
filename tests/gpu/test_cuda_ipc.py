"""GPU memory: engines register VRAM through CUDA IPC; daemons pull VRAM to VRAM through NIXL.

The engine is this test process: it allocates its KV cache on the GPU and sends the storage's
CUDA IPC handle; the daemon (another process) opens it on the same device, zero copy, and
registers it with NIXL as VRAM. Skipped without CUDA (see tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from kvd.core.memory import cuda_ipc_spec_of
from kvd.layout.spec import contiguous_placements
from kvd.server import convert
from kvd_client import KvdClient, errors
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


class CudaEngine:
    """An engine rank whose KV cache is one CUDA tensor, registered through CUDA IPC."""

    def __init__(self, target: str, engine_id: str, spec, device: int = 0) -> None:  # type: ignore[no-untyped-def]
        self.engine_id = engine_id
        self.spec = spec
        self.buffer = torch.zeros(spec.total_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        self.client = KvdClient(target, timeout_s=60)

    def register(self) -> None:
        ipc = cuda_ipc_spec_of(self.buffer)
        self.client.register_kv_cache(
            engine_id=self.engine_id,
            layout=convert.layout_to_pb(self.spec),
            regions=[
                common_pb2.MemoryRegion(
                    kind=common_pb2.MEMORY_KIND_CUDA_IPC,
                    size_bytes=self.spec.total_bytes,
                    cuda_ipc=common_pb2.CudaIpcHandle(
                        device_index=ipc.device_index,
                        handle=ipc.handle,
                        storage_size_bytes=ipc.storage_size_bytes,
                        storage_offset_bytes=ipc.storage_offset_bytes,
                        ref_counter_handle=ipc.ref_counter_handle,
                        ref_counter_offset=ipc.ref_counter_offset,
                        event_handle=ipc.event_handle,
                        event_sync_required=ipc.event_sync_required,
                    ),
                )
            ],
            layers=[convert.placement_to_pb(p) for p in contiguous_placements(self.spec)],
            engine_pid=os.getpid(),
        )

    def close(self) -> None:
        with contextlib.suppress(errors.KvdError):
            self.client.unregister_kv_cache(engine_id=self.engine_id, tp_rank=0)
        self.client.close()


@pytest.mark.parametrize("daemons", ["two", "one"], ids=["two-daemons", "one-daemon"])
def test_vram_registration_is_zero_copy_and_pulls_between_daemons(spawn_daemon, daemons: str) -> None:
    """VRAM to VRAM between two daemons, and between two engines of one daemon (both engines on
    one node: NIXL copies within the daemon's own agent, kvd.core.loopback)."""
    from kvtest import small_spec

    a = spawn_daemon(name="a")
    b = spawn_daemon(name="b") if daemons == "two" else a
    spec = small_spec(num_blocks=32)
    holder = CudaEngine(a.unix_target, "holder", spec)
    reader = CudaEngine(b.unix_target, "reader", spec)
    try:
        holder.register()
        reader.register()
        generator = torch.Generator(device="cuda").manual_seed(3)
        holder.buffer.copy_(
            torch.randint(0, 256, holder.buffer.shape, dtype=torch.uint8, device="cuda", generator=generator)
        )
        torch.cuda.synchronize()
        params = holder.client.hold_blocks(
            engine_id="holder", request_id="r", block_ids=[4, 5, 6], num_tokens=40
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[10, 11, 12], remote=params
        )
        status = reader.client.wait_transfer(started.transfer_id, timeout_s=60)
        assert status.state == common_pb2.TRANSFER_STATE_DONE
        torch.cuda.synchronize()
        for placement in contiguous_placements(spec):
            for plane in spec.plane_offsets(placement):
                for src, dst, tokens in ((4, 10, 16), (5, 11, 16), (6, 12, 8)):
                    s = plane + src * spec.block_stride
                    d = plane + dst * spec.block_stride
                    n = tokens * spec.token_bytes
                    assert torch.equal(holder.buffer[s : s + n], reader.buffer[d : d + n])
        status_pb = reader.client.get_status()
        assert {e.registered_bytes for e in status_pb.engines} == {spec.total_bytes}
    finally:
        holder.close()
        reader.close()


def test_cuda_ipc_handle_for_a_missing_device_is_refused(spawn_daemon) -> None:
    from kvtest import small_spec

    daemon = spawn_daemon()
    spec = small_spec()
    engine = CudaEngine(daemon.unix_target, "e", spec)
    try:
        ipc = cuda_ipc_spec_of(engine.buffer)
        with pytest.raises(errors.MemoryOpenError, match="does not exist"):
            engine.client.register_kv_cache(
                engine_id="e",
                layout=convert.layout_to_pb(spec),
                regions=[
                    common_pb2.MemoryRegion(
                        kind=common_pb2.MEMORY_KIND_CUDA_IPC,
                        size_bytes=spec.total_bytes,
                        cuda_ipc=common_pb2.CudaIpcHandle(
                            device_index=99, handle=ipc.handle, storage_size_bytes=ipc.storage_size_bytes
                        ),
                    )
                ],
                layers=[convert.placement_to_pb(p) for p in contiguous_placements(spec)],
            )
        assert not engine.client.get_status().engines
    finally:
        engine.client.close()
