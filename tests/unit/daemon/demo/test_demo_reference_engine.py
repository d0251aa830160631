"""The reference engine: deterministic KV, acceptance patterns, hook order, NWOR, no syncs."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from engine_fakes import forbid_sync_ops

from kvd.demo.reference_engine import (
    AcceptancePattern,
    BlockAllocator,
    OutOfBlocks,
    ReferenceEngine,
    expected_kv,
    kv_values,
    oracle_next_token,
)
from kvd_engine.cache_layout import CacheGeometry, KvFormat, KvLayout
from kvd_engine.engine_api import NullWorkerConnector, TransferResults

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 8]


def _oracle_tokens(prompt: list[int], n: int, vocab: int = 1000) -> list[int]:
    out, token, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        token = oracle_next_token(token, pos, vocab)
        out.append(token)
        pos += 1
    return out


def _engine(**kw: Any) -> ReferenceEngine:
    kw.setdefault("num_blocks", 32)
    kw.setdefault("block_size", 4)
    return ReferenceEngine(**kw)


def _assert_request_kv_is_expected(engine: ReferenceEngine, request_id: str) -> None:
    for rank in range(len(engine.ranks)):
        for layer in range(engine.num_layers):
            got = engine.request_kv(request_id, layer, rank)
            want = engine.expected_request_kv(request_id, layer, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (request_id, rank, layer)


def test_kv_values_are_exact_in_half_precision() -> None:
    x = kv_values(torch.arange(50), torch.arange(50), 3, torch.arange(4), 16, 1)
    assert torch.equal(x.to(torch.bfloat16).to(torch.float32), x)
    assert torch.equal(x.to(torch.float16).to(torch.float32), x)


def test_expected_kv_depends_on_every_coordinate() -> None:
    base = expected_kv([1, 2, 3], layer=0, head_ids=[0, 1], head_dim=4)
    for other in (
        expected_kv([1, 2, 4], layer=0, head_ids=[0, 1], head_dim=4),
        expected_kv([1, 2, 3], layer=1, head_ids=[0, 1], head_dim=4),
        expected_kv([1, 2, 3], layer=0, head_ids=[1, 2], head_dim=4),
        expected_kv([1, 2, 3], layer=0, head_ids=[0, 1], head_dim=4, start_position=1),
    ):
        assert not torch.equal(base[0], other[0])
    assert not torch.equal(base[0], base[1])


def test_block_allocator_never_hands_out_the_null_block() -> None:
    alloc = BlockAllocator(4)
    assert sorted(alloc.allocate(3)) == [1, 2, 3]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


@pytest.mark.parametrize(
    "fmt,layout,dtype",
    [
        (KvFormat.SPLIT, KvLayout.NHD, torch.float16),
        (KvFormat.SPLIT, KvLayout.HND, torch.bfloat16),
        (KvFormat.JOINT, KvLayout.NHD, torch.float32),
        (KvFormat.PACKED, KvLayout.HND, torch.float16),
    ],
)
def test_prefill_and_decode_write_the_expected_kv(fmt: KvFormat, layout: KvLayout, dtype: torch.dtype) -> None:
    with _engine(
        kv_format=fmt, layout=layout, dtype=dtype, tp_size=2, total_num_kv_heads=4, check_kv_reads=True
    ) as engine:
        engine.add_request("a", PROMPT, max_tokens=6)
        engine.add_request("b", PROMPT[:5], max_tokens=3)
        engine.run()
        assert engine.requests["a"].output_token_ids == _oracle_tokens(PROMPT, 6)
        assert engine.requests["b"].output_token_ids == _oracle_tokens(PROMPT[:5], 3)
        _assert_request_kv_is_expected(engine, "a")
        _assert_request_kv_is_expected(engine, "b")


def test_caches_live_in_shm_and_are_removed_on_close() -> None:
    engine = _engine()
    path = engine.ranks[0].region.path
    assert os.path.exists(path)
    mapped = torch.from_file(path, shared=True, size=engine.ranks[0].geometry.total_bytes, dtype=torch.uint8)
    engine.add_request("a", PROMPT, max_tokens=2)
    engine.run()
    assert torch.equal(mapped, engine.ranks[0].region.tensor)  # another mapping sees the writes
    engine.close()
    assert not os.path.exists(path)


def test_two_engines_are_bit_identical() -> None:
    with (
        _engine(num_speculative_tokens=2, acceptance=AcceptancePattern.random(3)) as one,
        _engine(num_speculative_tokens=2, acceptance=AcceptancePattern.random(3)) as two,
    ):
        for engine in (one, two):
            engine.add_request("a", PROMPT, max_tokens=9)
        while one.has_work():
            r1, r2 = one.step(), two.step()
            assert r1.attention.keys() == r2.attention.keys()
            for rid in r1.attention:
                assert torch.equal(r1.attention[rid], r2.attention[rid])
        for layer in range(one.num_layers):
            assert torch.equal(one.request_kv("a", layer)[0], two.request_kv("a", layer)[0])


@pytest.mark.parametrize(
    "pattern",
    [AcceptancePattern.all(), AcceptancePattern.none(), AcceptancePattern.partial(1), AcceptancePattern.random(7)],
    ids=lambda p: p.kind,
)
@pytest.mark.parametrize("mode", ["stage", "immediate", "off"])
def test_spec_decode_gives_the_same_tokens_and_kv_for_every_pattern(pattern: AcceptancePattern, mode: str) -> None:
    with _engine(num_speculative_tokens=3, acceptance=pattern, nwor_mode=mode, check_kv_reads=True) as engine:
        engine.add_request("a", PROMPT, max_tokens=10)
        steps = engine.run()
        assert engine.requests["a"].output_token_ids == _oracle_tokens(PROMPT, 10)
        _assert_request_kv_is_expected(engine, "a")
    # 1 prefill step, then decode steps of 1 + accepted tokens each (+1 step delivering "finished").
    if pattern.kind == "all":
        assert steps == 1 + 3 + 1  # 1 + 4 + 4 + 4 (capped) tokens
    if pattern.kind == "none":
        assert steps == 1 + 9 + 1


def test_partial_pattern_accepts_exactly_that_many_drafts() -> None:
    with _engine(num_speculative_tokens=3, acceptance=AcceptancePattern.partial(1)) as engine:
        engine.add_request("a", PROMPT, max_tokens=9)
        engine.step()  # prefill
        results = [engine.step() for _ in range(3)]
        assert [(r.drafts_proposed, r.drafts_accepted) for r in results] == [(3, 1)] * 3
        stats = engine.nwor_stats()[0]
        assert stats.windows == 3 and stats.rejected_tokens == 6 and stats.committed_tokens == 6


@pytest.mark.parametrize("mode,clean", [("stage", True), ("immediate", False)])
def test_rejected_drafts_never_reach_the_cache_in_stage_mode(mode: str, clean: bool) -> None:
    with _engine(
        num_speculative_tokens=3, acceptance=AcceptancePattern.none(), nwor_mode=mode, block_size=16
    ) as engine:
        engine.add_request("a", PROMPT, max_tokens=3)
        engine.run()
        request = engine.requests["a"]
        n = request.num_computed_tokens
        span = len(request.released_block_ids) * engine.block_size
        assert span > n
        for layer in range(engine.num_layers):
            k, v = engine.request_kv("a", layer, num_tokens=span)
            beyond = torch.cat((k[n:], v[n:]))
            # Positions past the committed tokens were only ever targeted by rejected drafts.
            assert bool(torch.all(beyond == 0)) is clean


class RecordingWorker(NullWorkerConnector):
    """Records the hook calls of one rank, in order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.watermarks: list[tuple[list[str], list[int]]] = []

    def register_kv_caches(self, kv_caches: Any) -> None:
        self.log.append("register_kv_caches")

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.log.append("bind")

    def start_load_kv(self) -> None:
        self.log.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.log.append(f"wait_for_layer_load:{layer_name.split('.')[2]}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.log.append(f"save_kv_layer:{layer_name.split('.')[2]}")

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        self.log.append("get_transfer_results")
        return TransferResults()

    def set_step_watermarks(self, request_ids: Any, watermarks: torch.Tensor) -> None:
        self.log.append("set_step_watermarks")
        self.watermarks.append((list(request_ids), watermarks.numpy().tolist()))

    def wait_for_save(self) -> None:
        self.log.append("wait_for_save")

    def clear_connector_metadata(self) -> None:
        self.log.append("clear")


def test_hooks_run_in_vllm_order_with_post_forward_after_the_proposer() -> None:
    log: list[str] = []
    workers: list[RecordingWorker] = []

    def factory(tp_rank: int, geometry: CacheGeometry) -> RecordingWorker:
        workers.append(RecordingWorker(log))
        return workers[-1]

    with _engine(num_speculative_tokens=2, num_layers=2, worker_connector_factory=factory) as engine:
        propose = engine.proposer.propose

        def recording_propose(*args: Any) -> list[int]:
            log.append("propose")
            return propose(*args)

        engine.proposer.propose = recording_propose  # type: ignore[method-assign]
        engine.add_request("a", PROMPT, max_tokens=5)
        engine.step()
        log.clear()
        engine.step()  # a verification step
    assert log == [
        "bind",
        "start_load_kv",
        "wait_for_layer_load:0",
        "save_kv_layer:0",
        "wait_for_layer_load:1",
        "save_kv_layer:1",
        "get_transfer_results",
        "set_step_watermarks",
        "propose",
        "wait_for_save",
        "clear",
    ]
    # Watermarks: prefill committed 13 tokens; the verification step 13 + 1 + 2 accepted.
    assert workers[0].watermarks == [(["a"], [13]), (["a"], [16])]


def test_the_step_path_calls_no_synchronizing_op(monkeypatch: pytest.MonkeyPatch) -> None:
    with _engine(num_speculative_tokens=3, acceptance=AcceptancePattern.random(1)) as engine:
        engine.add_request("a", PROMPT, max_tokens=12)
        engine.add_request("b", PROMPT[:7], max_tokens=5)
        with forbid_sync_ops(monkeypatch) as called:
            engine.run()
        assert called == []
        assert engine.requests["a"].output_token_ids == _oracle_tokens(PROMPT, 12)
