"""What an engine's KV cache looks like in memory.

A :class:`LayoutSpec` is everything the daemon needs to find the bytes of token ``t`` of head
``h`` of layer ``l`` (K or V) inside the engine's memory regions, given the per-layer
:class:`LayerPlacement`. It is frozen and validated on construction, so every later piece of
code can trust it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from kvd_client.errors import InvalidArgument
from kvd_client.v1.schema import KvFormat, KvLayout, LayerPlacement

__all__ = [
    "DTYPE_SIZES",
    "KvFormat",
    "KvLayout",
    "LayerPlacement",
    "LayoutSpec",
    "contiguous_placements",
]

# KvFormat, KvLayout and LayerPlacement are the wire's (generated from proto/kvd/v1/common.proto).
# KvLayout.NHD: [block_size, num_kv_heads, head_dim], a token's heads are contiguous; HND:
# [num_kv_heads, block_size, head_dim], a head's tokens are contiguous. KvFormat.SPLIT: K blocks
# at k_offset, V blocks at v_offset (vLLM's [2, num_blocks, ...]); JOINT: each block is
# [2, <block>], K then V (FlashInfer's [num_blocks, 2, ...]); MLA: one latent vector per token,
# one "head"; PACKED: [K | V] of one token and head side by side (vLLM 0.33 on CPU).


DTYPE_SIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """The KV cache of one engine rank. Validated on construction (raises InvalidArgument)."""

    num_layers: int
    kv_format: KvFormat
    layout: KvLayout
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    total_num_kv_heads: int = 0  # 0: same as num_kv_heads (no TP slicing)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.total_num_kv_heads == 0:
            object.__setattr__(self, "total_num_kv_heads", self.num_kv_heads)
        problems: list[str] = []
        if self.total_num_kv_heads < 0:
            problems.append(f"total_num_kv_heads must be >= 0, got {self.total_num_kv_heads}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "num_blocks", "tp_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            problems.append(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if not 0 <= self.tp_rank < max(self.tp_size, 1):
            problems.append(f"tp_rank {self.tp_rank} is not in 0..tp_size-1 (tp_size {self.tp_size})")
        if self.kv_format is KvFormat.MLA and self.num_kv_heads != 1:
            problems.append(f"an MLA cache has one latent 'head', got num_kv_heads {self.num_kv_heads}")
        if self.kv_format is not KvFormat.MLA and self.tp_size >= 1 and self.num_kv_heads >= 1:
            expected = max(1, self.total_num_kv_heads // self.tp_size) if self.total_num_kv_heads else 0
            if self.total_num_kv_heads % self.tp_size and self.tp_size % self.total_num_kv_heads:
                problems.append(
                    f"total_num_kv_heads {self.total_num_kv_heads} and tp_size {self.tp_size}: "
                    "neither divides the other"
                )
            elif expected != self.num_kv_heads:
                problems.append(
                    f"num_kv_heads {self.num_kv_heads} on this rank disagrees with total_num_kv_heads "
                    f"{self.total_num_kv_heads} / tp_size {self.tp_size} (expected {expected})"
                )
        if problems:
            raise InvalidArgument("invalid KV layout: " + "; ".join(problems))

    # --- sizes -----------------------------------------------------------------------------

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def head_bytes_per_token(self) -> int:
        """Bytes of one head of one token in one plane (one K or one V vector; K|V for PACKED)."""
        vectors = 2 if self.kv_format is KvFormat.PACKED else 1
        return vectors * self.head_dim * self.elem_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one K (or V, or latent) plane: all heads of this rank."""
        return self.num_kv_heads * self.head_bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane (K alone, V alone, or the MLA latent)."""
        return self.block_size * self.token_bytes

    @property
    def kv_planes(self) -> int:
        """2 (K and V apart) or 1 (MLA latent; PACKED, whose plane holds K|V vectors)."""
        return 1 if self.kv_format in (KvFormat.MLA, KvFormat.PACKED) else 2

    @property
    def block_stride(self) -> int:
        """Distance in bytes between block b and b+1 of one layer (per plane for SPLIT)."""
        return 2 * self.block_bytes if self.kv_format is KvFormat.JOINT else self.block_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes one layer occupies (both planes)."""
        return self.num_blocks * self.block_bytes * self.kv_planes

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.num_layers

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        return math.ceil(num_tokens / self.block_size)

    def head_range(self) -> tuple[int, int]:
        """The model's KV heads this rank holds, [first, last+1): a replica when TP > heads."""
        if self.kv_format is KvFormat.MLA:
            return (0, 1)
        if self.tp_size <= self.total_num_kv_heads:
            start = self.tp_rank * self.num_kv_heads
            return (start, start + self.num_kv_heads)
        ranks_per_head = self.tp_size // self.total_num_kv_heads
        head = self.tp_rank // ranks_per_head
        return (head, head + 1)

    # --- placements ---------------------------------------------------------------------------

    def plane_offsets(self, placement: LayerPlacement) -> tuple[int, ...]:
        """Byte offset of block 0 of each plane of a layer (K, V) or (latent,)."""
        if self.kv_format is KvFormat.SPLIT:
            return (placement.k_offset, placement.v_offset)
        if self.kv_format is KvFormat.JOINT:
            return (placement.k_offset, placement.k_offset + self.block_bytes)
        return (placement.k_offset,)

    def validate_placements(self, placements: Sequence[LayerPlacement], region_sizes: Sequence[int]) -> None:
        """Raise InvalidArgument unless every layer's blocks fit inside its region."""
        if len(placements) != self.num_layers:
            raise InvalidArgument(
                f"{len(placements)} layer placements for a {self.num_layers}-layer cache: one per layer is needed"
            )
        span = (self.num_blocks - 1) * self.block_stride + (
            2 * self.block_bytes if self.kv_format is KvFormat.JOINT else self.block_bytes
        )
        for index, placement in enumerate(placements):
            if not 0 <= placement.region < len(region_sizes):
                raise InvalidArgument(
                    f"layer {index} names region {placement.region}, but {len(region_sizes)} regions were given"
                )
            size = region_sizes[placement.region]
            starts = [placement.k_offset]
            if self.kv_format is KvFormat.SPLIT:
                starts.append(placement.v_offset)
            for start in starts:
                if start < 0 or start + span > size:
                    raise InvalidArgument(
                        f"layer {index}: bytes [{start}, {start + span}) fall outside region "
                        f"{placement.region} of {size} bytes"
                    )
            if self.kv_format is KvFormat.SPLIT:
                k, v = placement.k_offset, placement.v_offset
                if k < v + span and v < k + span:
                    raise InvalidArgument(f"layer {index}: K at {k} and V at {v} overlap ({span} bytes each)")

    def validate_block_ids(self, block_ids: Sequence[int], what: str) -> None:
        """Raise InvalidArgument unless every id names a block of this cache.

        Every pull checks its ids (at StartPull and in the plan): min and max run in C;
        the ids at fault are listed only when there are some."""
        if not len(block_ids) or (min(block_ids) >= 0 and max(block_ids) < self.num_blocks):
            return
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise InvalidArgument(
                f"{what}: block ids {bad[:8]}{'...' if len(bad) > 8 else ''} out of range 0..{self.num_blocks - 1}"
            )

    def describe(self) -> str:
        """Short human description for error messages."""
        return (
            f"{self.kv_format.name}/{self.layout.name} layers={self.num_layers} block_size={self.block_size} "
            f"heads={self.num_kv_heads}/{self.total_num_kv_heads} head_dim={self.head_dim} dtype={self.dtype} "
            f"tp={self.tp_rank}/{self.tp_size}"
        )


def contiguous_placements(spec: LayoutSpec, region: int = 0, base: int = 0) -> list[LayerPlacement]:
    """Layers back to back in one region, as a test engine or the selftest allocates them."""
    placements = []
    for layer in range(spec.num_layers):
        start = base + layer * spec.layer_bytes
        v_offset = start + spec.num_blocks * spec.block_bytes if spec.kv_format is KvFormat.SPLIT else 0
        placements.append(LayerPlacement(region=region, k_offset=start, v_offset=v_offset))
    return placements
