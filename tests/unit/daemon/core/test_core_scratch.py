"""The selftest's pattern: cheap to make and check, and it catches what a bad transfer would do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvd.core import scratch


def test_fill_and_pattern_agree_for_any_length() -> None:
    for nbytes in (1, 7, 8, 9, 4096 + 3, (scratch.CHUNK_WORDS * 8) + 13):
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        scratch.fill_pattern(buffer, seed=11)
        assert scratch.Pattern(nbytes, 11).mismatches(buffer) == 0


def test_every_word_is_distinct_so_a_misplaced_block_is_caught() -> None:
    pattern = scratch.Pattern(8 << 20, seed=3)
    words = pattern.expected.view(np.int64)
    assert np.unique(words).size == words.size
    block = 64 << 10
    moved = pattern.expected.copy()
    moved[:block] = pattern.expected[block : 2 * block]  # block 1 landed where block 0 belongs
    assert pattern.mismatches(moved) > block // 2


def test_a_single_flipped_bit_and_a_zeroed_tail_are_counted() -> None:
    pattern = scratch.Pattern(1 << 20, seed=5)
    bad = pattern.expected.copy()
    bad[12345] ^= 0x10
    assert pattern.mismatches(bad) == 1
    bad = torch.from_numpy(pattern.expected.copy())  # a torch tensor is read through .numpy()
    bad[-100:] = 0
    assert pattern.mismatches(bad) >= 99  # a zero byte may match by chance, not a hundred


def test_seeds_differ_and_sizes_must_match() -> None:
    a, b = scratch.Pattern(4096, 1), scratch.Pattern(4096, 2)
    assert a.mismatches(b.expected) > 4000
    with pytest.raises(ValueError, match="bytes"):
        a.mismatches(torch.zeros(10, dtype=torch.uint8))


def test_the_pattern_is_the_same_in_every_process_and_version() -> None:
    """Holder and puller may be different daemons, even different kvd versions: pin the bytes."""
    head = scratch.Pattern(16, seed=42).expected.tolist()
    again = torch.empty(16, dtype=torch.uint8)
    scratch.fill_pattern(again, 42)
    assert again.tolist() == head == [105, 254, 174, 133, 237, 179, 7, 211, 47, 142, 78, 28, 86, 86, 110, 184]


def test_the_control_process_imports_no_torch() -> None:
    """The daemon's control process (its servicers, core, CLI) runs without torch: importing it
    costs seconds of CPU at every start, and only the data-plane worker needs it."""
    import subprocess
    import sys

    code = (
        "import sys, kvd.cli.main, kvd.server.app, kvd.core.daemon, kvd.server.servicers, kvd.core.scratch;"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'nixl'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout
