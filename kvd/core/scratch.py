"""Scratch KV caches with a checksummed pattern: what `kvd selftest` moves between daemons.

Both sides compute the same pattern from (seed, byte offset), so the puller verifies every
byte without trusting the holder. The layout is Llama-3-8B-shaped (32 layers, 8 KV heads of
128 dims, bf16, blocks of 16 tokens), so the bytes and descriptor counts are realistic.
"""

from __future__ import annotations

import torch

from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec

MAX_SCRATCH_BYTES = 1 << 30
PATTERN_CHUNK = 1 << 24


def scratch_layout(size_bytes: int, tp_rank: int = 0) -> LayoutSpec:
    """A Llama-8B-shaped layout with as many blocks as fit in ``size_bytes`` (at least one)."""
    per_block = 32 * 2 * 16 * 8 * 128 * 2  # layers * K/V * tokens * heads * dims * bf16
    return LayoutSpec(
        num_layers=32,
        kv_format=KvFormat.SPLIT,
        layout=KvLayout.NHD,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        num_blocks=max(1, size_bytes // per_block),
        tp_rank=tp_rank,
    )


def fill_pattern(buffer: torch.Tensor, seed: int) -> None:
    """Write the pattern of ``seed`` into a uint8 tensor, chunk by chunk (vectorised)."""
    total = buffer.numel()
    for start in range(0, total, PATTERN_CHUNK):
        stop = min(total, start + PATTERN_CHUNK)
        buffer[start:stop].copy_(_pattern(start, stop, seed, buffer.device))


def pattern_mismatches(buffer: torch.Tensor, seed: int, start: int = 0, stop: int | None = None) -> int:
    """How many bytes of ``buffer[start:stop]`` differ from the pattern (0: all good)."""
    stop = buffer.numel() if stop is None else stop
    bad = 0
    for lo in range(start, stop, PATTERN_CHUNK):
        hi = min(stop, lo + PATTERN_CHUNK)
        bad += int((buffer[lo:hi] != _pattern(lo, hi, seed, buffer.device)).sum())
    return bad


def _pattern(start: int, stop: int, seed: int, device: torch.device) -> torch.Tensor:
    offsets = torch.arange(start, stop, dtype=torch.int64, device=device)
    mixed = (offsets * 2654435761 + (offsets >> 13) * 40503 + seed * 97) & 0xFFFFFFFF
    return ((mixed >> 11) & 0xFF).to(torch.uint8)
