"""How an engine's paged KV cache is shaped, and the vectorised slot writers built on it.

One :class:`CacheGeometry` describes one rank's cache the way the daemon's
``KvLayoutSpec`` does (format, NHD/HND, block size, local heads, head dim, dtype), gives the
per-layer tensor shape, turns a layer tensor into logical ``[num_blocks, block_size,
heads, head_dim]`` K and V views whatever the physical order, and builds the proto spec and
placements to register it. The writers index whole batches of slots with ``index_put_``:
no per-token or per-block Python loop.

Block 0 is the *null block* (as in vLLM's block pool): never handed to a request. Lanes
whose slot is negative (padding, NWOR-rejected lanes) are routed there, which lets a masked
write stay a single scatter with no host sync to drop the masked lanes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from kvd_client.dtypes import DTYPE_OF_NAME
from kvd_client.v1.schema import KvFormat, KvLayout

logger = logging.getLogger(__name__)

__all__ = [
    "NULL_BLOCK",
    "CacheGeometry",
    "KvFormat",
    "KvLayout",
    "SlotIO",
    "dtype_name",
]

NULL_BLOCK = 0

# Every dtype the wire can name, by its torch name (kvd_client.dtypes holds the one table).
_DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, name): name for name in DTYPE_OF_NAME}

# The wire's KvFormat and KvLayout (kvd.v1, generated). An engine cache is SPLIT ([2, num_blocks,
# <block>]: all K blocks, then all V blocks), JOINT ([num_blocks, 2, <block>]: each block holds
# its K then its V) or PACKED (vLLM >= 0.33: [num_blocks, <block with head_dim 2*D>], each
# (token, head) vector K then V); the engine patch writes no MLA caches.
_ENGINE_FORMATS = (KvFormat.SPLIT, KvFormat.JOINT, KvFormat.PACKED)


def dtype_name(dtype: torch.dtype) -> str:
    """The daemon's name for a torch dtype (raises for dtypes kvd cannot ship)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"KV dtype {dtype} is not supported by kvd (supported: {sorted(_DTYPE_NAMES.values())})"
        ) from None


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """One rank's paged KV cache. Validated on construction."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    kv_format: KvFormat = KvFormat.SPLIT
    layout: KvLayout = KvLayout.NHD
    total_num_kv_heads: int = 0  # 0: num_kv_heads * tp_size
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheGeometry.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError("CacheGeometry needs at least 2 blocks: block 0 is the reserved null block")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")
        dtype_name(self.dtype)
        if self.kv_format not in _ENGINE_FORMATS:
            raise ValueError(f"CacheGeometry.kv_format must be one of {[f.name for f in _ENGINE_FORMATS]}")
        if self.total_num_kv_heads == 0:
            object.__setattr__(self, "total_num_kv_heads", self.num_kv_heads * self.tp_size)

    # -- sizes -------------------------------------------------------------------------------

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one plane (K or V), in memory order."""
        if self.layout is KvLayout.NHD:
            return (self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's tensor (see :class:`KvFormat`)."""
        if self.kv_format is KvFormat.SPLIT:
            return (2, self.num_blocks, *self.block_shape)
        if self.kv_format is KvFormat.JOINT:
            return (self.num_blocks, 2, *self.block_shape)
        a, b, _ = self.block_shape
        return (self.num_blocks, a, b, 2 * self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane (K alone or V alone)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_size

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    # -- views -------------------------------------------------------------------------------

    def layer_views(self, region: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer tensors laid back to back over a flat uint8 ``region`` (zero copy)."""
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("layer_views wants a flat uint8 region")
        if region.numel() < self.total_bytes:
            raise ValueError(f"region of {region.numel()} bytes is smaller than the cache ({self.total_bytes})")
        flat = region[: self.total_bytes].view(self.dtype)
        per_layer = self.layer_bytes // self.elem_size
        return [flat[i * per_layer : (i + 1) * per_layer].view(self.layer_shape) for i in range(self.num_layers)]

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ``[num_blocks, block_size, heads, head_dim]`` views of K and V (no copy)."""
        if tuple(layer.shape) != self.layer_shape:
            raise ValueError(f"layer tensor has shape {tuple(layer.shape)}, geometry says {self.layer_shape}")
        if self.kv_format is KvFormat.SPLIT:
            k, v = layer[0], layer[1]
        elif self.kv_format is KvFormat.JOINT:
            k, v = layer[:, 0], layer[:, 1]
        else:
            k, v = layer[..., : self.head_dim], layer[..., self.head_dim :]
        if self.layout is KvLayout.HND:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k, v

    def placements(self, base_offset: int = 0) -> list[tuple[int, int]]:
        """Per layer ``(k_offset, v_offset)`` in bytes inside one region (layers back to back)."""
        out = []
        for i in range(self.num_layers):
            start = base_offset + i * self.layer_bytes
            if self.kv_format is KvFormat.SPLIT:
                out.append((start, start + self.num_blocks * self.block_bytes))
            else:
                out.append((start, 0))
        return out

    def layout_spec_fields(self) -> dict[str, Any]:
        """The fields of ``kvd.v1.KvLayoutSpec`` (plain ints: no protobuf is needed to build them)."""
        return {
            "num_layers": self.num_layers,
            "kv_format": int(self.kv_format),
            "layout": int(self.layout),
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "total_num_kv_heads": self.total_num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": int(DTYPE_OF_NAME[dtype_name(self.dtype)]),
            "num_blocks": self.num_blocks,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
        }

    def slot_io(self) -> SlotIO:
        return SlotIO(self)


class SlotIO:
    """Vectorised writes and snapshots of token slots of one geometry.

    ``write`` is a :data:`kvd_engine.nwor.KvWriter`; ``gather``/``restore`` make it a
    :class:`kvd_engine.nwor.SlotSnapshotter`. Slots are ``block * block_size + offset``;
    negative slots go to the null block.
    """

    def __init__(self, geometry: CacheGeometry) -> None:
        self.geometry = geometry

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.geometry.block_size
        s = torch.where(slots >= 0, slots, torch.full_like(slots, NULL_BLOCK * bs)).to(torch.int64)
        return s // bs, s % bs

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` rows ``[:len(slot_mapping)]`` into their slots."""
        n = slot_mapping.shape[0]
        k, v = self.geometry.kv_views(kv_cache)
        b, o = self._index(slot_mapping)
        k.index_put_((b, o), key[:n].to(k.dtype))
        v.index_put_((b, o), value[:n].to(v.dtype))

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[2, len(slots), heads, head_dim]``: what K and V hold at ``slots`` (a copy)."""
        k, v = self.geometry.kv_views(kv_cache)
        b, o = self._index(slots)
        return torch.stack((k[b, o], v[b, o]))

    def restore(self, kv_cache: torch.Tensor, slots: torch.Tensor, snapshot: torch.Tensor, keep: torch.Tensor) -> None:
        """Put ``snapshot`` back where ``keep`` is False; lanes kept are rewritten unchanged."""
        k, v = self.geometry.kv_views(kv_cache)
        b, o = self._index(slots)
        current = torch.stack((k[b, o], v[b, o]))
        merged = torch.where(keep.view(1, -1, 1, 1), current, snapshot)
        k.index_put_((b, o), merged[0])
        v.index_put_((b, o), merged[1])
