"""KvdConnector inside vLLM 0.33: the real Scheduler, the real worker connector, a fake daemon.

P -> D (kv_transfer_params round trip), D -> P above and below the pull threshold, a failed
load recomputed, registration of vLLM's own LBHNC cache. Real daemons: tests/integration.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fakes import FakeDaemon, wait_until
from vllm_harness import VllmEngine, expected_kv, tiny_model_dir

import kvd_engine.link_client as link_client
from kvd_engine.cache_layout import KvFormat, KvLayout

pytestmark = pytest.mark.vllm

PROMPT = list(range(300, 340))  # 40 tokens: 3 blocks of 16
# The fake daemon holds hard only (soft holds need a scheduler stream: test_vllm_holds.py).
EXTRA = {
    "kvd_socket": "/fake.sock",
    "reconnect_initial_s": 0.01,
    "pull_threshold_tokens": 32,
    "decode_hold_mode": "hard",
}


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> FakeDaemon:
    fake = FakeDaemon(copy_pulls=True)
    monkeypatch.setattr(link_client, "default_client", fake.client)
    return fake


@pytest.fixture
def engines(tmp_path: Path, daemon: FakeDaemon) -> Iterator[Any]:
    made: list[VllmEngine] = []
    model = tiny_model_dir(tmp_path / "model")

    def make(engine_id: str, **extra: Any) -> VllmEngine:
        engine = VllmEngine(model, engine_id, {**EXTRA, **extra})
        made.append(engine)
        assert wait_until(lambda: engine.worker.worker.link.connected)
        return engine

    yield make
    for engine in made:
        engine.close()


def run(daemon: FakeDaemon, *engines: VllmEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(e.has_work() for e in engines):
        assert time.monotonic() < deadline, "engines did not settle"
        for engine in engines:
            engine.step()  # idle engines too: they poll their daemon
        daemon.process()
        time.sleep(0.001)


def release_holds(daemon: FakeDaemon, engine: VllmEngine, timeout_s: float = 5.0) -> None:
    """Step the holder (no-forward steps) until vLLM freed the blocks it held for a reader."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.requests and time.monotonic() < deadline:
        daemon.process()
        engine.step()
        time.sleep(0.001)


def test_registration_of_vllms_own_cache(daemon: FakeDaemon, engines: Any) -> None:
    engine = engines("p")
    reg = daemon.registrations[("p", 0)]
    assert reg.layout.kv_format == KvFormat.PACKED and reg.layout.layout == KvLayout.HND
    assert (reg.layout.num_layers, reg.layout.block_size, reg.layout.num_kv_heads, reg.layout.head_dim) == (
        2,
        16,
        2,
        16,
    )
    region = reg.regions[0]
    assert os.path.exists(f"/dev/shm/{region.shm_name}")
    # The layer views vLLM binds still work on the moved memory: a write shows in the shm file.
    engine.kv_caches["model.layers.1.self_attn.attn"][3, 1, 2, 5] = 42.0
    mapped = torch.from_file(f"/dev/shm/{region.shm_name}", shared=True, size=region.size_bytes, dtype=torch.uint8)
    layer1 = mapped[reg.layers[1].k_offset :].view(torch.float32)
    assert float(layer1[((3 * 2 + 1) * 16 + 2) * 32 + 5]) == 42.0
    assert engine.config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_prefill_to_decode_round_trip(daemon: FakeDaemon, engines: Any) -> None:
    p, d = engines("p"), engines("d")
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(daemon, p)
    params = p.outputs["r"].kv_transfer_params
    assert params["do_remote_prefill"] is True and params["kvd"]["num_tokens"] == len(PROMPT)
    assert params["kvd"]["block_ids"] == p.block_tables["r"][:3]
    d.add_request("r", PROMPT, max_tokens=4, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS"
    run(daemon, d)
    assert torch.equal(d.kv_of("r", len(PROMPT)), expected_kv(PROMPT))
    assert d.tokens["r"][len(PROMPT) :] == p.tokens["r"][len(PROMPT) :] + d.tokens["r"][len(PROMPT) + 1 :]
    release_holds(daemon, p)
    assert not p.scheduler.requests  # blocks freed once decode read them
    # Decode holds its own KV for the next turn (bidirectional).
    assert d.outputs["r"].kv_transfer_params["do_remote_decode"] is True


@pytest.mark.parametrize("extra_tokens,pulled", [(8, False), (60, True)])
def test_multi_turn_pull_back_above_the_threshold(
    daemon: FakeDaemon, engines: Any, extra_tokens: int, pulled: bool
) -> None:
    p, d = engines("p"), engines("d")
    prompt = list(range(500, 500 + extra_tokens))
    p.add_request("t1", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(daemon, p)
    d.add_request("t1", prompt, max_tokens=3, kv_transfer_params=p.outputs["t1"].kv_transfer_params)
    run(daemon, d, p)
    held = d.outputs["t1"].kv_transfer_params
    turn2 = d.tokens["t1"] + [1, 2, 3]
    p = engines("p2")  # a prefill engine whose prefix cache does not already hold the prompt
    p.add_request("t2", turn2, max_tokens=1, kv_transfer_params=held)
    p.step()
    waiting = p.scheduler.requests["t2"].status.name == "WAITING_FOR_REMOTE_KVS"
    assert waiting is pulled
    run(daemon, p)
    if pulled:
        n = held["kvd"]["num_tokens"]
        assert torch.equal(p.kv_of("t2", n), expected_kv(turn2[:n]))


def test_a_failed_load_is_recomputed(daemon: FakeDaemon, engines: Any) -> None:
    p, d = engines("p"), engines("d")
    p.add_request("r", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(daemon, p)
    daemon.copy_pulls = False
    d.add_request("r", PROMPT, max_tokens=2, kv_transfer_params=p.outputs["r"].kv_transfer_params)
    d.step()
    assert wait_until(lambda: len(daemon.pulls) == 1)
    d.step()
    daemon.finish_pull(daemon.pulls[0], error="peer died")
    d.step()
    d.step()
    request = d.scheduler.requests["r"]
    assert request.status.name == "RUNNING" and request.num_computed_tokens == len(PROMPT)  # recomputed whole prompt
    run(daemon, d)
    assert torch.equal(d.kv_of("r", len(PROMPT)), expected_kv(PROMPT))


def test_a_speculative_engine_installs_nwor_and_commits_from_the_device(tmp_path: Path, daemon: FakeDaemon) -> None:
    from kvd_engine import vllm_nwor

    engine = VllmEngine(tiny_model_dir(tmp_path / "model"), "spec", dict(EXTRA), speculative_tokens=3)
    try:
        manager = vllm_nwor.installed()
        assert manager is not None and manager.mode.value == "stage"
        assert wait_until(lambda: engine.worker.worker.link.connected)
        engine.add_request("r", PROMPT, max_tokens=2)
        out = engine.scheduler.schedule()
        # Host token counts are optimistic under async spec decoding: none are sent from the host.
        assert out.kv_connector_metadata.host_commits == {}
    finally:
        engine.close()
    assert vllm_nwor.installed() is None  # shutdown put vLLM's runner back


@pytest.mark.parametrize(
    "params",
    [
        {
            "do_remote_prefill": True,
            "kvd": {"daemon_address": "x:1", "lease_id": "L", "block_ids": [1, 2, 3], "num_tokens": float("inf")},
        },
        {
            "do_remote_prefill": True,
            "kvd": {"daemon_address": "x:1", "lease_id": "L", "block_ids": [1, 2, 3], "num_tokens": 40},
            "kvd_block_size": float("inf"),
        },
    ],
)
def test_non_finite_params_are_recomputed_not_raised_into_vllm(
    daemon: FakeDaemon, engines: Any, params: dict[str, Any]
) -> None:
    """JSON's 1e400 is infinity, which vLLM's API accepts: int(inf) raising OverflowError inside
    Scheduler.add_request would kill the engine core. The request is recomputed instead."""
    d = engines("d")
    d.add_request("r", PROMPT, max_tokens=2, kv_transfer_params=params)
    run(daemon, d)
    assert not daemon.pulls and len(d.tokens["r"]) == len(PROMPT) + 2
    assert torch.equal(d.kv_of("r", len(PROMPT)), expected_kv(PROMPT))


def test_sleep_mode_is_refused_with_the_connector() -> None:
    """The daemon keeps the KV cache mapped and registered: vLLM must refuse sleep mode with it."""
    from vllm.config import KVTransferConfig

    from kvd_engine.connector import KvdConnector

    config = KVTransferConfig(kv_connector="KvdConnector", kv_role="kv_both")
    assert KvdConnector.supports_sleep_mode(config) is False
