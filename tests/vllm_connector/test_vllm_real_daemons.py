"""KvdConnector inside vLLM 0.33 against two real ``kvd serve`` daemons and real NIXL pulls.

vLLM's real ``Scheduler`` (the connector's scheduler half) and the real worker connector, over
vLLM's own ``allocate_kv_cache`` (LBHNC: one PACKED plane per layer, K|V per token and head),
moved into shm and registered with the engine's *own* daemon: the prefill engine on daemon A,
the decode engine on daemon B (two "nodes"). The flows of ``test_vllm_connector.py`` (which
uses a fake daemon), here with the daemons doing the holds, the NIXL reads and the releases:

* P -> D: kv_transfer_params round trip, decode's KV bit-identical to prefill's, the holder's
  blocks freed (finished_sending) and decode told (finished_recving);
* multi-turn D -> P above the pull threshold (pulled back, bytes equal) and below it
  (recomputed: no transfer on either daemon);
* a failed load (the holder's daemon killed before decode pulls): reported as failed with its
  blocks, recomputed by vLLM, no engine crashes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtest import metric_value, scrape
from vllm_harness import LAYERS, VllmEngine, blocks_for, expected_kv, tiny_model_dir

from kvd.spawn import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPT = list(range(300, 340))  # 40 tokens: 2 full blocks of 16 and a partial one
THRESHOLD = 32


def _extra(daemon: DaemonProcess, **overrides: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "kvd_socket": daemon.unix_socket,
        "pull_threshold_tokens": THRESHOLD,
        "reconnect_initial_s": 0.05,
        "reconnect_max_s": 0.5,
        "rpc_timeout_s": 5.0,
    }
    extra.update(overrides)
    return extra


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def nodes(spawn_daemon: Callable[..., DaemonProcess]) -> tuple[DaemonProcess, DaemonProcess]:
    """Two daemons, two "nodes": A serves the prefill engine, B the decode engine."""
    return spawn_daemon(name="node-a"), spawn_daemon(name="node-b")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., VllmEngine]]:
    made: list[tuple[VllmEngine, DaemonProcess]] = []
    model = tiny_model_dir(tmp_path / "model")

    def make(daemon: DaemonProcess, role: str, **extra: Any) -> VllmEngine:
        engine_id = f"{role}-{uuid.uuid4().hex[:6]}"
        engine = VllmEngine(model, engine_id, _extra(daemon, **extra))
        made.append((engine, daemon))
        link = engine.worker.worker.link
        _wait(lambda: link.connected, f"{engine_id} did not register with {daemon.name}:\n{daemon.log_tail()}")
        return engine

    yield make
    for engine, _daemon in made:
        engine.close()


def run(*engines: VllmEngine, timeout_s: float = 15.0) -> None:
    """Step every engine (idle ones too: they poll their daemon) until all requests are done."""
    deadline = time.monotonic() + timeout_s
    while any(e.has_work() for e in engines):
        assert time.monotonic() < deadline, "engines did not settle"
        for engine in engines:
            engine.step()
        time.sleep(0.002)


def release_holds(engine: VllmEngine, timeout_s: float = 10.0) -> None:
    """Step the holder (no-forward steps) until vLLM freed every block it held for a reader."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.requests and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)


def sent(engine: VllmEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.finished_sending or ())}


def received(engine: VllmEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.finished_recving or ())}


def failed(engine: VllmEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.failed_recving or ())}


def invalid_blocks(engine: VllmEngine) -> set[int]:
    return {b for out in engine.results for b in (out.invalid_block_ids or ())}


def block_bytes(engine: VllmEngine, block_ids: list[int]) -> torch.Tensor:
    """The raw bytes of whole blocks, every layer: ``[layers, blocks, heads, block_size, 2D]``."""
    index = torch.as_tensor(block_ids)
    return torch.stack([engine.kv_caches[name][index] for name in LAYERS]).view(torch.uint8)


def spy_matches(engine: VllmEngine) -> list[tuple[str, int, tuple[int | None, bool]]]:
    """Record what the connector's get_num_new_matched_tokens answers vLLM's scheduler."""
    calls: list[tuple[str, int, tuple[int | None, bool]]] = []
    connector = engine.connector
    real = connector.get_num_new_matched_tokens

    def spy(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = real(request, num_computed_tokens)
        calls.append((request.request_id, num_computed_tokens, answer))
        return answer

    connector.get_num_new_matched_tokens = spy
    return calls


def free_blocks(engine: VllmEngine) -> int:
    """Blocks vLLM may allocate now (free, or cached and unreferenced): none pinned by holds."""
    return int(engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def leases_ended(daemon: DaemonProcess, reason: str) -> float:
    return metric_value(scrape(daemon.metrics), "kvd_leases_ended_total", reason=reason)


def transfers(daemon: DaemonProcess, **labels: str) -> float:
    return metric_value(scrape(daemon.metrics), "kvd_transfers_total", **labels)


def moved_bytes(daemon: DaemonProcess, direction: str) -> float:
    return metric_value(scrape(daemon.metrics), "kvd_transfer_bytes_total", direction=direction)


def _prefill(p: VllmEngine, request_id: str, prompt: list[int]) -> dict[str, Any]:
    p.add_request(request_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    params = p.outputs[request_id].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True, params
    return params


def test_prefill_to_decode_through_two_daemons(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill"), engines(node_b, "decode")
    n = len(PROMPT)
    params = _prefill(p, "r", PROMPT)
    held = params["kvd"]
    p_blocks = p.block_tables["r"][: blocks_for(n, p.block_size)]
    assert held["daemon_address"] == node_a.tcp and held["engine_id"] == p.engine_id
    assert held["num_tokens"] == n and held["block_ids"] == p_blocks and held["lease_id"]
    assert "r" in p.scheduler.requests, "the holder freed its blocks before anyone read them"
    prefill_kv = p.kv_of("r", n).clone()
    assert torch.equal(prefill_kv, expected_kv(PROMPT))

    matched = spy_matches(d)
    d.add_request("r", PROMPT, max_tokens=4, kv_transfer_params=params)
    d.step()
    request = d.scheduler.requests["r"]
    assert matched == [("r", 0, (n, True))]  # every prompt token is remote, loaded asynchronously
    assert request.status.name == "WAITING_FOR_REMOTE_KVS" and request.num_computed_tokens == n
    run(d, p)

    # Decode's KV: the prefill's bytes, pulled over NIXL (nothing was recomputed but the last token).
    assert "r" in received(d) and not failed(d) and not invalid_blocks(d)
    d_blocks = d.block_tables["r"][: len(p_blocks)]
    full = n // p.block_size
    assert torch.equal(block_bytes(d, d_blocks[:full]), block_bytes(p, p_blocks[:full]))  # whole blocks
    assert torch.equal(d.kv_of("r", n).view(torch.uint8), prefill_kv.view(torch.uint8))  # every prompt token
    assert d.tokens["r"][n] == p.tokens["r"][n]  # the first token came from prefill's sample
    assert transfers(node_b, peer=node_a.tcp, direction="pull", outcome="done") == 1  # B read from A
    assert moved_bytes(node_b, "pull") > 0

    # The holder was told its lease ended: finished_sending, and vLLM freed the blocks.
    release_holds(p)
    assert "r" in sent(p) and not p.scheduler.requests
    # Daemon A served exactly what daemon B pulled (counted as the reader's notice ended the lease).
    assert transfers(node_a, direction="serve", outcome="done") == 1
    assert moved_bytes(node_a, "serve") == moved_bytes(node_b, "pull")
    # Decode holds its own KV for the next turn (bidirectional), through daemon B.
    back = d.outputs["r"].kv_transfer_params
    assert back["do_remote_decode"] is True and back["kvd"]["daemon_address"] == node_b.tcp


@pytest.mark.parametrize("prompt_tokens,pulled", [(20, False), (60, True)], ids=["below-threshold", "above-threshold"])
def test_multi_turn_pull_back_from_decode(nodes: Any, engines: Any, prompt_tokens: int, pulled: bool) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill"), engines(node_b, "decode")
    prompt = list(range(500, 500 + prompt_tokens))
    params = _prefill(p, "t1", prompt)
    d.add_request("t1", prompt, max_tokens=3, kv_transfer_params=params)
    run(d, p)
    release_holds(p)
    assert "t1" in sent(p) and "t1" in received(d)
    held = d.outputs["t1"].kv_transfer_params
    assert held["do_remote_decode"] is True and held["kvd"]["daemon_address"] == node_b.tcp
    n = held["kvd"]["num_tokens"]
    # A soft hold covers the full blocks of the KV decode computed (the last sampled token has none).
    assert n == (len(d.tokens["t1"]) - 1) // d.block_size * d.block_size
    # ... and pins nothing: vLLM freed the request's blocks into its prefix cache at once.
    assert not d.scheduler.requests and "t1" not in sent(d)
    assert free_blocks(d) == d.kv_cache_config.num_blocks - 1  # every block but vLLM's null block
    decode_kv = d.kv_of("t1", n).clone()

    # The next turn goes to another prefill engine (on node A), whose prefix cache is cold.
    p = engines(node_a, "prefill2")
    before = (transfers(node_a), transfers(node_b))
    turn2 = d.tokens["t1"] + [1, 2, 3]
    matched = spy_matches(p)
    p.add_request("t2", turn2, max_tokens=1, kv_transfer_params=held)
    p.step()
    assert matched[0] == ("t2", 0, (n, True) if pulled else (0, False))
    waiting = p.scheduler.requests["t2"].status.name == "WAITING_FOR_REMOTE_KVS"
    assert waiting is pulled
    run(p, d)
    assert torch.equal(p.kv_of("t2", len(turn2)), expected_kv(turn2))
    if pulled:
        # Prefill pulled the conversation back through daemon A from daemon B, bit for bit, after
        # decode's scheduler verified (and pinned for the read) the blocks in its prefix cache.
        assert "t2" in received(p) and not failed(p)
        assert torch.equal(p.kv_of("t2", n).view(torch.uint8), decode_kv.view(torch.uint8))
        assert transfers(node_a, peer=node_b.tcp, direction="pull", outcome="done") == 1  # A read from B
        assert transfers(node_b, direction="serve", outcome="done") == 1
        _wait(lambda: leases_ended(node_b, "read") == 1, "decode's soft lease did not end on the read")
        assert d.connector._scheduler.pinned_blocks == 0  # the read's pin was given back
        assert free_blocks(d) == d.kv_cache_config.num_blocks - 1
    else:
        # Below the threshold: recomputed, no transfer on either daemon, and decode's lease is
        # released at once (nobody will read it).
        assert "t2" not in received(p)
        assert (transfers(node_a), transfers(node_b)) == before
        _wait(lambda: leases_ended(node_b, "aborted") == 1, "decode's lease was not released")


def test_a_failed_load_is_reported_and_recomputed(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill"), engines(node_b, "decode")
    n = len(PROMPT)
    params = _prefill(p, "r", PROMPT)
    node_a.kill()  # the holder's daemon dies with its lease before decode pulls

    d.add_request("r", PROMPT, max_tokens=3, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS"
    run(d)
    # Reported as received *and* failed, with the blocks it was loading into; vLLM recomputed.
    assert failed(d) == {"r"} and "r" in received(d)
    assert invalid_blocks(d) and invalid_blocks(d) <= set(d.block_tables["r"])
    assert torch.equal(d.kv_of("r", n), expected_kv(PROMPT))
    assert len(d.tokens["r"]) == n + 3 and d.outputs["r"].finish_reason is not None
    assert transfers(node_b, peer=node_a.tcp, direction="pull", outcome="failed") == 1
    assert transfers(node_b, direction="pull", outcome="done") == 0

    # The holder engine keeps running without its daemon: its hold died with the daemon and
    # vLLM gets the blocks back.
    release_holds(p)
    assert "r" in sent(p) and not p.scheduler.requests
    p.add_request("again", PROMPT, max_tokens=1)
    run(p)
    assert torch.equal(p.kv_of("again", n), expected_kv(PROMPT))


def test_a_hold_renewed_by_heartbeats_outlives_its_first_expiry(nodes: Any, tmp_path: Path) -> None:
    """Decode waits (queued behind a long request) longer than prefill's hold TTL; its heartbeats
    renew the lease at daemon A. Prefill's worker must not free the held blocks at the expiry it
    heard at hold time (then vLLM reuses them, and decode pulls someone else's KV): it waits for
    daemon A's finished_sending, here after the read."""
    a, b = nodes
    model = tiny_model_dir(tmp_path / "model")
    made: list[VllmEngine] = []

    def make(daemon: DaemonProcess, role: str, num_blocks: int = 64, **extra: Any) -> VllmEngine:
        engine = VllmEngine(model, f"{role}-{uuid.uuid4().hex[:6]}", _extra(daemon, **extra), num_blocks=num_blocks)
        made.append(engine)
        _wait(lambda: engine.worker.worker.link.connected, f"{role} did not register:\n{daemon.log_tail()}")
        return engine

    try:
        p = make(a, "prefill", num_blocks=10, hold_ttl_ms=1500, pull_timeout_slack_s=1.0)
        d = make(b, "decode", lease_renew_interval_ms=250)
        # 62 of decode's 64 blocks, growing to 63 over 24 steps (~5 s): r (4 blocks) waits.
        d.add_request("hog", [3000 + t for t in range(980)], max_tokens=24)
        d.step()
        d.step()
        conv = list(range(600, 660))
        params = _prefill(p, "r", conv)
        d.add_request("r", conv, max_tokens=2, kv_transfer_params=params)
        start = time.monotonic()
        steps = 0
        while time.monotonic() - start < 4.0:  # well past TTL + slack: the lease lives on (renewed)
            steps += 1
            if steps % 4 == 0:  # decode steps slowly: the hog lasts past the loop
                d.step()
            p.step()
            time.sleep(0.05)
            assert d.scheduler.requests["r"].status.name == "WAITING"  # not pulled yet
            if "r" in sent(p):
                assert leases_ended(a, "read") >= 1 or leases_ended(a, "expired") >= 1, "freed under a live lease"
        other = list(range(5000, 5140))  # wants every free block of P: the held ones if freed
        p.add_request("x", other, max_tokens=1)
        run(d, p, timeout_s=60)  # x gets r's blocks only once decode read them
        assert received(d) >= {"r"} and "r" not in failed(d)
        assert torch.equal(d.kv_of("r", len(conv)), expected_kv(conv))
        release_holds(p)
        assert "r" in sent(p) and leases_ended(a, "read") >= 1
    finally:
        for engine in made:
            engine.close()


def test_prefill_and_decode_on_one_node_share_one_daemon_both_ways(spawn_daemon: Any, engines: Any) -> None:
    """1P1D on one node: both engines register with the one daemon of the node. Decode pulls the
    prompt's KV from prefill (a hard hold), and the next turn's prefill engine pulls the
    conversation back from decode (a soft hold its scheduler pins for the read), each bit for bit
    through the daemon's own NIXL agent."""
    node = spawn_daemon(name="node")
    p, d = engines(node, "prefill"), engines(node, "decode")
    prompt = list(range(500, 560))
    params = _prefill(p, "t1", prompt)
    assert params["kvd"]["daemon_address"] == node.tcp
    prefill_kv = p.kv_of("t1", len(prompt)).clone()
    d.add_request("t1", prompt, max_tokens=3, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests["t1"].status.name == "WAITING_FOR_REMOTE_KVS"
    run(d, p)
    assert "t1" in received(d) and not failed(d) and not invalid_blocks(d)
    assert torch.equal(d.kv_of("t1", len(prompt)).view(torch.uint8), prefill_kv.view(torch.uint8))
    release_holds(p)
    assert "t1" in sent(p) and not p.scheduler.requests

    held = d.outputs["t1"].kv_transfer_params
    assert held["kvd"]["daemon_address"] == node.tcp
    n = held["kvd"]["num_tokens"]
    decode_kv = d.kv_of("t1", n).clone()
    p2 = engines(node, "prefill2")
    turn2 = d.tokens["t1"] + [1, 2, 3]
    p2.add_request("t2", turn2, max_tokens=1, kv_transfer_params=held)
    p2.step()
    assert p2.scheduler.requests["t2"].status.name == "WAITING_FOR_REMOTE_KVS"
    run(p2, d)
    assert "t2" in received(p2) and not failed(p2)
    assert torch.equal(p2.kv_of("t2", n).view(torch.uint8), decode_kv.view(torch.uint8))
    assert torch.equal(p2.kv_of("t2", len(turn2)), expected_kv(turn2))
    assert transfers(node, peer=node.tcp, direction="pull", outcome="done") == 2
    assert transfers(node, direction="serve", outcome="done") == 2
    assert moved_bytes(node, "serve") == moved_bytes(node, "pull") > 0
    _wait(lambda: leases_ended(node, "read") >= 1, "decode's soft lease did not end on the read")
    assert d.connector._scheduler.pinned_blocks == 0  # the read's pin was given back
