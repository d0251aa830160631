"""Engine memory as the control process knows it: what the engine asked for and where the worker
mapped it.

The data-plane worker maps an engine's memory without copying it (kvd.worker.regions: a shared
mapping of the engine's ``/dev/shm`` file, or its CUDA IPC handle opened on the same device).
The control process never touches those bytes: it keeps the request (to map it again in a new
worker after a restart) and the worker's answer (addresses, for descriptor lists).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvd.dataplane_protocol import CudaIpcSpec, MappedRegion, MemoryKind, RegionRequest

if TYPE_CHECKING:
    import torch

__all__ = ["CudaIpcSpec", "MemoryKind", "OpenedRegion", "RegionRequest", "cuda_ipc_spec_of"]


@dataclasses.dataclass(frozen=True, eq=False)
class OpenedRegion:
    """An engine region mapped by the data-plane worker."""

    request: RegionRequest
    mapped: MappedRegion

    @property
    def region_id(self) -> int:
        return self.mapped.region_id

    @property
    def address(self) -> int:
        """The mapping's address in the worker (what its NIXL registration names)."""
        return self.mapped.address

    @property
    def size_bytes(self) -> int:
        return self.request.size_bytes

    @property
    def vram(self) -> bool:
        return self.mapped.vram

    @property
    def device_index(self) -> int:
        """NIXL's device id: the GPU index for VRAM, 0 for host memory."""
        return self.mapped.device_index

    @property
    def mem_type(self) -> str:
        return self.mapped.mem_type

    @property
    def device(self) -> str:
        """The torch device of the mapping ("cpu" or "cuda:N")."""
        return f"cuda:{self.device_index}" if self.vram else "cpu"


def cuda_ipc_spec_of(tensor: torch.Tensor) -> CudaIpcSpec:
    """What an engine sends for a CUDA tensor's storage (the worker opens it: kvd.worker.regions).

    Takes a tensor, so its caller has torch; this module does not import it (the control process
    never needs torch: docs/performance.md, "Start-up")."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return CudaIpcSpec(
        device_index=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync),
    )
