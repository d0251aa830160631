"""StartPulls between two real daemons: several pulls in one call, one of them bad; the valid ones
move exact bytes and their completions reach the reader's engine stream (batched or not, the
engine sees one message per event); the bad one fails alone and changes nothing."""

from __future__ import annotations

import time

import pytest
from kvtest import ShmEngine, engine_pair, small_spec

from kvd_client import errors
from kvd_client.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.integration

BLOCKS = 3
NUM_TOKENS = 16 * 2 + 7  # a partial last block


def hold_each(holder: ShmEngine, rids: list[str]) -> tuple[dict[str, list[int]], dict[str, list[int]], dict]:
    """Hold BLOCKS blocks per request on the holder (request i: blocks from i * BLOCKS); the held
    blocks, the reader's blocks for each (from block 24 on), and each hold's transfer params."""
    held = {rid: list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i, rid in enumerate(rids)}
    local = {rid: list(range(24 + i * BLOCKS, 24 + (i + 1) * BLOCKS)) for i, rid in enumerate(rids)}
    params = {
        rid: holder.client.hold_blocks(
            engine_id="holder", request_id=rid, block_ids=held[rid], num_tokens=NUM_TOKENS
        ).kv_transfer_params
        for rid in rids
    }
    return held, local, params


def test_start_pulls_starts_the_valid_pulls_and_fails_the_bad_one_alone(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=11) as (holder, reader):
        reader_stream = reader.client.open_engine_stream("reader", 0)
        rids = [f"req-{i}" for i in range(5)]
        held, local, params = hold_each(holder, rids)
        bad = "req-2"  # one local block too few: INVALID_ARGUMENT for it alone
        pulls = [
            router_pb2.StartPullRequest(
                engine_id="reader",
                request_id=rid,
                local_block_ids=local[rid][:-1] if rid == bad else local[rid],
                remote=params[rid],
            )
            for rid in rids
        ]
        pulls.append(router_pb2.StartPullRequest(engine_id="nosuch", request_id="req-x", remote=params["req-0"]))
        results = reader.client.start_pulls(pulls, timeout_s=30)

        assert len(results) == 6
        assert isinstance(results[2], errors.InvalidArgument) and "need 3 local blocks" in results[2].message
        assert isinstance(results[5], errors.UnknownEngine)
        good = [rid for rid in rids if rid != bad]
        transfer_ids = {rid: results[rids.index(rid)] for rid in good}
        assert all(isinstance(t, str) and t for t in transfer_ids.values()), results
        for rid, transfer_id in transfer_ids.items():
            status = reader.client.wait_transfer(transfer_id, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, rid
            assert reader.token_bytes(local[rid], NUM_TOKENS).equal(holder.token_bytes(held[rid], NUM_TOKENS)), rid

        finished: dict[str, str] = {}
        deadline = time.monotonic() + 10
        while len(finished) < len(good) and time.monotonic() < deadline:
            for message in reader_stream.poll(timeout_s=0.1):
                assert message.WhichOneof("kind") == "finished_recving", message
                finished[message.finished_recving.request_id] = message.finished_recving.transfer_id
        assert finished == transfer_ids

        # The bad pull changed nothing: its blocks kept their bytes, its lease is still held.
        assert bool((reader.token_bytes(local[bad], NUM_TOKENS) == 0xAB).all())
        still_held = [p.request_id for p in holder.client.lookup_held(engine_id="holder").held]
        assert still_held == [bad]
        # ...and it can still be pulled, correctly this time.
        (retry,) = reader.client.start_pulls(
            [
                router_pb2.StartPullRequest(
                    engine_id="reader", request_id=bad, local_block_ids=local[bad], remote=params[bad]
                )
            ]
        )
        assert isinstance(retry, str)
        assert reader.client.wait_transfer(retry, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert reader.token_bytes(local[bad], NUM_TOKENS).equal(holder.token_bytes(held[bad], NUM_TOKENS))

        with pytest.raises(errors.InvalidArgument, match="at most 1024 pulls start together"):
            reader.client.start_pulls([router_pb2.StartPullRequest()] * 1025)
        reader_stream.close()


def test_a_pull_asked_again_is_the_pull_already_started_and_the_engine_hears_of_it_once(spawn_daemon) -> None:
    """A router or connector that lost a StartPull(s) answer asks again: the same pull (engine,
    rank, request, local blocks, lease) answers with the transfer already started, while it runs
    and after it is DONE; no second read, no load_failed beside the finished_recving."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=5) as (holder, reader):
        reader_stream = reader.client.open_engine_stream("reader", 0)
        holder_stream = holder.client.open_engine_stream("holder", 0)
        rids = ["req-0", "req-1"]
        held, local, params = hold_each(holder, rids)
        orders = {
            rid: router_pb2.StartPullRequest(
                engine_id="reader", request_id=rid, local_block_ids=local[rid], remote=params[rid]
            )
            for rid in rids
        }

        first = reader.client.start_pull(request=orders["req-0"]).transfer_id
        assert reader.client.start_pull(request=orders["req-0"]).transfer_id == first
        batch = reader.client.start_pulls([orders["req-1"], orders["req-1"], orders["req-0"]])
        assert isinstance(batch[0], str) and batch == [batch[0], batch[0], first]
        transfer_ids = {"req-0": first, "req-1": batch[0]}
        for rid, transfer_id in transfer_ids.items():
            assert reader.client.wait_transfer(transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
            assert reader.token_bytes(local[rid], NUM_TOKENS).equal(holder.token_bytes(held[rid], NUM_TOKENS)), rid

        # Asked again once DONE (the lease ended with the read): the DONE transfer, nothing read.
        assert reader.client.start_pull(request=orders["req-0"]).transfer_id == first
        (again,) = reader.client.start_pulls([orders["req-1"]])
        assert again == transfer_ids["req-1"]

        heard: list[tuple[str, str]] = []
        sent: list[str] = []
        deadline = time.monotonic() + 2.0  # long enough for a second event to show, were there one
        while time.monotonic() < deadline:
            for message in reader_stream.poll(timeout_s=0.1):
                kind = message.WhichOneof("kind")
                heard.append((kind, getattr(message, kind).request_id))
            sent += [m.finished_sending.request_id for m in holder_stream.poll(timeout_s=0.0)]
        assert sorted(heard) == [("finished_recving", "req-0"), ("finished_recving", "req-1")]
        assert sorted(sent) == rids
        reader_stream.close()
        holder_stream.close()
