"""Reference engines with kvd's connector against real `kvd serve` daemons and real NIXL pulls.

Prefill and decode run on different daemons (two "nodes") with different layouts, block
sizes and TP; decode speculates with every acceptance pattern; the next turn's prefill pulls
the conversation back above the threshold; pulls wait for the holder's post-forward signal;
a dead peer or a restarted daemon never crashes an engine: it recomputes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvd.demo.reference_engine import AcceptancePattern, ReferenceEngine, oracle_next_token
from kvd.spawn import DaemonProcess, start_daemon
from kvd_engine.cache_layout import KvFormat, KvLayout
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.local import kvd_connectors

pytestmark = pytest.mark.integration

PROMPT = list(range(100, 151))  # 51 tokens: partial last blocks for every block size used


def _oracle(tokens: list[int], n: int) -> list[int]:
    out, token, pos = [], tokens[-1], len(tokens)
    for _ in range(n):
        token = oracle_next_token(token, pos, 1000)
        out.append(token)
        pos += 1
    return out


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """Two daemons ("nodes") shared by the tests that do not kill or restart one."""
    workdir: Path = tmp_path_factory.mktemp("engine-flow")
    a = start_daemon(workdir, "node-a")
    try:
        b = start_daemon(workdir, "node-b")
    except BaseException:
        a.terminate()
        raise
    yield a, b
    for daemon in (a, b):
        code = daemon.terminate()
        assert code == 0, daemon.log_tail()


@pytest.fixture
def engines() -> Iterator[Callable[..., ReferenceEngine]]:
    made: list[ReferenceEngine] = []

    def make(daemon: Any, engine_id: str, threshold: int = 16, **kw: Any) -> ReferenceEngine:
        engine_id = f"{engine_id}-{uuid.uuid4().hex[:6]}"  # daemons are shared between tests
        config = KvdConnectorConfig(
            kvd_socket=daemon.unix_socket,
            pull_threshold_tokens=threshold,
            reconnect_initial_s=0.05,
            reconnect_max_s=0.5,
        )
        kw.setdefault("num_blocks", 96)
        kw.setdefault("block_size", 16)
        kw.setdefault("num_layers", 2)
        kw.setdefault("total_num_kv_heads", 4)
        kw.setdefault("head_dim", 16)
        kw.setdefault("dtype", torch.bfloat16)
        sched, workers = kvd_connectors(
            config, engine_id, block_size=kw["block_size"], speculative=kw.get("num_speculative_tokens", 0) > 0
        )
        engine = ReferenceEngine(
            engine_id=engine_id, scheduler_connector=sched, worker_connector_factory=workers, check_kv_reads=True, **kw
        )
        made.append(engine)
        _wait(lambda: all(r.worker.link.connected for r in engine.ranks), f"{engine_id} did not register")
        return engine

    yield make
    for engine in made:
        engine.close()


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _busy(engine: ReferenceEngine) -> bool:
    return engine.has_unfinished_requests() or bool(engine._finished_since_last_step)


def run(*engines: ReferenceEngine, timeout_s: float = 60.0) -> None:
    """Step every engine (idle ones poll their daemon) until all their requests are done."""
    deadline = time.monotonic() + timeout_s
    while any(_busy(e) for e in engines):
        assert time.monotonic() < deadline, "engines did not settle"
        for engine in engines:
            engine.step()
        time.sleep(0.002)


def settle_holds(engine: ReferenceEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine._held and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)


def assert_kv(engine: ReferenceEngine, request_id: str) -> None:
    for rank in range(len(engine.ranks)):
        for layer in range(engine.num_layers):
            got, want = engine.request_kv(request_id, layer, rank), engine.expected_request_kv(request_id, layer, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (engine.engine_id, rank, layer)


HETERO = {
    "same_layout": ({}, {}),
    "nhd16_to_hnd8": ({"layout": KvLayout.NHD, "block_size": 16}, {"layout": KvLayout.HND, "block_size": 8}),
    "tp2_to_tp1": ({"tp_size": 2}, {"tp_size": 1}),
    "tp1_to_tp2_joint": ({"tp_size": 1}, {"tp_size": 2, "kv_format": KvFormat.JOINT}),
}


@pytest.mark.parametrize("case", list(HETERO))
@pytest.mark.parametrize(
    "pattern",
    [AcceptancePattern.all(), AcceptancePattern.none(), AcceptancePattern.partial(1), AcceptancePattern.random(11)],
    ids=lambda p: p.kind,
)
def test_prefill_to_decode_then_spec_decode_is_bit_identical(
    nodes: Any, engines: Any, case: str, pattern: AcceptancePattern
) -> None:
    p_kw, d_kw = HETERO[case]
    node_a, node_b = nodes
    p = engines(node_a, "prefill", **p_kw)
    d = engines(node_b, "decode", num_speculative_tokens=3, acceptance=pattern, **d_kw)
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    params = p.requests["r"].output_kv_transfer_params
    assert params and params["kvd"]["daemon_address"] == node_a.tcp and params["kvd"]["num_tokens"] == len(PROMPT)
    d.add_request("r", PROMPT, max_tokens=10, kv_transfer_params=params)
    run(p, d)
    request = d.requests["r"]
    assert not request.load_failed and request.num_external_tokens == len(PROMPT)
    assert request.output_token_ids == _oracle(PROMPT, 10)
    assert_kv(d, "r")  # the pulled prompt and every spec-decode step, bit for bit
    settle_holds(p)
    assert not p._held, "the holder's blocks were not released after the read"


@pytest.mark.parametrize("mode", ["stage", "immediate"])
def test_multi_turn_pull_back_ships_no_rejected_draft_kv(nodes: Any, engines: Any, mode: str) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill")
    d = engines(node_b, "decode", num_speculative_tokens=3, acceptance=AcceptancePattern.none(), nwor_mode=mode)
    p.add_request("t1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    d.add_request("t1", PROMPT, max_tokens=6, kv_transfer_params=p.requests["t1"].output_kv_transfer_params)
    run(p, d)
    held = d.requests["t1"].output_kv_transfer_params
    assert held["do_remote_decode"] is True
    n = held["kvd"]["num_tokens"]
    # On decode, past the committed tokens: never written with NWOR, rejected drafts without.
    d_blocks = d._held["t1"]
    span = len(d_blocks) * d.block_size
    k, _ = d.request_kv("t1", 0, num_tokens=span)
    assert bool(torch.all(k[n:] == 0)) is (mode == "stage")
    turn2 = d.requests["t1"].all_token_ids + [1, 2, 3]
    p.add_request("t2", turn2, max_tokens=2, kv_transfer_params=held)
    run(p, d)
    t2 = p.requests["t2"]
    assert t2.num_external_tokens == n and not t2.load_failed
    assert t2.output_token_ids == _oracle(turn2, 2)
    assert_kv(p, "t2")


def test_prefill_recomputes_below_the_threshold(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill", threshold=1000)
    d = engines(node_b, "decode")
    p.add_request("t1", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    d.add_request("t1", PROMPT, max_tokens=3, kv_transfer_params=p.requests["t1"].output_kv_transfer_params)
    run(p, d)
    turn2 = d.requests["t1"].all_token_ids + [9]
    p.add_request("t2", turn2, max_tokens=1, kv_transfer_params=d.requests["t1"].output_kv_transfer_params)
    run(p)
    assert p.requests["t2"].num_external_tokens == 0
    assert p.requests["t2"].output_token_ids == _oracle(turn2, 1)


def test_a_pull_waits_for_the_holders_post_forward_signal(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill")
    d = engines(node_b, "decode")
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.step()  # prefill; the request finishes and is held, but its commit and signal go out next step
    params = p.requests["r"].output_kv_transfer_params
    assert params is not None
    d.add_request("r", PROMPT, max_tokens=2, kv_transfer_params=params)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        d.step()
        time.sleep(0.01)
    assert d.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS", "the pull read before the holder signalled"
    run(p, d)  # the holder's next step sends the commit and post-forward: the pull completes
    assert not d.requests["r"].load_failed
    assert_kv(d, "r")


def test_a_dead_holder_means_recompute(spawn_daemon: Any, engines: Any) -> None:
    node_a, node_b = spawn_daemon(name="a"), spawn_daemon(name="b")
    p = engines(node_a, "prefill")
    d = engines(node_b, "decode")
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    params = p.requests["r"].output_kv_transfer_params
    node_a.kill()
    d.add_request("r", PROMPT, max_tokens=3, kv_transfer_params=params)
    run(d)
    request = d.requests["r"]
    assert request.load_failed and request.output_token_ids == _oracle(PROMPT, 3)
    assert_kv(d, "r")
    p.step()  # the holder engine keeps running without its daemon


def test_an_engine_reregisters_after_its_daemon_restarts(spawn_daemon: Any, engines: Any, tmp_path: Any) -> None:
    node_a, node_b = spawn_daemon(name="a"), spawn_daemon(name="b")
    p = engines(node_a, "prefill")
    d = engines(node_b, "decode")
    link = d.ranks[0].worker.link
    first = link.incarnation
    node_b.terminate()
    _wait(lambda: not link.connected, "decode did not notice its daemon left")
    d.step()
    node_b2 = spawn_daemon("--unix-socket", node_b.unix_socket, name="b2")
    assert node_b2.unix_socket == node_b.unix_socket
    _wait(lambda: link.connected and link.incarnation not in ("", first), "decode did not re-register")
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    d.add_request("r", PROMPT, max_tokens=2, kv_transfer_params=p.requests["r"].output_kv_transfer_params)
    run(p, d)
    assert not d.requests["r"].load_failed
    assert_kv(d, "r")
