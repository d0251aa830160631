"""Two reference engines through a fake daemon: P -> D, spec decode, D -> P, failures.

The fake daemon copies blocks between the engines' shm files the way the real one does
(same layout only) and reads only committed tokens. Real daemons are in tests/integration.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from engine_fakes import FakeDaemon, wait_until

from kvd.demo.reference_engine import AcceptancePattern, ReferenceEngine, oracle_next_token
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.local import kvd_connectors

PROMPT = list(range(100, 137))  # 37 tokens: 10 blocks of 4, the last one partial
CONFIG = KvdConnectorConfig(
    kvd_socket="/fake.sock", reconnect_initial_s=0.01, reconnect_max_s=0.05, pull_threshold_tokens=16
)


def _oracle(tokens: list[int], n: int) -> list[int]:
    out, token, pos = [], tokens[-1], len(tokens)
    for _ in range(n):
        token = oracle_next_token(token, pos, 1000)
        out.append(token)
        pos += 1
    return out


def _engine(daemon: FakeDaemon, engine_id: str, config: KvdConnectorConfig = CONFIG, **kw: Any) -> ReferenceEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    sched, workers = kvd_connectors(
        config,
        engine_id,
        block_size=kw["block_size"],
        speculative=kw.get("num_speculative_tokens", 0) > 0,
        client_factory=daemon.client,
    )
    engine = ReferenceEngine(
        engine_id=engine_id, scheduler_connector=sched, worker_connector_factory=workers, check_kv_reads=True, **kw
    )
    assert wait_until(lambda: all(r.worker.link.connected for r in engine.ranks))
    return engine


def _busy(engine: ReferenceEngine) -> bool:
    return engine.has_unfinished_requests() or bool(engine._finished_since_last_step)


def _run(daemon: FakeDaemon, *engines: ReferenceEngine, timeout_s: float = 20.0) -> None:
    """Step every engine (idle ones too: they poll their daemon) until all requests are done."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_busy(e) for e in engines):
            return
        for engine in engines:
            engine.step()
        daemon.process()
        time.sleep(0.001)  # let the link threads run (they start the pulls)
    raise AssertionError("engines did not settle")


def _settle_holds(daemon: FakeDaemon, engine: ReferenceEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine._held and time.monotonic() < deadline:
        daemon.process()
        engine.step()
        time.sleep(0.001)


def _assert_kv(engine: ReferenceEngine, request_id: str) -> None:
    for rank in range(len(engine.ranks)):
        for layer in range(engine.num_layers):
            got, want = engine.request_kv(request_id, layer, rank), engine.expected_request_kv(request_id, layer, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "pattern",
    [AcceptancePattern.all(), AcceptancePattern.none(), AcceptancePattern.partial(2), AcceptancePattern.random(5)],
    ids=lambda p: p.kind,
)
def test_prefill_to_decode_with_spec_decode_is_bit_identical(pattern: AcceptancePattern) -> None:
    daemon = FakeDaemon(copy_pulls=True)
    with (
        _engine(daemon, "prefill", tp_size=2, total_num_kv_heads=4) as p,
        _engine(daemon, "decode", tp_size=2, total_num_kv_heads=4, num_speculative_tokens=3, acceptance=pattern) as d,
    ):
        p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        _run(daemon, p)
        params = p.requests["r"].output_kv_transfer_params
        assert params["do_remote_prefill"] is True and params["kvd"]["num_tokens"] == len(PROMPT)
        assert "r" in p._held  # blocks kept for the reader
        d.add_request("r", PROMPT, max_tokens=12, kv_transfer_params=params)
        _run(daemon, p, d)
        req = d.requests["r"]
        assert not req.load_failed and req.num_external_tokens == len(PROMPT)
        assert req.output_token_ids == _oracle(PROMPT, 12)
        _assert_kv(d, "r")
        _settle_holds(daemon, p)
        assert p._held == {} and p.allocator.num_free == 63  # released once decode read it


@pytest.mark.parametrize("mode,clean", [("stage", True), ("immediate", False)])
def test_rejected_draft_kv_never_reaches_the_peer(mode: str, clean: bool) -> None:
    daemon = FakeDaemon(copy_pulls=True)
    with (
        _engine(daemon, "prefill") as p,
        _engine(daemon, "decode", num_speculative_tokens=3, acceptance=AcceptancePattern.none(), nwor_mode=mode) as d,
    ):
        p.add_request("t1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        _run(daemon, p)
        d.add_request("t1", PROMPT, max_tokens=6, kv_transfer_params=p.requests["t1"].output_kv_transfer_params)
        _run(daemon, p, d)
        held = d.requests["t1"].output_kv_transfer_params
        assert held["do_remote_decode"] is True
        n = held["kvd"]["num_tokens"]
        assert n == len(PROMPT) + 5
        turn2 = d.requests["t1"].all_token_ids + [7, 8, 9]
        p.add_request("t2", turn2, max_tokens=1, kv_transfer_params=held)
        _run(daemon, p, d)
        assert p.requests["t2"].num_external_tokens == n
        _assert_kv(p, "t2")
        read = daemon.read_log[-d.num_layers]  # layer 0 of the D -> P pull
        assert read["num_tokens"] == n
        k = read["k"].flatten(0, 1)  # [blocks * block_size, heads, dim], what the peer read
        beyond = k[n:]
        assert beyond.numel() > 0
        # Past the committed tokens the peer read only never-written bytes in stage mode;
        # in immediate mode it read the KV of rejected drafts.
        assert bool(torch.all(beyond == 0)) is clean


@pytest.mark.parametrize("extra,pulled", [(3, False), (40, True)])
def test_prefill_pulls_back_from_decode_only_above_the_threshold(extra: int, pulled: bool) -> None:
    daemon = FakeDaemon(copy_pulls=True)
    config = KvdConnectorConfig(kvd_socket="/fake.sock", reconnect_initial_s=0.01, pull_threshold_tokens=30)
    with _engine(daemon, "prefill", config) as p, _engine(daemon, "decode", config) as d:
        prompt = list(range(200, 200 + extra))
        p.add_request("t1", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        _run(daemon, p)
        d.add_request("t1", prompt, max_tokens=2, kv_transfer_params=p.requests["t1"].output_kv_transfer_params)
        _run(daemon, p, d)
        held = d.requests["t1"].output_kv_transfer_params
        turn2 = d.requests["t1"].all_token_ids + [1, 2]
        p.add_request("t2", turn2, max_tokens=2, kv_transfer_params=held)
        _run(daemon, p)
        assert (p.requests["t2"].num_external_tokens > 0) is pulled
        assert p.requests["t2"].output_token_ids == _oracle(turn2, 2)
        _assert_kv(p, "t2")


def test_a_failed_load_is_recomputed_and_the_engine_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvd_engine.worker")
    daemon = FakeDaemon(copy_pulls=False)
    with _engine(daemon, "prefill") as p, _engine(daemon, "decode") as d:
        p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        _run(daemon, p)
        d.add_request("r", PROMPT, max_tokens=4, kv_transfer_params=p.requests["r"].output_kv_transfer_params)
        d.step()
        assert wait_until(lambda: len(daemon.pulls) == 1)
        d.step()
        daemon.finish_pull(daemon.pulls[0], error="peer prefill died mid-transfer")
        _run(daemon, d)
        req = d.requests["r"]
        assert req.load_failed and req.output_token_ids == _oracle(PROMPT, 4)
        _assert_kv(d, "r")
    # The worker names the daemon's exact error class, not only its status code.
    assert "PeerUnavailable: peer prefill died mid-transfer" in caplog.text


def test_a_daemon_restart_releases_held_blocks_and_pulls_recompute() -> None:
    daemon = FakeDaemon(copy_pulls=True)
    with _engine(daemon, "prefill") as p, _engine(daemon, "decode") as d:
        p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        _run(daemon, p)
        params = p.requests["r"].output_kv_transfer_params
        daemon.restart()  # the lease is gone with the old incarnation
        assert wait_until(lambda: daemon.register_calls == 4)
        _settle_holds(daemon, p)
        assert p._held == {}  # released: nobody can read them any more
        d.add_request("r", PROMPT, max_tokens=3, kv_transfer_params=params)
        _run(daemon, p, d)
        assert d.requests["r"].load_failed
        assert d.requests["r"].output_token_ids == _oracle(PROMPT, 3)


def test_engines_run_without_a_daemon_at_all() -> None:
    daemon = FakeDaemon()
    daemon.down = True
    config = KvdConnectorConfig(kvd_socket="/fake.sock", reconnect_initial_s=0.01)
    sched, workers = kvd_connectors(config, "lonely", block_size=4, client_factory=daemon.client)
    with ReferenceEngine(
        engine_id="lonely", block_size=4, scheduler_connector=sched, worker_connector_factory=workers
    ) as p:
        p.add_request("r", PROMPT, max_tokens=2, kv_transfer_params={"do_remote_decode": True})
        p.run()
        assert p.requests["r"].output_kv_transfer_params is None
        assert p.requests["r"].output_token_ids == _oracle(PROMPT, 2)
