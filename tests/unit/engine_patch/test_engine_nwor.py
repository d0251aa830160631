"""NWOR: only accepted draft positions reach the cache, counters add up, nothing syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fakes import forbid_sync_ops
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd_engine.cache_layout import CacheGeometry, KvFormat, KvLayout
from kvd_engine.nwor import (
    DeferredWriteManager,
    NworMode,
    acceptance_mask,
    committed_watermarks,
    num_valid_tokens,
)

GEOMETRIES = [
    CacheGeometry(1, 8, 4, 2, 8, torch.float32, KvFormat.SPLIT, KvLayout.NHD),
    CacheGeometry(1, 8, 4, 2, 8, torch.bfloat16, KvFormat.SPLIT, KvLayout.HND),
    CacheGeometry(1, 8, 4, 2, 8, torch.float16, KvFormat.JOINT, KvLayout.NHD),
    CacheGeometry(1, 8, 4, 2, 8, torch.float16, KvFormat.PACKED, KvLayout.HND),
]


def _batch(geometry: CacheGeometry, seed: int = 0):
    """A verification step: 2 requests, [base + 3 drafts] and [base + 2 drafts], + a prefill chunk."""
    gen = torch.Generator().manual_seed(seed)
    num_scheduled = torch.tensor([4, 3, 5])
    num_draft = torch.tensor([3, 2, 0])
    starts = torch.tensor([0, 4, 7, 12])
    # Slots: request 0 in block 2 (offsets 1..), request 1 in block 3, prefill in blocks 5-6.
    slots = torch.tensor([9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24])
    positions = torch.tensor([5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4])
    shape = (12, geometry.num_kv_heads, geometry.head_dim)
    key = torch.randn(shape, generator=gen).to(geometry.dtype)
    value = torch.randn(shape, generator=gen).to(geometry.dtype)
    return num_scheduled, num_draft, starts, slots, positions, key, value


def _run(mode: str, geometry: CacheGeometry, valid_sampled: torch.Tensor, undo: bool):
    io = geometry.slot_io()
    manager = DeferredWriteManager(mode, attention_reads_cache=undo, snapshotter=io if undo else None)
    cache = torch.full(geometry.layer_shape, 7, dtype=geometry.dtype)
    before = cache.clone()
    num_scheduled, num_draft, starts, slots, positions, key, value = _batch(geometry)
    manager.begin_window(int(slots.shape[0]))
    manager.write("layer.0", key, value, cache, slots, io.write)
    num_valid = num_valid_tokens(num_scheduled, num_draft, valid_sampled)
    mask = acceptance_mask(starts, num_valid, int(slots.shape[0]))
    manager.commit(mask)
    return manager, cache, before, mask, slots, key, value


def _slot_rows(geometry: CacheGeometry, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    k, v = geometry.kv_views(cache)
    b, o = slots // geometry.block_size, slots % geometry.block_size
    return torch.stack((k[b, o], v[b, o]))


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g.kv_format.name}-{g.layout.name}")
@pytest.mark.parametrize("undo", [False, True], ids=["deferred", "undo"])
def test_stage_writes_only_accepted_positions(geometry: CacheGeometry, undo: bool) -> None:
    # Request 0 accepts 1 of 3 drafts, request 1 accepts both, the prefill keeps everything.
    valid_sampled = torch.tensor([2, 3, 1])
    manager, cache, before, mask, slots, key, value = _run("stage", geometry, valid_sampled, undo)
    expected_mask = [True, True, False, False, True, True, True, True, True, True, True, True]
    assert mask.numpy().tolist() == expected_mask
    accepted = slots[mask]
    rejected = slots[~mask]
    got = _slot_rows(geometry, cache, accepted)
    assert torch.equal(got[0], key[mask]) and torch.equal(got[1], value[mask])
    # Rejected slots hold exactly the bytes they held before the step.
    assert torch.equal(_slot_rows(geometry, cache, rejected), _slot_rows(geometry, before, rejected))
    # Nothing else changed, except the null block (block 0) that absorbs masked lanes.
    untouched = torch.ones(geometry.num_slots, dtype=torch.bool)
    untouched[slots] = False
    untouched[: geometry.block_size] = False
    rest = torch.nonzero(untouched).flatten()
    assert torch.equal(_slot_rows(geometry, cache, rest), _slot_rows(geometry, before, rest))
    stats = manager.poll()
    assert (stats.windows, stats.committed_tokens, stats.rejected_tokens, stats.pending_windows) == (1, 10, 2, 0)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g.kv_format.name}-{g.layout.name}")
@pytest.mark.parametrize("undo", [False, True], ids=["deferred", "undo"])
def test_stage_and_immediate_agree_on_accepted_positions(geometry: CacheGeometry, undo: bool) -> None:
    valid_sampled = torch.tensor([1, 2, 1])  # request 0 rejects everything, request 1 accepts 1
    _, staged, _, mask, slots, _, _ = _run("stage", geometry, valid_sampled, undo)
    imm_manager, immediate, _, mask2, _, key, _ = _run("immediate", geometry, valid_sampled, undo)
    assert torch.equal(mask, mask2)
    accepted = slots[mask]
    assert torch.equal(_slot_rows(geometry, staged, accepted), _slot_rows(geometry, immediate, accepted))
    # Immediate mode wrote the rejected drafts too (that is what NWOR avoids).
    rejected = slots[~mask]
    assert torch.equal(_slot_rows(geometry, immediate, rejected)[0], key[~mask])
    assert imm_manager.poll().rejected_tokens == 4  # 3 of request 0, 1 of request 1


def test_off_mode_is_a_pass_through() -> None:
    geometry = GEOMETRIES[0]
    manager = DeferredWriteManager("off")
    assert manager.mode is NworMode.OFF
    assert manager.begin_window(12) is False
    calls: list[torch.Tensor] = []
    cache = torch.zeros(geometry.layer_shape)
    slots = torch.arange(4, 8)
    manager.write("l", torch.ones(4, 2, 8), torch.ones(4, 2, 8), cache, slots, lambda k, v, c, s: calls.append(s))
    assert len(calls) == 1 and calls[0] is slots
    assert manager.commit(torch.ones(4, dtype=torch.bool)) is None
    assert manager.poll().windows == 0


def test_writes_outside_a_window_go_straight_to_the_cache() -> None:
    manager = DeferredWriteManager("stage")
    calls: list[int] = []
    manager.write(
        "l", torch.ones(2, 1, 1), torch.ones(2, 1, 1), torch.zeros(1), torch.arange(2), lambda *a: calls.append(1)
    )
    assert calls == [1] and manager.num_staged == 0


def test_cancel_flushes_every_staged_write_and_counts_a_fallback() -> None:
    geometry = GEOMETRIES[0]
    io = geometry.slot_io()
    manager = DeferredWriteManager("stage")
    cache = torch.zeros(geometry.layer_shape)
    _, _, _, slots, _, key, value = _batch(geometry)
    manager.begin_window(12)
    manager.write("l", key, value, cache, slots, io.write)
    assert manager.num_staged == 1 and torch.count_nonzero(cache) == 0
    manager.cancel("test")
    assert not manager.window_active
    assert torch.equal(_slot_rows(geometry, cache, slots)[0], key)
    assert manager.stats().fallbacks == 1


def test_a_window_left_open_is_flushed_when_the_next_one_begins() -> None:
    manager = DeferredWriteManager("stage")
    flushed: list[int] = []
    manager.begin_window(2)
    manager.write(
        "l", torch.ones(2, 1, 1), torch.ones(2, 1, 1), torch.zeros(1), torch.arange(2), lambda *a: flushed.append(1)
    )
    assert manager.begin_window(2)
    assert flushed == [1] and manager.stats().fallbacks == 1


def test_staged_writes_use_private_copies_of_key_and_value() -> None:
    """A producer that reuses its K/V buffer for the next layer must not change staged KV."""
    geometry = GEOMETRIES[0]
    io = geometry.slot_io()
    manager = DeferredWriteManager("stage")
    cache = torch.zeros(geometry.layer_shape)
    key = torch.ones(2, 2, 8)
    manager.begin_window(2)
    manager.write("l", key, key, cache, torch.tensor([4, 5]), io.write)
    key.fill_(9.0)
    manager.commit(torch.tensor([True, True]))
    assert torch.all(_slot_rows(geometry, cache, torch.tensor([4, 5])) == 1.0)


def test_undo_strategy_needs_a_snapshotter() -> None:
    with pytest.raises(ValueError, match="SlotSnapshotter"):
        DeferredWriteManager("stage", attention_reads_cache=True)


def test_mode_parsing_ignores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NworMode.parse("IMMEDIATE") is NworMode.IMMEDIATE
    assert NworMode.parse("disabled") is NworMode.OFF
    assert NworMode.parse("off") is NworMode.OFF
    monkeypatch.setenv("KVD_NWOR_MODE", "immediate")
    monkeypatch.setenv("KVD_DISABLE_NWOR", "1")
    assert NworMode.parse(None) is NworMode.STAGE
    assert NworMode.parse("stage") is NworMode.STAGE
    with pytest.raises(ValueError, match="unknown NWOR mode"):
        NworMode.parse("sometimes")


@pytest.mark.parametrize("undo", [False, True], ids=["deferred", "undo"])
def test_commit_path_calls_no_synchronizing_op(monkeypatch: pytest.MonkeyPatch, undo: bool) -> None:
    geometry = GEOMETRIES[1]
    io = geometry.slot_io()
    manager = DeferredWriteManager("stage", attention_reads_cache=undo, snapshotter=io)
    cache = torch.zeros(geometry.layer_shape, dtype=geometry.dtype)
    num_scheduled, num_draft, starts, slots, positions, key, value = _batch(geometry)
    valid_sampled = torch.tensor([2, 3, 1])
    with forbid_sync_ops(monkeypatch) as called:
        manager.begin_window(12)
        for layer in range(3):
            manager.write(f"layer.{layer}", key, value, cache, slots, io.write)
        num_valid = num_valid_tokens(num_scheduled, num_draft, valid_sampled)
        mask = acceptance_mask(starts, num_valid, 12)
        committed_watermarks(positions, starts, num_valid)
        manager.commit(mask)
    assert called == []
    assert manager.poll().committed_tokens == 10  # token lanes, not lanes x layers


# --- the device-side helpers against a plain-Python reference -----------------------------------


@st.composite
def _steps(draw: st.DrawFn):
    num_reqs = draw(st.integers(1, 6))
    rows = []
    for _ in range(num_reqs):
        drafts = draw(st.integers(0, 4))
        base = draw(st.integers(1, 3)) if drafts == 0 else 1
        sampled = draw(st.integers(0 if drafts == 0 else 1, drafts + 1))
        start_pos = draw(st.integers(0, 50))
        rows.append((base + drafts, drafts, sampled, start_pos))
    padding = draw(st.integers(0, 3))
    return rows, padding


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_mask_and_watermarks_match_a_reference(step) -> None:
    rows, padding = step
    sched = [r[0] for r in rows]
    starts = np.concatenate(([0], np.cumsum(sched)))
    lanes = int(starts[-1]) + padding
    positions = np.zeros(lanes, dtype=np.int64)
    expected_mask = np.zeros(lanes, dtype=bool)
    expected_marks = []
    for i, (n, drafts, sampled, start_pos) in enumerate(rows):
        positions[starts[i] : starts[i + 1]] = np.arange(start_pos, start_pos + n)
        valid = n if drafts == 0 else n - drafts + max(sampled - 1, 0)
        expected_mask[starts[i] : starts[i] + valid] = True
        expected_marks.append(start_pos + valid)
    num_valid = num_valid_tokens(
        torch.tensor(sched), torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    )
    starts_t = torch.tensor(starts, dtype=torch.int32)
    mask = acceptance_mask(starts_t, num_valid, lanes)
    assert mask.numpy().tolist() == expected_mask.tolist()
    marks = committed_watermarks(torch.tensor(positions), starts_t, num_valid)
    assert marks.numpy().tolist() == expected_marks
