"""plan_pull between identical layouts: block-for-block reads, merged into power-of-two runs.

Checked with the reference executor against the oracle, and for the descriptor counts the
design promises (a 1k-token Llama-8B-shaped request: one descriptor per plane per run).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvd.layout import oracle
from kvd.layout.plan import EngineView, plan_pull
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements


def _llama(kv_format: KvFormat, layout: KvLayout = KvLayout.NHD, num_blocks: int = 80, **kw: int) -> EngineView:
    """Llama-3-8B's KV shape (32 layers, 8 KV heads, head_dim 128, bf16), shrinkable for speed."""
    spec = LayoutSpec(
        num_layers=kw.get("layers", 32),
        kv_format=kv_format,
        layout=layout,
        block_size=kw.get("block_size", 16),
        num_kv_heads=1 if kv_format is KvFormat.MLA else kw.get("heads", 8),
        head_dim=kw.get("head_dim", 128),
        dtype="bfloat16",
        num_blocks=num_blocks,
    )
    return EngineView(spec, tuple(contiguous_placements(spec)))


def test_1k_tokens_contiguous_split_is_64_descriptors() -> None:
    view = _llama(KvFormat.SPLIT)
    plan = plan_pull({0: view}, view, list(range(64)), list(range(10, 74)), 1024)
    assert plan.direct and plan.postprocess is None and plan.staging_bytes == 0
    assert plan.num_descriptors == 64  # 32 layers x (K, V) x one run of 64 blocks
    assert plan.total_bytes == 32 * 2 * 1024 * 8 * 128 * 2


@pytest.mark.parametrize(("layout", "tail_descriptors"), [(KvLayout.NHD, 64), (KvLayout.HND, 64 * 8)])
def test_a_tail_block_adds_its_own_descriptors(layout: KvLayout, tail_descriptors: int) -> None:
    """The partial block is read token-exact: one piece per plane (NHD), per plane and head (HND)."""
    view = _llama(KvFormat.SPLIT, layout)
    plan = plan_pull({0: view}, view, list(range(65)), list(range(65)), 1030)
    assert plan.num_descriptors == 64 + tail_descriptors
    assert plan.total_bytes == 32 * 2 * 1030 * 8 * 128 * 2


def test_joint_reads_k_and_v_of_a_block_together() -> None:
    view = _llama(KvFormat.JOINT)
    plan = plan_pull({0: view}, view, list(range(64)), list(range(64)), 1024)
    assert plan.num_descriptors == 32


def test_scattered_blocks_cost_one_descriptor_per_run() -> None:
    view = _llama(KvFormat.SPLIT, layers=2)
    # runs: [5..8] (4 = one piece), [20..22] (3 = 2 + 1), [40] (1)
    remote = [5, 6, 7, 8, 20, 21, 22, 40]
    plan = plan_pull({0: view}, view, remote, list(range(8)), 8 * 16)
    assert plan.num_descriptors == 2 * 2 * 4


@pytest.mark.parametrize("kv_format", [KvFormat.SPLIT, KvFormat.JOINT, KvFormat.MLA])
@pytest.mark.parametrize("layout", list(KvLayout))
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 50])
def test_same_layout_matches_oracle_and_never_reads_the_tail(
    kv_format: KvFormat, layout: KvLayout, num_tokens: int
) -> None:
    view = _llama(kv_format, layout, num_blocks=12, layers=2, heads=2, head_dim=4)
    rng = np.random.default_rng(num_tokens)
    blocks = view.spec.blocks_for(num_tokens)
    remote_ids = rng.permutation(12)[:blocks].tolist()
    local_ids = rng.permutation(12)[:blocks].tolist()
    remote = torch.randint(0, 256, (view.spec.total_bytes,), dtype=torch.uint8)
    local = torch.randint(0, 256, (view.spec.total_bytes,), dtype=torch.uint8)
    expected = local.clone()
    oracle.scatter([expected], view, local_ids, oracle.gather([remote], view, remote_ids, num_tokens))
    plan = plan_pull({0: view}, view, remote_ids, local_ids, num_tokens, max_run_blocks=4)
    log = oracle.execute_plan(plan, {0: [remote]}, [local])
    assert torch.equal(local, expected)
    allowed = oracle.token_mask([remote.numel()], view, remote_ids, num_tokens)[0]
    assert not (log.remote_read[0][0] & ~allowed).any()
    assert log.engine_writes[0].max() == 1


def test_same_layout_with_different_block_counts_reads_from_the_same_rank() -> None:
    """Only num_blocks differs: still the same-layout path (no staging, no conversion)."""
    local = _llama(KvFormat.SPLIT, num_blocks=200, layers=2)
    remote = EngineView(dataclasses.replace(local.spec, num_blocks=70), local.placements[:2])
    remote = EngineView(remote.spec, tuple(contiguous_placements(remote.spec)))
    plan = plan_pull({0: remote}, local, list(range(4)), list(range(4)), 64)
    assert plan.direct and plan.remote_ranks == (0,)
