"""Scratch KV caches with a checksummed pattern: what `kvd selftest` moves between daemons.

Both sides compute the same pattern from (seed, position), so the puller verifies every byte
without trusting the holder. The pattern is made of 64-bit words, word ``i`` a bijective mix of
``i`` and the seed: every word of a cache is distinct, so a block landing at the wrong offset, a
stale block or a torn read is always caught. Generating it costs a few in-place passes over
``nbytes / 8`` words (about 0.1 s per 128 MiB on one core), and a pull is verified by one bulk
comparison against a pattern generated once (:class:`Pattern`), not by regenerating it per pull.

The layout is Llama-3-8B-shaped (32 layers, 8 KV heads of 128 dims, bf16, blocks of 16
tokens), so the bytes and descriptor counts are realistic.

numpy, not torch: the daemon's control process fills its scratch engine here and must not import
torch (it would add seconds of CPU to every daemon's start: docs/performance.md, "Start-up").
Buffers may be numpy arrays or CPU torch tensors (read through ``.numpy()``, no copy); a caller
with a GPU buffer copies the pattern's bytes to the device itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

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


Bytes = npt.NDArray[np.uint8]
Words = npt.NDArray[np.int64]


def as_bytes(buffer: Any) -> Bytes:
    """A flat uint8 numpy view of ``buffer`` (a numpy array, or a CPU torch tensor: no copy)."""
    array = buffer if isinstance(buffer, np.ndarray) else buffer.detach().numpy()
    flat = array.reshape(-1)
    if flat.dtype != np.uint8:
        raise ValueError(f"a scratch buffer holds bytes (uint8), got {flat.dtype}")
    return flat


def _fill_words(words: Words, first: int, seed: int) -> None:
    """Word ``first + j`` of the pattern into ``words[j]``, in place.

    Multiplying by an odd constant and xor-shifting (logical shifts, hence the masks) are both
    bijections of 64-bit words, so distinct positions never share a word. numpy's int64
    arithmetic wraps around as the pattern needs (no overflow checks on arrays).
    """
    words[:] = np.arange(first, first + words.size, dtype=np.int64)
    np.multiply(words, _MUL_1, out=words)
    np.add(words, seed * 0x632BE59BD9B4E019 % (1 << 63), out=words)
    shifted = np.empty_like(words)
    np.right_shift(words, 31, out=shifted)
    np.bitwise_and(shifted, _LOW_33, out=shifted)
    np.bitwise_xor(words, shifted, out=words)
    np.multiply(words, _MUL_2, out=words)
    np.right_shift(words, 29, out=shifted)
    np.bitwise_and(shifted, _LOW_35, out=shifted)
    np.bitwise_xor(words, shifted, out=words)


def fill_pattern(buffer: Any, seed: int) -> None:
    """Write the pattern of ``seed`` into a flat byte buffer (any length; 8-byte aligned start)."""
    flat = as_bytes(buffer)
    total = flat.size
    whole = total // 8
    words = flat[: whole * 8].view(np.int64)
    for lo in range(0, whole, CHUNK_WORDS):
        _fill_words(words[lo : min(whole, lo + CHUNK_WORDS)], lo, seed)
    if total % 8:
        tail = np.empty(1, dtype=np.int64)
        _fill_words(tail, whole, seed)
        flat[whole * 8 :] = tail.view(np.uint8)[: total % 8]


class Pattern:
    """The pattern of ``seed`` over ``nbytes``, generated once; checks whole buffers in bulk."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.seed = seed
        self.expected: Bytes = np.empty(nbytes, dtype=np.uint8)
        fill_pattern(self.expected, seed)

    def mismatches(self, buffer: Any) -> int:
        """How many bytes of ``buffer`` differ from the pattern (0: all good).

        The common case (all equal) is one pass over 64-bit words; bytes are counted only when
        something differs.
        """
        flat = as_bytes(buffer)
        if flat.size != self.expected.size:
            raise ValueError(f"buffer has {flat.size} bytes, the pattern {self.expected.size}")
        whole = flat.size // 8 * 8
        if np.array_equal(flat[:whole].view(np.uint64), self.expected[:whole].view(np.uint64)) and np.array_equal(
            flat[whole:], self.expected[whole:]
        ):
            return 0
        return int(np.count_nonzero(flat != self.expected))


def pattern_mismatches(buffer: Any, seed: int) -> int:
    """How many bytes of ``buffer`` differ from the pattern of ``seed`` (generates it: one-off checks)."""
    return Pattern(as_bytes(buffer).size, seed).mismatches(buffer)
