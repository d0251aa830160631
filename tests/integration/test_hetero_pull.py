"""Heterogeneous engines between two real daemons: layout, block size, TP and MLA conversions.

Every pair is checked against the oracle (kvd.layout.oracle): the logical KV of the pulled
tokens on the reader equals the holder's, bit for bit, and bytes outside the pull stay put.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from kvtest import ShmEngine, eventually

from kvd.layout import oracle
from kvd.layout.plan import EngineView
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec
from kvd_client import errors
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration

TOTAL_HEADS = 4


def _spec(
    kv_format: KvFormat, layout: KvLayout, block_size: int, tp_size: int, rank: int, num_blocks: int
) -> LayoutSpec:
    mla = kv_format is KvFormat.MLA
    return LayoutSpec(
        num_layers=3,
        kv_format=kv_format,
        layout=layout,
        block_size=block_size,
        num_kv_heads=1 if mla else max(1, TOTAL_HEADS // tp_size),
        total_num_kv_heads=1 if mla else TOTAL_HEADS,
        head_dim=32,
        dtype="bfloat16",
        num_blocks=num_blocks,
        tp_rank=rank,
        tp_size=tp_size,
    )


def _logical(engines: list[ShmEngine], block_ids: list[int], num_tokens: int) -> dict[int, torch.Tensor]:
    """Model-global head id -> logical KV [layers, planes, tokens, head_bytes] of that head."""
    heads: dict[int, torch.Tensor] = {}
    for engine in engines:
        view = EngineView(engine.spec, tuple(engine.placements))
        data = oracle.gather([engine.buffer], view, block_ids, num_tokens)
        for i, head in enumerate(oracle.head_ids(view)):
            heads[head] = data[:, :, :, i]
    return heads


CASES = {
    "nhd_to_hnd_split": (KvFormat.SPLIT, KvLayout.NHD, 16, 1, KvFormat.SPLIT, KvLayout.HND, 16, 1),
    "hnd_to_nhd_joint": (KvFormat.JOINT, KvLayout.HND, 16, 1, KvFormat.JOINT, KvLayout.NHD, 16, 1),
    "block_16_to_64": (KvFormat.SPLIT, KvLayout.NHD, 16, 1, KvFormat.SPLIT, KvLayout.NHD, 64, 1),
    "block_64_to_16": (KvFormat.SPLIT, KvLayout.HND, 64, 1, KvFormat.SPLIT, KvLayout.HND, 16, 1),
    "tp_2_to_1": (KvFormat.SPLIT, KvLayout.NHD, 16, 2, KvFormat.SPLIT, KvLayout.NHD, 16, 1),
    "tp_1_to_2": (KvFormat.SPLIT, KvLayout.HND, 16, 1, KvFormat.SPLIT, KvLayout.HND, 16, 2),
    "tp_8_replicas_to_2": (KvFormat.SPLIT, KvLayout.NHD, 16, 8, KvFormat.SPLIT, KvLayout.NHD, 16, 2),
    "mla_block_32_to_16": (KvFormat.MLA, KvLayout.NHD, 32, 1, KvFormat.MLA, KvLayout.NHD, 16, 1),
    "combined_nhd16_tp2_to_hnd64_tp1": (KvFormat.SPLIT, KvLayout.NHD, 16, 2, KvFormat.SPLIT, KvLayout.HND, 64, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_heterogeneous_pull_matches_the_oracle(spawn_daemon, case: str) -> None:
    r_fmt, r_layout, r_bs, r_tp, l_fmt, l_layout, l_bs, l_tp = CASES[case]
    holder_daemon, reader_daemon = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    num_tokens = 150  # partial last blocks on both sides
    r_blocks_n, l_blocks_n = 24 * 64 // r_bs, 24 * 64 // l_bs
    holders = [
        ShmEngine(holder_daemon.unix_target, "p", _spec(r_fmt, r_layout, r_bs, r_tp, r, r_blocks_n))
        for r in range(r_tp)
    ]
    readers = [
        ShmEngine(reader_daemon.unix_target, "d", _spec(l_fmt, l_layout, l_bs, l_tp, r, l_blocks_n))
        for r in range(l_tp)
    ]
    try:
        for engine in holders:
            engine.register()
            engine.fill_random(100 + engine.spec.head_range()[0])  # replicas of a head hold the same KV
        for engine in readers:
            engine.register()
            engine.fill(0x77)
        rng = random.Random(case)
        remote_blocks = rng.sample(range(r_blocks_n), -(-num_tokens // r_bs))
        local_blocks = rng.sample(range(l_blocks_n), -(-num_tokens // l_bs))
        params = (
            holders[0]
            .client.hold_blocks(engine_id="p", request_id="req", block_ids=remote_blocks, num_tokens=num_tokens)
            .kv_transfer_params
        )
        transfers = [
            reader.client.start_pull(
                engine_id="d",
                tp_rank=reader.spec.tp_rank,
                request_id="req",
                local_block_ids=local_blocks,
                remote=params,
            )
            for reader in readers
        ]
        for reader, started in zip(readers, transfers, strict=True):
            status = reader.client.wait_transfer(started.transfer_id, timeout_s=60)
            assert status.state == common_pb2.TRANSFER_STATE_DONE

        expected = _logical(holders, remote_blocks, num_tokens)
        got = _logical(readers, local_blocks, num_tokens)
        for head, tensor in got.items():
            assert torch.equal(tensor, expected[head]), f"head {head} differs from the holder's"
        for reader in readers:
            view = EngineView(reader.spec, tuple(reader.placements))
            mask = torch.from_numpy(oracle.token_mask([reader.buffer.numel()], view, local_blocks, num_tokens)[0])
            assert bool((reader.buffer[~mask] == 0x77).all()), "bytes outside the pull were written"
        # Every reader rank has read: the lease is released.
        assert not eventually(lambda: list(holders[0].client.lookup_held(engine_id="p").held), [])
    finally:
        for engine in holders + readers:
            engine.close()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "float16", "dtype: remote bfloat16 vs local float16"),
        ("head_dim", 64, "head_dim: remote 32 vs local 64"),
        ("num_layers", 2, "num_layers: remote 3 vs local 2"),
    ],
)
def test_refused_pairs_fail_with_failed_precondition(spawn_daemon, field: str, value: object, message: str) -> None:
    holder_daemon, reader_daemon = spawn_daemon(name="holder"), spawn_daemon(name="reader")
    remote_spec = _spec(KvFormat.SPLIT, KvLayout.NHD, 16, 1, 0, 16)
    holder = ShmEngine(holder_daemon.unix_target, "p", remote_spec)
    reader = ShmEngine(reader_daemon.unix_target, "d", dataclasses.replace(remote_spec, **{field: value}))
    try:
        holder.register()
        reader.register()
        params = holder.client.hold_blocks(
            engine_id="p", request_id="r", block_ids=[0, 1], num_tokens=20
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="r", local_block_ids=[2, 3], remote=params
        )
        with pytest.raises(errors.FailedPrecondition, match=message):
            reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert bool((reader.buffer == 0).all())
    finally:
        holder.close()
        reader.close()


def test_a_pull_that_cannot_get_staging_is_resource_exhausted(spawn_daemon) -> None:
    """The staging pool is bounded: a conversion bigger than it fails at once, nothing allocated."""
    holder_daemon = spawn_daemon(name="holder")
    reader_daemon = spawn_daemon("--staging-pool-bytes", "4096", name="reader")
    holder = ShmEngine(holder_daemon.unix_target, "p", _spec(KvFormat.SPLIT, KvLayout.NHD, 16, 1, 0, 16))
    reader = ShmEngine(reader_daemon.unix_target, "d", _spec(KvFormat.SPLIT, KvLayout.HND, 16, 1, 0, 16))
    try:
        holder.register()
        reader.register()
        reader.fill(0x11)
        params = holder.client.hold_blocks(
            engine_id="p", request_id="r", block_ids=[0, 1, 2], num_tokens=40
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="d", tp_rank=0, request_id="r", local_block_ids=[3, 4, 5], remote=params
        )
        with pytest.raises(errors.ResourceExhausted, match="staging"):
            reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert bool((reader.buffer == 0x11).all()), "a failed pull wrote into the engine's blocks"
        # The lease survives a reader's failure: a retry with room to stage would still find it.
        assert holder.client.lookup_held(engine_id="p").held
    finally:
        holder.close()
        reader.close()
