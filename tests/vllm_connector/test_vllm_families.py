"""Every model family through vLLM 0.33's real Scheduler, KvdConnector and two real daemons.

KV cache configs come from vLLM's own planner with the hybrid KV cache manager on (see
``vllm_family_harness``); the prefill engine registers with daemon A, the decode engine with
daemon B, and pulls go over real NIXL. Checked, byte for byte against the values the stand-in
runner wrote:

* MLA (a tiny DeepSeek-V2-Lite: one latent of kv_lora_rank + rope_dim per token), TP 1 -> 1 and
  2 -> 1 (the latent is replicated: the reader reads one holder rank's copy), P -> D and D -> P;
* sliding window + full attention: every group's blocks, the window group only its tail;
* a Mamba2 hybrid: attention blocks and the conv + SSM state (the state after N-1 tokens: the
  prefill engine stops one token short, the decode engine recomputes it);
* a target with a drafter whose layers form their own KV cache group: the drafter's KV is pulled;
* refusals: a group kind kvd cannot serve stops the connector with the feature's name; a
  Mamba state pulled across TP degrees fails precisely (FAILED_PRECONDITION naming it) and is
  recomputed.
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
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm_family_harness import FamilyEngine, model_dir, state_block, state_bytes

from kvd.spawn import DaemonProcess
from kvd_client.errors import UnsupportedModelFeature

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

BLOCK = 16
PROMPT = list(range(300, 345))  # 45 tokens: 2 full blocks of 16 and a partial one
KV_LORA_RANK, ROPE_DIM = 32, 16


def _attn(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, **kw)


def mla_specs() -> dict[str, KVCacheSpec]:
    latent = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.float32)
    return {f"model.layers.{i}.self_attn.attn": latent for i in range(2)}


def window_specs() -> dict[str, KVCacheSpec]:
    window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=20)
    return {f"model.layers.{i}.self_attn.attn": (window if i % 2 else _attn()) for i in range(4)}


def mamba_specs(tp_size: int = 1) -> dict[str, KVCacheSpec]:
    # Mamba2 state of a tiny layer: conv state [conv_kernel - 1, conv_dim], SSM [heads, head_dim, d_state]
    # (sharded by TP, as the attention heads are).
    mamba = MambaSpec(
        block_size=BLOCK, shapes=((3, 32 // tp_size), (4 // tp_size, 8, 16)), dtypes=(torch.float32, torch.float32)
    )
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2 // tp_size, head_size=16, dtype=torch.float32)
    return {
        "model.layers.0.mixer": mamba,
        "model.layers.1.self_attn.attn": attn,
        "model.layers.2.mixer": mamba,
        "model.layers.3.self_attn.attn": attn,
    }


def drafter_specs() -> dict[str, KVCacheSpec]:
    # The drafter's layer has its own shape (1 KV head of 32, same page size): its own KV cache group.
    drafter = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32, is_draft=True)
    return {"model.layers.0.self_attn.attn": _attn(), "model.layers.1.self_attn.attn": _attn(), "drafter.attn": drafter}


DEEPSEEK_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "kv_lora_rank": KV_LORA_RANK,
    "qk_rope_head_dim": ROPE_DIM,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "q_lora_rank": None,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def _extra(daemon: DaemonProcess, **overrides: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "kvd_socket": daemon.unix_socket,
        "pull_threshold_tokens": 16,
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
    return spawn_daemon(name="node-a"), spawn_daemon(name="node-b")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., FamilyEngine]]:
    made: list[FamilyEngine] = []

    def make(
        daemon: DaemonProcess, role: str, specs: dict[str, KVCacheSpec], model: dict[str, Any] | None = None, **kw: Any
    ) -> FamilyEngine:
        engine_id = f"{role}-{uuid.uuid4().hex[:6]}"
        where = model_dir(tmp_path / f"model-{engine_id}", model or {})
        engine = FamilyEngine(where, engine_id, _extra(daemon), specs, **kw)
        made.append(engine)
        for worker in engine.workers:
            link = worker.worker.link
            _wait(lambda link=link: link.connected, f"{engine_id} did not register:\n{daemon.log_tail()}")
        return engine

    yield make
    for engine in made:
        engine.close()


def run(*engines: FamilyEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(e.has_work() for e in engines):
        assert time.monotonic() < deadline, "engines did not settle"
        for engine in engines:
            engine.step()
        time.sleep(0.002)


def release_holds(engine: FamilyEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.requests and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.005)


def received(engine: FamilyEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.finished_recving or ())}


def failed(engine: FamilyEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.failed_recving or ())}


def sent(engine: FamilyEngine) -> set[str]:
    return {rid for out in engine.results for rid in (out.finished_sending or ())}


def transfers(daemon: DaemonProcess, **labels: str) -> float:
    return metric_value(scrape(daemon.metrics), "kvd_transfers_total", **labels)


def pulled_bytes(daemon: DaemonProcess) -> float:
    return metric_value(scrape(daemon.metrics), "kvd_transfer_bytes_total", direction="pull")


def prefill(p: FamilyEngine, rid: str, prompt: list[int]) -> dict[str, Any]:
    p.add_request(rid, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    run(p)
    params = p.outputs[rid].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True, params
    return params


def pull_into(d: FamilyEngine, p: FamilyEngine, rid: str, prompt: list[int], params: dict[str, Any]) -> int:
    """Decode pulls ``rid``; returns the pulled token count."""
    n = params["kvd"]["num_tokens"]
    d.add_request(rid, prompt, max_tokens=3, kv_transfer_params=params)
    d.step()
    assert d.scheduler.requests[rid].status.name == "WAITING_FOR_REMOTE_KVS"
    run(d, p)
    assert rid in received(d) and not failed(d), d.results[-3:]
    return int(n)


def assert_attention_pulled(d: FamilyEngine, p: FamilyEngine, rid: str, layer: str, positions: torch.Tensor) -> None:
    got = d.values_at(rid, layer, positions)
    assert torch.equal(got.view(torch.uint8), p.values_at(rid, layer, positions).view(torch.uint8)), layer
    assert torch.equal(got, d.expected_at(rid, layer, positions)), layer


# --- MLA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "holder_tp,reader_tp",
    [(1, 1), (2, 1), (1, 2), (2, 2)],
    ids=["tp1-to-tp1", "tp2-to-tp1", "tp1-to-tp2", "tp2-to-tp2"],
)
def test_mla_prefill_to_decode(nodes: Any, engines: Any, holder_tp: int, reader_tp: int) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill", mla_specs(), DEEPSEEK_LITE, tp_size=holder_tp)
    d = engines(node_b, "decode", mla_specs(), DEEPSEEK_LITE, tp_size=reader_tp)
    assert p.connector.group_order.groups[0].mla
    params = prefill(p, "r", PROMPT)
    n = pull_into(d, p, "r", PROMPT, params)
    assert n == len(PROMPT)
    positions = torch.arange(n)
    for rank in range(reader_tp):  # every reader rank holds the whole latent (MLA is replicated)
        for layer in mla_specs():
            assert d.kv_caches[rank][layer].shape[1:] == (1, BLOCK, KV_LORA_RANK + ROPE_DIM)  # one latent per token
            got = d.values_at("r", layer, positions, rank)
            assert torch.equal(got.view(torch.uint8), p.values_at("r", layer, positions).view(torch.uint8))
            assert torch.equal(got, d.expected_at("r", layer, positions, rank))
    latent_bytes = 2 * n * (KV_LORA_RANK + ROPE_DIM) * 4
    assert pulled_bytes(node_b) == latent_bytes * reader_tp  # each reader rank reads one holder rank's copy
    served = metric_value(scrape(node_a.metrics), "kvd_transfer_bytes_total", direction="serve")
    assert served == latent_bytes * reader_tp  # and the holder served exactly that
    release_holds(p)
    assert "r" in sent(p) and not p.scheduler.requests


def test_mla_decode_back_to_prefill(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill", mla_specs(), DEEPSEEK_LITE)
    d = engines(node_b, "decode", mla_specs(), DEEPSEEK_LITE)
    params = prefill(p, "t1", PROMPT)
    pull_into(d, p, "t1", PROMPT, params)
    release_holds(p)
    held = d.outputs["t1"].kv_transfer_params
    assert held["do_remote_decode"] is True and held["kvd"]["daemon_address"] == node_b.tcp
    n = held["kvd"]["num_tokens"]
    turn2 = d.tokens["t1"] + [1, 2, 3]
    p.add_request("t2", turn2, max_tokens=1, kv_transfer_params=held)
    p.step()
    assert p.scheduler.requests["t2"].status.name == "WAITING_FOR_REMOTE_KVS"
    run(p, d)
    assert "t2" in received(p) and not failed(p)
    positions = torch.arange(n)
    for layer in mla_specs():
        got = p.values_at("t2", layer, positions)
        assert torch.equal(got.view(torch.uint8), d.values_at("t1", layer, positions).view(torch.uint8))
    assert transfers(node_a, peer=node_b.tcp, direction="pull", outcome="done") == 1


# --- hybrid ------------------------------------------------------------------------------------


def test_sliding_window_and_full_attention(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill", window_specs()), engines(node_b, "decode", window_specs())
    kinds = [g.kind.name for g in d.connector.group_order.groups]
    assert kinds == ["FULL_ATTENTION", "SLIDING_WINDOW"]  # the hybrid KV cache manager kept both groups
    # A pull writes every group's blocks: vLLM must zero none of them under it.
    assert d.connector.get_loaded_kv_cache_group_ids(None) == (0, 1) == d.kv_cache_config.transfer_group_ids
    params = prefill(p, "r", PROMPT)
    window_ids = params["kvd"]["group_block_ids"]
    n = pull_into(d, p, "r", PROMPT, params)
    assert n == len(PROMPT)
    assert 0 < len(window_ids) < len(params["kvd"]["block_ids"])  # only the window's blocks were held
    full_layers = [name for name in window_specs() if d.group_of(name) == d.group_of("model.layers.0.self_attn.attn")]
    window_layers = [name for name in window_specs() if name not in full_layers]
    for layer in full_layers:
        assert_attention_pulled(d, p, "r", layer, torch.arange(n))
    # The window group: every token of the blocks decode kept for the window, as prefill wrote them.
    table = d.block_tables["r"][d.group_of(window_layers[0])]
    first_kept = next(i for i, b in enumerate(table) if b != 0)
    in_window = torch.arange(first_kept * BLOCK, n)
    assert in_window.numel() >= 20 - 1
    for layer in window_layers:
        assert_attention_pulled(d, p, "r", layer, in_window)
    # Fewer bytes than the full groups' worth: the window group moved only its tail.
    token_bytes = 2 * 16 * 2 * 4  # heads * (K|V of 16) * float32
    assert pulled_bytes(node_b) < 4 * n * token_bytes
    release_holds(p)
    assert "r" in sent(p) and not p.scheduler.requests


def test_mamba2_hybrid(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill", mamba_specs()), engines(node_b, "decode", mamba_specs())
    assert [g.kind.name for g in d.connector.group_order.groups] == ["FULL_ATTENTION", "STATE"]
    params = prefill(p, "r", PROMPT)
    n = params["kvd"]["num_tokens"]
    assert n == len(PROMPT) - 1  # prefill stopped one token short: decode derives the last state
    holder_state = {
        name: p.kv_caches[0][name][state_block(p.block_tables["r"][p.group_of(name)]), 0, 0].clone()
        for name in mamba_specs()
        if "mixer" in name
    }
    pull_into(d, p, "r", PROMPT, params)
    for name, spec in mamba_specs().items():
        if isinstance(spec, MambaSpec):
            loaded = d.loaded_state["r"][name]
            assert torch.equal(loaded, holder_state[name]), name  # the pulled conv + SSM state
            assert torch.equal(loaded, state_bytes(PROMPT[:n], p.layer_index[name], loaded.numel()))
        else:
            assert_attention_pulled(d, p, "r", name, torch.arange(n))
    release_holds(p)
    assert "r" in sent(p) and not p.scheduler.requests


# --- the drafter -----------------------------------------------------------------------------


def test_drafter_group_is_pulled(nodes: Any, engines: Any) -> None:
    node_a, node_b = nodes
    p, d = engines(node_a, "prefill", drafter_specs()), engines(node_b, "decode", drafter_specs())
    # vLLM keeps the drafter in the target's block table (one UniformTypeKVCacheSpecs group); kvd
    # registers its layer as a group of its own shape, with that block table's ids.
    kvd_groups = d.workers[0].group_order.groups
    assert [g.layer_names for g in kvd_groups] == [
        ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
        ("drafter.attn",),
    ]
    assert kvd_groups[1].name.startswith("drafter")
    params = prefill(p, "r", PROMPT)
    n = pull_into(d, p, "r", PROMPT, params)
    for layer in drafter_specs():
        assert_attention_pulled(d, p, "r", layer, torch.arange(n))
    assert d.kv_caches[0]["drafter.attn"].shape[1:] == (1, BLOCK, 64)


# --- refusals ----------------------------------------------------------------------------------


def test_unsupported_group_kind_is_refused_naming_it(nodes: Any, tmp_path: Path) -> None:
    node_a, _ = nodes
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, attention_chunk_size=32
    )
    specs = {"model.layers.0.self_attn.attn": _attn(), "model.layers.1.self_attn.attn": chunked}
    with pytest.raises(UnsupportedModelFeature, match="ChunkedLocalAttentionSpec"):
        FamilyEngine(model_dir(tmp_path / "m", {}), "chunked", _extra(node_a), specs)


def test_mamba_state_across_tp_degrees_is_refused_and_recomputed(
    nodes: Any, engines: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node_a, node_b = nodes
    p = engines(node_a, "prefill", mamba_specs())
    d = engines(node_b, "decode", mamba_specs(tp_size=2), tp_size=2)
    params = prefill(p, "r", PROMPT)
    d.add_request("r", PROMPT, max_tokens=2, kv_transfer_params=params)
    run(d, p)
    assert failed(d) == {"r"}  # reported failed: vLLM recomputed it
    assert transfers(node_b, direction="pull", outcome="failed") == 2  # one per decode rank
    refusal = "Mamba/linear-attention state is sharded by tensor parallelism"
    assert refusal in node_b.log_tail(200)
    # The engine heard the exact error class and the feature's name (and recomputed).
    assert f"UnsupportedModelFeature: group 1 'MambaSpec:MAMBA2' (state): {refusal}" in caplog.text
    assert len(d.tokens["r"]) == len(PROMPT) + 2 and d.outputs["r"].finish_reason is not None
