"""Scratch KV caches with a checksummed pattern: what `kvd selftest` moves between daemons.

Both sides compute the same pattern from (seed, position), so the puller verifies every byte
without trusting the holder. The pattern is made of 64-bit words, word ``i`` a bijective mix of
``i`` and the seed: every word of a cache is distinct, so a block landing at the wrong offset, a
stale block or a torn read is always caught. Generating it costs a few in-place passes over
``nbytes / 8`` words (about 0.1 s per 128 MiB on one core), and a pull is verified by one bulk
comparison against a pattern generated once (:class:`Pattern`), not by regenerating it per pull.

The layout is Llama-3-8B-shaped (32 layers, 8 KV heads of 128 dims, bf16, blocks of 16
tokens), so the bytes and descriptor counts are realistic.
"""

from __future__ import annotations

import torch

from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec

MAX_SCRATCH_BYTES = 1 << 30
CHUNK_WORDS = 1 << 21  # 16 MiB per pass: stays in cache-friendly pieces, no big temporaries

_MUL_1 = 0x9E3779B97F4A7C15 - (1 << 64)  # odd constants (splitmix64), as signed int64
_MUL_2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_LOW_33 = (1 << 33) - 1
_LOW_35 = (1 << 35) - 1


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


def _fill_words(words: torch.Tensor, first: int, seed: int) -> None:
    """Word ``first + j`` of the pattern into ``words[j]``, in place.

    Multiplying by an odd constant and xor-shifting (logical shifts, hence the masks) are both
    bijections of 64-bit words, so distinct positions never share a word.
    """
    torch.arange(first, first + words.numel(), dtype=torch.int64, out=words)
    words.mul_(_MUL_1).add_(seed * 0x632BE59BD9B4E019 % (1 << 63))
    words.bitwise_xor_((words >> 31).bitwise_and_(_LOW_33))
    words.mul_(_MUL_2)
    words.bitwise_xor_((words >> 29).bitwise_and_(_LOW_35))


def fill_pattern(buffer: torch.Tensor, seed: int) -> None:
    """Write the pattern of ``seed`` into a flat uint8 tensor (any length; 8-byte aligned start)."""
    total = buffer.numel()
    whole = total // 8
    words = buffer[: whole * 8].view(torch.int64)
    for lo in range(0, whole, CHUNK_WORDS):
        _fill_words(words[lo : min(whole, lo + CHUNK_WORDS)], lo, seed)
    if total % 8:
        tail = torch.empty(1, dtype=torch.int64)
        _fill_words(tail, whole, seed)
        buffer[whole * 8 :].copy_(tail.view(torch.uint8)[: total % 8])


class Pattern:
    """The pattern of ``seed`` over ``nbytes``, generated once; checks whole buffers in bulk."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.seed = seed
        self.expected = torch.empty(nbytes, dtype=torch.uint8)
        fill_pattern(self.expected, seed)

    def mismatches(self, buffer: torch.Tensor) -> int:
        """How many bytes of ``buffer`` differ from the pattern (0: all good).

        ``torch.equal`` is a memcmp-speed pass; counting only happens when something differs.
        """
        flat = buffer.reshape(-1)
        if flat.numel() != self.expected.numel():
            raise ValueError(f"buffer has {flat.numel()} bytes, the pattern {self.expected.numel()}")
        if torch.equal(flat, self.expected):
            return 0
        return int((flat != self.expected).sum())


def pattern_mismatches(buffer: torch.Tensor, seed: int) -> int:
    """How many bytes of ``buffer`` differ from the pattern of ``seed`` (generates it: one-off checks)."""
    return Pattern(buffer.numel(), seed).mismatches(buffer)
