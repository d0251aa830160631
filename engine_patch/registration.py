"""Turning an engine rank's KV tensors into a ``RegisterKvCacheRequest``.

Two sources of geometry:

* a :class:`~kvd_engine.cache_layout.CacheGeometry` the engine states (the reference engine);
* vLLM >= 0.33's per-layer views, inferred by :func:`geometry_from_vllm_views`: each layer is a
  logical ``[num_blocks, heads, block_size, 2 * head_dim]`` view (K then V per token and
  head, :attr:`KvFormat.PACKED`) over one backing allocation shared by all layers; the
  physical order (HND for vLLM's ``LBHNC``/"HND", NHD for ``LBNHC``/"NHD") is read off the strides.

Host memory is moved into shm in place (once); CUDA memory is exported by IPC handle. The
layer placements are byte offsets inside the one region that backs every layer.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .cache_layout import CacheGeometry, KvFormat, KvLayout
from .shm import cuda_ipc_handle, known_region, move_storage_to_shm

logger = logging.getLogger(__name__)

__all__ = ["build_registration", "geometry_from_vllm_views", "ordered_layers", "region_of"]

_LAYER_INDEX = re.compile(r"(\d+)")


def ordered_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Layers sorted by the layer number in their name (``model.layers.12...`` after ``...3...``)."""

    def key(item: tuple[str, torch.Tensor]) -> tuple[int, str]:
        numbers = _LAYER_INDEX.findall(item[0])
        return (int(numbers[0]) if numbers else 0, item[0])

    return sorted(kv_caches.items(), key=key)


def geometry_from_vllm_views(
    kv_caches: Mapping[str, torch.Tensor], *, tp_rank: int, tp_size: int, total_num_kv_heads: int = 0
) -> CacheGeometry:
    """The geometry of vLLM >= 0.33's per-layer ``[B, H, N, 2D]`` views (one shared layout).

    Raises ValueError for caches kvd cannot describe (other ranks, non-dense blocks, MLA).
    """
    layers = ordered_layers(kv_caches)
    if not layers:
        raise ValueError("no KV cache layers to register")
    first = layers[0][1]
    if first.dim() != 4:
        raise ValueError(
            f"expected [blocks, heads, block_size, 2*head_dim] layer views, got shape {tuple(first.shape)}"
        )
    num_blocks, heads, block_size, content = first.shape
    if content % 2:
        raise ValueError(f"last dimension {content} is not K|V (2 * head_dim)")
    for name, t in layers:
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError(f"layer {name} differs from {layers[0][0]} in shape, strides or dtype")
    s_block, s_head, s_tok, s_elem = first.stride()
    dense = heads * block_size * content
    if s_elem != 1 or s_block != dense:
        raise ValueError(
            f"KV blocks are not dense per layer (strides {first.stride()}): set the layout to "
            "LBHNC (HND) or LBNHC (NHD)"
        )
    if s_head == block_size * content and s_tok == content:
        layout = KvLayout.HND
    elif s_tok == heads * content and s_head == content:
        layout = KvLayout.NHD
    else:
        raise ValueError(f"unrecognised per-block order (strides {first.stride()})")
    return CacheGeometry(
        num_layers=len(layers),
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=content // 2,
        dtype=first.dtype,
        kv_format=KvFormat.PACKED,
        layout=layout,
        total_num_kv_heads=total_num_kv_heads or heads * tp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def region_of(tensors: Sequence[torch.Tensor]) -> tuple[Any, int]:
    """The one ``MemoryRegion`` backing every tensor, and the byte offset of storage byte 0 in it.

    Host memory is moved into shm in place (once); CUDA memory is exported by IPC handle.
    """
    from kvd_client.v1 import common_pb2  # noqa: PLC0415 - protobuf loads with registration

    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        raise ValueError("kvd registers one memory region per rank: every layer must share one allocation")
    if storage.device.type == "cuda":
        handle = cuda_ipc_handle(tensors[0])
        region = common_pb2.MemoryRegion(
            kind=common_pb2.MEMORY_KIND_CUDA_IPC,
            size_bytes=int(storage.nbytes()),
            cuda_ipc=common_pb2.CudaIpcHandle(**handle),
        )
        return region, 0
    shm = known_region(tensors[0]) or move_storage_to_shm(tensors)
    region = common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=shm.size_bytes, shm_name=shm.name)
    return region, shm.data_offset


def build_registration(
    engine_id: str,
    kv_caches: Mapping[str, torch.Tensor],
    geometry: CacheGeometry,
    *,
    require_commits: bool = True,
    engine_pid: int | None = None,
) -> Any:
    """The ``kvd.v1.RegisterKvCacheRequest`` for one rank; moves host KV into shm first."""
    from kvd_client.v1 import common_pb2, engine_pb2  # noqa: PLC0415 - protobuf loads with registration

    layers = ordered_layers(kv_caches)
    if len(layers) != geometry.num_layers:
        raise ValueError(f"{len(layers)} KV tensors for a {geometry.num_layers}-layer geometry")
    tensors = [t for _, t in layers]
    region, base = region_of(tensors)
    elem = tensors[0].element_size()
    placements = []
    for t in tensors:
        start = base + int(t.storage_offset()) * elem
        split = geometry.kv_format is KvFormat.SPLIT
        v_offset = start + geometry.num_blocks * geometry.block_bytes if split else 0
        placements.append(common_pb2.LayerPlacement(region=0, k_offset=start, v_offset=v_offset))
    return engine_pb2.RegisterKvCacheRequest(
        engine_id=engine_id,
        layout=common_pb2.KvLayoutSpec(**geometry.layout_spec_fields()),
        regions=[region],
        layers=placements,
        require_commits=require_commits,
        engine_pid=os.getpid() if engine_pid is None else engine_pid,
    )
