"""Step READs between real daemons (kvd.core.step_reads): an engine step's pulls from one holder
engine rank go out as one NIXL transfer with one notification, and each pull still ends on its
own: exact bytes for every pull that succeeds, only its own blocks written, every lease ended by
its read on the holder, and a pull whose lease ended before its admission FAILED alone while the
pulls it shared a transfer with are DONE."""

from __future__ import annotations

import os

import pytest
from kvtest import engine_pair, eventually, metric_value, scrape, small_spec

from kvd_client import errors
from kvd_client.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.integration

STEP = 64  # one-block pulls in the first test's step: as many as one step READ carries


def _env(transports: str, **extra: str) -> dict[str, str] | None:
    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    if extra:
        env = {**(env or os.environ), **extra}
    return env


def _hold(holder, held: dict[str, list[int]], tokens: dict[str, int]) -> dict:  # type: ignore[no-untyped-def]
    """Each request's blocks held on the holder engine: its transfer params, by request id."""
    return {
        rid: holder.client.hold_blocks(
            engine_id="holder", request_id=rid, block_ids=held[rid], num_tokens=tokens[rid]
        ).kv_transfer_params
        for rid in held
    }


def _requests(held: dict[str, list[int]], local: dict[str, list[int]], params: dict) -> list:
    return [
        router_pb2.StartPullRequest(engine_id="reader", request_id=rid, local_block_ids=local[rid], remote=params[rid])
        for rid in held
    ]


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_a_step_of_pulls_is_one_transfer_and_every_pull_arrives_exact(spawn_daemon, transports: str) -> None:
    """64 one-block pulls of adjacent holder blocks into adjacent reader blocks, and two of three
    blocks with a partial last one, in one StartPulls (more READs than one step READ carries, so
    two of them, and the tails' READs as a third): every pull DONE, its bytes exact and
    nothing else written; the reader posted step READs (kvd_step_read_reads), the holder counted
    each pull's read from the step's notification (every lease ended by its read)."""
    a = spawn_daemon(name="a", env=_env(transports))
    b = spawn_daemon(name="b", env=_env(transports))
    spec = small_spec(num_blocks=160)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=23) as (holder, reader):
        held = {f"one-{i}": [4 + i] for i in range(STEP)}
        held |= {"three-0": [140, 141, 142], "three-1": [143, 144, 145]}
        local = {f"one-{i}": [70 + i] for i in range(STEP)}
        local |= {"three-0": [150, 151, 152], "three-1": [153, 154, 155]}
        tokens = {rid: spec.block_size for rid in held} | {"three-0": 2 * 16 + 5, "three-1": 2 * 16 + 9}
        params = _hold(holder, held, tokens)
        results = reader.client.start_pulls(_requests(held, local, params), timeout_s=30)
        assert all(isinstance(r, str) and r for r in results), results
        for rid, transfer_id in zip(held, results, strict=True):
            status = reader.client.wait_transfer(transfer_id, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, (rid, status.error_message)
            assert reader.token_bytes(local[rid], tokens[rid]).equal(holder.token_bytes(held[rid], tokens[rid])), rid
        assert reader.untouched_outside([(local[rid], tokens[rid]) for rid in held], 0xAB)
        text = scrape(b.metrics)
        assert metric_value(text, "kvd_step_read_reads_count") >= 2
        assert metric_value(text, "kvd_step_read_reads_sum") >= STEP
        # every lease ended by its read (its FinishRead, a moment after the pull was reported)
        assert not eventually(lambda: list(holder.client.lookup_held(engine_id="holder").held), [])
        pulled = metric_value(text, "kvd_transfer_bytes_total", direction="pull")
        served = eventually(
            lambda: metric_value(scrape(a.metrics), "kvd_transfer_bytes_total", direction="serve"), pulled
        )
        assert served == pulled > 0


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_a_pull_whose_lease_ended_fails_alone_in_its_step(spawn_daemon, transports: str) -> None:
    """Eight one-block pulls in one StartPulls, one of whose leases the holder's router released
    just before: that pull FAILED (its admission refused: the lease is gone), never DONE; the
    seven others, which may share its NIXL transfer, are DONE with exact bytes."""
    a = spawn_daemon(name="a", env=_env(transports))
    b = spawn_daemon(name="b", env=_env(transports))
    spec = small_spec(num_blocks=64)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=29) as (holder, reader):
        held = {f"r{i}": [8 + i] for i in range(8)}
        local = {f"r{i}": [30 + i] for i in range(8)}
        tokens = dict.fromkeys(held, spec.block_size)
        params = _hold(holder, held, tokens)
        gone = "r3"
        holder.client.release_lease(params[gone].lease_id)
        results = reader.client.start_pulls(_requests(held, local, params), timeout_s=30)
        for rid, transfer_id in zip(held, results, strict=True):
            assert isinstance(transfer_id, str), (rid, transfer_id)
            if rid == gone:
                with pytest.raises(errors.UnknownLease):  # the pull's own error, its class kept end to end
                    reader.client.wait_transfer(transfer_id, timeout_s=30)
                assert reader.client.get_transfer(transfer_id).state == common_pb2.TRANSFER_STATE_FAILED
            else:
                status = reader.client.wait_transfer(transfer_id, timeout_s=30)
                assert status.state == common_pb2.TRANSFER_STATE_DONE, (rid, status.error_message)
                assert reader.token_bytes(local[rid], tokens[rid]).equal(holder.token_bytes(held[rid], tokens[rid]))
        assert not eventually(lambda: list(holder.client.lookup_held(engine_id="holder").held), [])
        assert metric_value(scrape(b.metrics), "kvd_step_read_reads_sum") >= 2


def test_step_reads_off_posts_a_transfer_per_pull(spawn_daemon) -> None:
    """``step_reads = false``: the same step's pulls are exact, and no step READ was posted."""
    a = spawn_daemon(name="a")
    b = spawn_daemon("--step-reads", "false", name="b")
    spec = small_spec(num_blocks=64)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=31) as (holder, reader):
        held = {f"r{i}": [i] for i in range(8)}
        local = {f"r{i}": [16 + i] for i in range(8)}
        tokens = dict.fromkeys(held, spec.block_size)
        params = _hold(holder, held, tokens)
        results = reader.client.start_pulls(_requests(held, local, params), timeout_s=30)
        for rid, transfer_id in zip(held, results, strict=True):
            status = reader.client.wait_transfer(transfer_id, timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, (rid, status.error_message)
            assert reader.token_bytes(local[rid], tokens[rid]).equal(holder.token_bytes(held[rid], tokens[rid]))
        assert metric_value(scrape(b.metrics), "kvd_step_read_reads_count") == 0
