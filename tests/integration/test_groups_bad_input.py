"""KV cache groups at the daemon's edge: bad groups, holds and pulls get a precise status.

Real daemons, real shm engines: a hybrid engine registers a full-attention group (``layout``)
and a Mamba-like state group (``groups``) over one region. What cannot be served is refused at
registration, at hold or at the pull, naming the model feature, and changes nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
from kvtest import ShmEngine, small_spec

from kvd.layout.plan import EngineView
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements
from kvd.server import convert
from kvd_client import errors
from kvd_client.v1.schema import KvGroupKind

pytestmark = pytest.mark.integration

STATE = LayoutSpec(
    num_layers=2,
    kv_format=KvFormat.MLA,
    layout=KvLayout.NHD,
    block_size=1,
    num_kv_heads=1,
    head_dim=256,
    dtype="uint8",
    num_blocks=32,
)


def _state_group(spec: LayoutSpec = STATE, kind: int = KvGroupKind.STATE) -> object:
    # The state layers overlay the attention group's bytes (as vLLM's groups do): block ids differ.
    view = EngineView(spec, tuple(contiguous_placements(spec)), kind=KvGroupKind.STATE, name="mamba")
    message = convert.group_to_pb(view)
    message.kind = kind  # type: ignore[attr-defined]
    return message


def _register(engine: ShmEngine, groups: list[object] | None = None) -> None:
    engine.client.register_kv_cache(request=engine.registration_request(groups=groups or []))
    engine.registered = True


def _engines(holder: ShmEngine) -> list[tuple[str, int]]:
    return sorted((e.engine_id, e.tp_rank) for e in holder.client.get_status().engines)


@pytest.fixture
def daemons(spawn_daemon):
    return spawn_daemon(name="a"), spawn_daemon(name="b")


def test_bad_groups_are_refused_at_registration(daemons) -> None:
    a, _ = daemons
    engine = ShmEngine(a.unix_target, "hybrid", small_spec())
    try:
        bad = dataclasses.replace(STATE, block_size=4, num_blocks=8)
        with pytest.raises(errors.InvalidArgument, match="invalid Mamba/linear-attention state layout: block_size 4"):
            _register(engine, [_state_group(bad)])
        with pytest.raises(errors.InvalidArgument, match="KV cache group 1 kind: 0 is not one of"):
            _register(engine, [_state_group(kind=0)])
        too_big = dataclasses.replace(STATE, head_dim=1 << 20)
        with pytest.raises(errors.InvalidArgument, match="group 1 'mamba' \\(state\\): layer 0: bytes"):
            _register(engine, [_state_group(too_big)])
        assert _engines(engine) == []  # nothing registered
        _register(engine, [_state_group()])
        assert _engines(engine) == [("hybrid", 0)]
    finally:
        engine.close()


def test_holds_and_pulls_of_a_hybrid_engine_are_checked(daemons) -> None:
    a, b = daemons
    holder = ShmEngine(a.unix_target, "hybrid", small_spec())
    hybrid_reader = ShmEngine(b.unix_target, "hybrid-reader", small_spec())
    plain_reader = ShmEngine(b.unix_target, "plain-reader", small_spec())
    try:
        _register(holder, [_state_group()])
        _register(hybrid_reader, [_state_group()])
        plain_reader.register()
        holder.fill_random(3)
        with pytest.raises(errors.InvalidArgument, match="needs 1 block id lists after block_ids, got 0"):
            holder.client.hold_blocks(engine_id="hybrid", request_id="r", block_ids=[1, 2], num_tokens=20)
        assert holder.client.get_status().leases_held == 0
        params = holder.client.hold_blocks(request=convert_hold("hybrid", "r", [1, 2], 20, [[9]])).kv_transfer_params
        assert list(params.group_block_ids) == [9] and list(params.group_block_counts) == [1]

        # A reader engine that is not the same hybrid model: refused at the pull, precisely.
        started = plain_reader.client.start_pull(
            engine_id="plain-reader", tp_rank=0, request_id="r", local_block_ids=[3, 4], remote=params
        )
        with pytest.raises(errors.FailedPrecondition, match="the holder has 2 KV cache groups, this engine 1"):
            plain_reader.client.wait_transfer(started.transfer_id, timeout_s=30)

        # The state is the state after all 20 held tokens: a pull of 16 cannot use it.
        short = type(params)()
        short.CopyFrom(params)
        short.num_tokens = 16
        short.block_ids[:] = [1]
        started = hybrid_reader.client.start_pull(request=convert_pull("hybrid-reader", "r", [3], short, [[11]]))
        with pytest.raises(errors.FailedPrecondition, match="holds the state after all 20 held tokens"):
            hybrid_reader.client.wait_transfer(started.transfer_id, timeout_s=30)

        # The whole request pulls: attention tokens and the state block, bytes equal.
        started = hybrid_reader.client.start_pull(request=convert_pull("hybrid-reader", "r", [3, 4], params, [[11]]))
        hybrid_reader.client.wait_transfer(started.transfer_id, timeout_s=30)
        assert hybrid_reader.token_bytes([3, 4], 20).equal(holder.token_bytes([1, 2], 20))
        for placement in contiguous_placements(STATE):
            there = holder.buffer[placement.k_offset + 9 * 256 : placement.k_offset + 10 * 256]
            here = hybrid_reader.buffer[placement.k_offset + 11 * 256 : placement.k_offset + 12 * 256]
            assert here.equal(there)
    finally:
        for engine in (holder, hybrid_reader, plain_reader):
            engine.close()


def convert_hold(engine_id: str, request_id: str, block_ids: list[int], num_tokens: int, groups: list[list[int]]):
    from kvd_client.v1 import engine_pb2

    return engine_pb2.HoldBlocksRequest(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=block_ids,
        num_tokens=num_tokens,
        group_block_ids=[b for ids in groups for b in ids],
        group_block_counts=[len(ids) for ids in groups],
    )


def convert_pull(engine_id: str, request_id: str, local: list[int], remote, groups: list[list[int]]):
    from kvd_client.v1 import router_pb2

    return router_pb2.StartPullRequest(
        engine_id=engine_id,
        tp_rank=0,
        request_id=request_id,
        local_block_ids=local,
        remote=remote,
        local_group_block_ids=[b for ids in groups for b in ids],
        local_group_block_counts=[len(ids) for ids in groups],
    )
