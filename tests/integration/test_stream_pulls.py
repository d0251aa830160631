"""Pulls started on the engine stream (``EngineMessage.start_pulls``) between two real daemons.

The reader's engine stream says it takes pulls (the daemon's ready, consumed by the client), its
pulls move exact bytes, each message's ``pulls_started`` answer comes back on the stream it was
sent on before any ``finished_recving`` of its pulls, a bad item fails alone and changes nothing,
a message over the bound starts nothing, and the stream goes on through all of it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import pytest
from kvtest import ShmEngine, engine_pair, eventually, small_spec

from kvd_client import EngineStream, KvdClient, errors, pull_results
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2

pytestmark = pytest.mark.integration

BLOCKS = 3
NUM_TOKENS = 16 * 2 + 7  # a partial last block
FILL = 0xAB  # every byte of the reader's blocks before a pull (engine_pair's fill)


def env_of(transports: str) -> dict[str, str] | None:
    return {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None


def hold_each(
    holder: ShmEngine, rids: list[str], local_from: int = 24
) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, common_pb2.KvTransferParams]]:
    """Hold BLOCKS blocks per request on the holder (request i: blocks from i * BLOCKS); the held
    blocks, the reader's blocks for each (from ``local_from`` on), and each hold's params."""
    held = {rid: list(range(i * BLOCKS, (i + 1) * BLOCKS)) for i, rid in enumerate(rids)}
    local = {rid: list(range(local_from + i * BLOCKS, local_from + (i + 1) * BLOCKS)) for i, rid in enumerate(rids)}
    params = {
        rid: holder.client.hold_blocks(
            engine_id="holder", request_id=rid, block_ids=held[rid], num_tokens=NUM_TOKENS
        ).kv_transfer_params
        for rid in rids
    }
    return held, local, params


def held_ids(holder: ShmEngine) -> list[str]:
    return sorted(p.request_id for p in holder.client.lookup_held(engine_id="holder").held)


def wait_takes_pulls(stream: EngineStream, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not stream.takes_pulls:
        assert not stream.closed, f"the engine stream ended before the daemon's ready: {stream.error}"
        assert time.monotonic() < deadline, "the daemon never said it takes pulls on the engine stream"
        time.sleep(0.005)


@contextlib.contextmanager
def pulling_stream(client: KvdClient, engine_id: str = "reader", tp_rank: int = 0) -> Iterator[EngineStream]:
    """An engine stream the daemon takes pulls on (its ready arrived); closed on the way out."""
    stream = client.open_engine_stream(engine_id, tp_rank)
    try:
        wait_takes_pulls(stream)
        yield stream
    finally:
        stream.close()


class Heard:
    """Every message one engine stream's poll returned, in arrival order."""

    def __init__(self, stream: EngineStream) -> None:
        self.stream = stream
        self.messages: list[engine_pb2.DaemonMessage] = []

    def poll(self, timeout_s: float = 0.05) -> None:
        got = self.stream.poll(timeout_s=timeout_s)
        for message in got:
            kind = message.WhichOneof("kind")
            assert kind not in ("ready", "batch"), f"poll returned a {kind} message: {message}"
        self.messages.extend(got)

    def until(self, done: Callable[[], bool], timeout_s: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; heard {self.messages}"
            self.poll()

    def listen(self, seconds: float) -> None:
        """Keep polling for ``seconds`` (long enough for a message that should not come to show)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()

    def of(self, kind: str) -> list[tuple[int, engine_pb2.DaemonMessage]]:
        return [(i, m) for i, m in enumerate(self.messages) if m.WhichOneof("kind") == kind]

    def answers(self) -> dict[int, tuple[int, engine_pb2.PullsStarted]]:
        """Each pulls_started by its seq: where it arrived and the answer (each seq at most once)."""
        out: dict[int, tuple[int, engine_pb2.PullsStarted]] = {}
        for index, message in self.of("pulls_started"):
            seq = message.pulls_started.seq
            assert seq not in out, f"two answers for seq {seq}: {self.messages}"
            out[seq] = (index, message.pulls_started)
        return out

    def finished(self) -> dict[str, tuple[int, str]]:
        """Each finished_recving by request id: where it arrived and its transfer id (once each)."""
        out: dict[str, tuple[int, str]] = {}
        for index, message in self.of("finished_recving"):
            event = message.finished_recving
            assert event.request_id not in out, f"two finished_recving for {event.request_id}: {self.messages}"
            out[event.request_id] = (index, event.transfer_id)
        return out


def pull(
    rid: str, local: list[int], params: common_pb2.KvTransferParams, **fields: object
) -> router_pb2.StartPullRequest:
    return router_pb2.StartPullRequest(request_id=rid, local_block_ids=local, remote=params, **fields)  # type: ignore[arg-type]


def assert_exact(holder: ShmEngine, reader: ShmEngine, held: list[int], local: list[int], rid: str) -> None:
    assert reader.token_bytes(local, NUM_TOKENS).equal(holder.token_bytes(held, NUM_TOKENS)), rid


def assert_untouched(reader: ShmEngine, local: list[int], rid: str) -> None:
    spec = reader.spec
    all_bytes = reader.token_bytes(local, len(local) * spec.block_size)
    assert bool((all_bytes == FILL).all()), f"{rid}: a failed pull wrote the reader's blocks"


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_pulls_on_the_engine_stream_move_exact_bytes_and_a_bad_item_fails_alone(spawn_daemon, transports: str) -> None:
    env = env_of(transports)
    a, b = spawn_daemon(name="a", env=env), spawn_daemon(name="b", env=env)
    spec = small_spec(num_blocks=48)
    with (
        engine_pair(a.unix_target, b.unix_target, spec, seed=21) as (holder, reader),
        pulling_stream(reader.client) as stream,
    ):
        rids = [f"req-{i}" for i in range(7)]
        held, local, params = hold_each(holder, rids)
        bad, other_engine, other_rank = "req-2", "req-4", "req-6"
        pulls = [
            pull("req-0", local["req-0"], params["req-0"]),  # engine_id empty: the stream's rank
            pull("req-1", local["req-1"], params["req-1"], engine_id="reader", tp_rank=0),  # named: its own
            pull(bad, local[bad][:-1], params[bad]),  # one local block too few
            pull("req-3", local["req-3"], params["req-3"]),
            pull(other_engine, local[other_engine], params[other_engine], engine_id="holder"),
            pull("req-5", local["req-5"], params["req-5"], deadline_ms=30_000),
            pull(other_rank, local[other_rank], params[other_rank], engine_id="reader", tp_rank=1),
        ]
        good = ["req-0", "req-1", "req-3", "req-5"]
        seq = stream.send_start_pulls(pulls)
        assert seq > 0

        heard = Heard(stream)
        heard.until(
            lambda: seq in heard.answers() and set(good) <= set(heard.finished()),
            what="the answer and every good pull's finished_recving",
        )
        index, answer = heard.answers()[seq]
        results = pull_results(answer, len(pulls))
        assert type(results[2]) is errors.InvalidArgument and "need 3 local blocks" in results[2].message
        assert type(results[4]) is errors.InvalidArgument and "'holder'" in results[4].message
        assert type(results[6]) is errors.InvalidArgument and "rank 1" in results[6].message
        transfer_ids = {rid: results[rids.index(rid)] for rid in good}
        assert all(isinstance(t, str) and t for t in transfer_ids.values()), results
        assert len(set(transfer_ids.values())) == len(good)

        finished = heard.finished()
        assert {rid: finished[rid][1] for rid in good} == transfer_ids
        assert all(index < finished[rid][0] for rid in good), heard.messages  # the answer came first
        for rid in good:
            status = reader.client.wait_transfer(str(transfer_ids[rid]), timeout_s=30)
            assert status.state == common_pb2.TRANSFER_STATE_DONE, rid
            assert status.request_id == rid and status.engine_id == "reader" and status.tp_rank == 0
            assert_exact(holder, reader, held[rid], local[rid], rid)

        # The bad items changed nothing: their blocks keep their fill, their leases are held.
        for rid in (bad, other_engine, other_rank):
            assert_untouched(reader, local[rid], rid)
        refused = sorted([bad, other_engine, other_rank])
        assert eventually(lambda: held_ids(holder), refused) == refused
        heard.listen(0.3)
        assert not heard.of("load_failed"), heard.messages
        assert not stream.closed and stream.error is None

        # The stream goes on: the same three, right this time, on it.
        retry = [pull(rid, local[rid], params[rid]) for rid in (bad, other_engine, other_rank)]
        seq2 = stream.send_start_pulls(retry)
        assert seq2 > seq
        heard.until(
            lambda: seq2 in heard.answers() and {bad, other_engine, other_rank} <= set(heard.finished()),
            what="the retry's answer and finished_recving",
        )
        index2, answer2 = heard.answers()[seq2]
        retried = pull_results(answer2, len(retry))
        assert all(isinstance(t, str) and t for t in retried), retried
        finished = heard.finished()
        for rid, transfer_id in zip((bad, other_engine, other_rank), retried, strict=True):
            assert finished[rid][1] == transfer_id and index2 < finished[rid][0]
            assert reader.client.wait_transfer(str(transfer_id), timeout_s=30).state == (common_pb2.TRANSFER_STATE_DONE)
            assert_exact(holder, reader, held[rid], local[rid], rid)
        assert eventually(lambda: held_ids(holder), []) == []
        assert sorted(heard.answers()) == [seq, seq2]
        assert not heard.of("load_failed"), heard.messages
        assert not stream.closed and stream.error is None


def test_a_message_over_the_bound_starts_nothing_and_the_stream_goes_on(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with (
        engine_pair(a.unix_target, b.unix_target, spec, seed=22) as (holder, reader),
        pulling_stream(reader.client) as stream,
    ):
        rids = ["req-0", "req-1"]
        held, local, params = hold_each(holder, rids)
        ended_before = dict(holder.client.get_status().holds_ended)

        # 1025 pulls, each one valid on its own: every one fails, none starts.
        over = [pull("req-0", local["req-0"], params["req-0"])] * 1024
        over.append(pull("req-1", local["req-1"], params["req-1"]))
        seq = stream.send_start_pulls(over)
        heard = Heard(stream)
        heard.until(lambda: seq in heard.answers(), what="the answer to 1025 pulls")
        _, answer = heard.answers()[seq]
        results = pull_results(answer, len(over))
        assert all(type(r) is errors.InvalidArgument for r in results), {type(r) for r in results}
        assert all("at most 1024" in r.message for r in results if isinstance(r, errors.KvdError))

        heard.listen(1.0)  # no pull started: no event comes
        assert [m.WhichOneof("kind") for m in heard.messages] == ["pulls_started"], heard.messages
        assert eventually(lambda: held_ids(holder), rids) == rids
        assert dict(holder.client.get_status().holds_ended) == ended_before
        assert reader.client.get_status().transfers_in_flight == 0
        for rid in rids:
            assert_untouched(reader, local[rid], rid)
        assert not stream.closed and stream.error is None

        # The stream is still usable: both pulls, once each, in one message.
        seq2 = stream.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in rids])
        assert seq2 > seq
        heard.until(
            lambda: seq2 in heard.answers() and set(rids) <= set(heard.finished()),
            what="the second message's answer and finished_recving",
        )
        index2, answer2 = heard.answers()[seq2]
        transfer_ids = pull_results(answer2, len(rids))
        finished = heard.finished()
        for rid, transfer_id in zip(rids, transfer_ids, strict=True):
            assert isinstance(transfer_id, str) and finished[rid][1] == transfer_id
            assert index2 < finished[rid][0]
            assert reader.client.wait_transfer(transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
            assert_exact(holder, reader, held[rid], local[rid], rid)
        assert eventually(lambda: held_ids(holder), []) == []


def test_many_messages_of_pulls_back_to_back_each_answered_with_its_seq(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    messages, per_message = 4, 6
    count = messages * per_message
    spec = small_spec(num_blocks=2 * count * BLOCKS + 8)
    with (
        engine_pair(a.unix_target, b.unix_target, spec, seed=23) as (holder, reader),
        pulling_stream(reader.client) as stream,
    ):
        rids = [f"req-{i}" for i in range(count)]
        held, local, params = hold_each(holder, rids, local_from=count * BLOCKS + 8)
        batches = [rids[k * per_message : (k + 1) * per_message] for k in range(messages)]
        seqs = [stream.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in batch]) for batch in batches]
        assert all(s > 0 for s in seqs) and seqs == sorted(set(seqs)), seqs

        heard = Heard(stream)
        heard.until(
            lambda: set(seqs) <= set(heard.answers()) and set(rids) <= set(heard.finished()),
            timeout_s=60,
            what="every answer and every finished_recving",
        )
        answers, finished = heard.answers(), heard.finished()
        assert sorted(answers) == seqs  # each seq answered once, no other
        for seq, batch in zip(seqs, batches, strict=True):
            index, answer = answers[seq]
            transfer_ids = pull_results(answer, len(batch))
            assert all(isinstance(t, str) and t for t in transfer_ids), (seq, transfer_ids)
            for rid, transfer_id in zip(batch, transfer_ids, strict=True):
                assert finished[rid][1] == transfer_id, (seq, rid)
                assert index < finished[rid][0], (seq, rid, heard.messages)
        all_ids = [transfer_id for _, transfer_id in finished.values()]
        assert len(set(all_ids)) == count
        for rid in rids:
            assert_exact(holder, reader, held[rid], local[rid], rid)
        assert reader.untouched_outside([(local[rid], NUM_TOKENS) for rid in rids], FILL)
        assert eventually(lambda: held_ids(holder), []) == []
        heard.listen(0.3)
        assert not heard.of("load_failed"), heard.messages
        assert len(heard.of("finished_recving")) == count
        assert not stream.closed and stream.error is None


def test_an_answer_goes_only_to_the_stream_its_pulls_came_on(spawn_daemon) -> None:
    """A second stream of the rank supersedes the first. Both number their messages from 1: the
    second stream hears only its own answer (its pulls, its count of results), never the first's,
    whether or not the first stream's pulls started before it was superseded."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=24) as (holder, reader):
        first_rids, second_rids = ["one-0", "one-1", "one-2"], ["two-0", "two-1"]
        held, local, params = hold_each(holder, [*first_rids, *second_rids, "two-2"])
        with contextlib.ExitStack() as streams:
            first = streams.enter_context(pulling_stream(reader.client))
            seq1 = first.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in first_rids])
            second = streams.enter_context(pulling_stream(reader.client))
            seq2 = second.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in second_rids])
            assert seq1 == seq2 == 1  # the same seq on both: only the results tell whose answer it is

            heard = Heard(second)
            heard.until(
                lambda: seq2 in heard.answers() and set(second_rids) <= set(heard.finished()),
                what="the second stream's answer and its pulls' finished_recving",
            )
            # Long enough for the first stream's pulls, if they started, to end.
            heard.listen(1.0)
            assert len(heard.of("pulls_started")) == 1, heard.messages
            index, answer = heard.answers()[seq2]
            transfer_ids = pull_results(answer, len(second_rids))  # 2 results: not the first's 3
            finished = heard.finished()
            for rid, transfer_id in zip(second_rids, transfer_ids, strict=True):
                assert isinstance(transfer_id, str) and finished[rid][1] == transfer_id
                assert index < finished[rid][0]
                status = reader.client.wait_transfer(transfer_id, timeout_s=30)
                assert status.state == common_pb2.TRANSFER_STATE_DONE and status.request_id == rid
                assert_exact(holder, reader, held[rid], local[rid], rid)
            assert not second.closed and second.error is None

            # Whatever the first stream heard was its own. (That a superseded stream ends by itself
            # is not asserted here: see test_a_stream_superseded_while_it_writes_ends in
            # tests/unit/daemon/server/test_pull_starts.py.)
            first.close()
            for message in first.poll():
                if message.WhichOneof("kind") == "pulls_started":
                    assert message.pulls_started.seq == seq1 and len(message.pulls_started.results) == 3
            # The second stream still takes pulls, and its pulls still work, after the first ended.
            assert second.takes_pulls
            seq3 = second.send_start_pulls([pull("two-2", local["two-2"], params["two-2"])])
            assert seq3 == seq2 + 1
            heard.until(lambda: seq3 in heard.answers() and "two-2" in heard.finished(), what="a later pull")
            (transfer_id,) = pull_results(heard.answers()[seq3][1], 1)
            assert isinstance(transfer_id, str) and heard.finished()["two-2"][1] == transfer_id
            assert_exact(holder, reader, held["two-2"], local["two-2"], "two-2")
            assert len(heard.of("pulls_started")) == 2


def test_a_stream_opened_with_events_already_queued_still_takes_pulls(spawn_daemon) -> None:
    """Events of a rank are kept until a stream takes them: a pull that ended while the engine had
    no stream open is heard on its next one. That stream must still say it takes pulls, and poll
    must not return the daemon's ready."""
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=25) as (holder, reader):
        held, local, params = hold_each(holder, ["req-0", "req-1"])
        (transfer_id,) = reader.client.start_pulls(
            [pull("req-0", local["req-0"], params["req-0"], engine_id="reader")], timeout_s=30
        )
        assert isinstance(transfer_id, str)
        assert reader.client.wait_transfer(transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE

        with reader.client.open_engine_stream("reader", 0) as stream:
            got: list[engine_pb2.DaemonMessage] = []
            deadline = time.monotonic() + 5
            while not stream.takes_pulls and time.monotonic() < deadline:
                got.extend(stream.poll(timeout_s=0.05))
            got.extend(stream.poll(timeout_s=0.2))
            kinds = [m.WhichOneof("kind") for m in got]
            assert "ready" not in kinds, kinds
            assert stream.takes_pulls, kinds
            assert kinds == ["finished_recving"] and got[0].finished_recving.transfer_id == transfer_id
