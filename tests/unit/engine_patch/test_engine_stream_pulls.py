"""A step's pulls on the engine stream (a daemon that takes them there), against a fake daemon:
one stream message per step, each pull's answer on its own, and an answer that never comes
fenced exactly as an unanswered StartPulls is."""

from __future__ import annotations

from typing import Any

import pytest
import test_engine_worker
from engine_fakes import FakeDaemon, wait_until
from test_engine_worker import _pull, _step, _worker

from kvd_client import errors
from kvd_client.v1 import engine_pb2
from kvd_engine.link_events import PullInDoubt, PullOrder, PullStarted
from kvd_engine.metadata import KvdConnectorMetadata
from kvd_engine.stream_pulls import StreamPulls

caches = test_engine_worker.caches  # the worker tests' fixture: their cache tensors in shm


@pytest.fixture
def daemon() -> FakeDaemon:
    fake = FakeDaemon()
    fake.stream_pulls = True
    return fake


def test_a_step_s_loads_go_in_one_stream_message_and_a_bad_one_fails_alone(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    daemon.pull_item_errors["r2"] = errors.UnknownLease("no lease L-r2")
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,)), _pull("r2", (4,)), _pull("r3", (5,))]))
    assert wait_until(lambda: len(daemon.pulls) == 2)
    assert daemon.stream_batches == [["r1", "r2", "r3"]] and daemon.batches == []  # no StartPulls call
    failed: set[str] = set()
    assert wait_until(lambda: failed.update(_step(worker).failed_recving) or failed == {"r2"}, timeout_s=2)
    assert worker.get_block_ids_with_load_errors() == {4}
    started = {rid: p.transfer_id for rid, p in worker._pulls.items()}
    assert started == {p.request_id: p.transfer_id for p in daemon.pulls}
    for fake in list(daemon.pulls):
        daemon.finish_pull(fake)
    done: set[str] = set()
    assert wait_until(lambda: done.update(_step(worker).finished_recving) or done == {"r1", "r3"}, timeout_s=2)
    assert worker.link.connected and worker.link.epoch == 1


def test_a_daemon_that_does_not_take_pulls_on_the_stream_gets_start_pulls(caches: Any) -> None:
    daemon = FakeDaemon()  # an older daemon: no ready on its stream
    worker = _worker(daemon, caches)
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,)), _pull("r2", (4,))]))
    assert wait_until(lambda: len(daemon.pulls) == 2)
    assert daemon.batches == [["r1", "r2"]] and daemon.stream_batches == []


def test_pulls_whose_stream_is_lost_before_the_answer_fail_only_after_the_re_registration(
    daemon: FakeDaemon, caches: Any
) -> None:
    """The daemon may have started them: reported failed only once the re-registration fenced
    them (the daemon's transfers can no longer write), never before."""
    worker = _worker(daemon, caches)
    daemon.stream_answers_lost = 1
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3, 4))]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    daemon.stream("eng").kill(errors.Unavailable("stream reset"))
    failed: set[str] = set()

    def settled() -> bool:
        failed.update(_step(worker).failed_recving)
        if failed:
            assert all(p.done for p in daemon.pulls)  # fenced before reported
        return failed == {"r1"}

    assert wait_until(settled, timeout_s=5)
    assert worker.link.epoch == 2 and daemon.register_calls == 2
    assert worker.get_block_ids_with_load_errors() == {3, 4}


def test_an_answer_that_never_comes_re_registers_and_fences_its_pulls(daemon: FakeDaemon, caches: Any) -> None:
    """The stream stays up but the answer is lost (the rank's queue overflowed): after as long
    as StartPulls' attempts would take, the pulls are in doubt and the link re-registers."""
    from kvd_engine.worker_link import START_ATTEMPTS, DaemonLink

    worker = _worker(daemon, caches)
    link: DaemonLink = worker.link
    link._rpc_timeout_s = 0.1  # patience: START_ATTEMPTS x 0.1 s
    daemon.stream_answers_lost = 1
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,))]))
    failed: set[str] = set()
    assert wait_until(lambda: failed.update(_step(worker).failed_recving) or failed == {"r1"}, timeout_s=5)
    assert all(p.done for p in daemon.pulls) and link.epoch == 2
    assert START_ATTEMPTS * link._rpc_timeout_s < 5


def _orders(*rids: str) -> list[PullOrder]:
    return [PullOrder(rid, (1,), {"lease_id": "L"}) for rid in rids]


class _Stream:
    takes_pulls = True

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_start_pulls(self, requests: Any) -> int:
        self.sent.append(requests)
        return len(self.sent)


def _answer(seq: int, *results: str | errors.KvdError) -> engine_pb2.PullsStarted:
    answer = engine_pb2.PullsStarted(seq=seq)
    for result in results:
        if isinstance(result, errors.KvdError):
            answer.results.add(
                error_code=result.code.name, error_message=result.message, error_class=type(result).__name__
            )
        else:
            answer.results.add(transfer_id=result)
    return answer


def test_an_answer_after_the_link_gave_up_on_it_is_ignored() -> None:
    """Whichever comes first decides: once in doubt, a late answer must not start the pulls
    again in the engine's eyes (the re-registration fenced them)."""
    book, stream = StreamPulls(), _Stream()
    assert book.send(stream, ["q"], _orders("r1"), epoch=3)
    assert [type(e) for e in book.in_doubt("lost")] == [PullInDoubt]
    assert book.answered(_answer(1, "t1")) == [] and len(book) == 0


def test_an_answer_with_the_wrong_count_puts_every_pull_in_doubt() -> None:
    book, stream = StreamPulls(), _Stream()
    assert book.send(stream, ["q", "q"], _orders("r1", "r2"), epoch=1)
    events = book.answered(_answer(1, "t1"))
    assert [type(e) for e in events] == [PullInDoubt, PullInDoubt] and all(e.epoch == 1 for e in events)


def test_each_answer_keeps_its_pulls_epoch_and_exact_error() -> None:
    book, stream = StreamPulls(), _Stream()
    book.send(stream, ["q", "q"], _orders("r1", "r2"), epoch=2)
    started, failed = book.answered(_answer(1, "t1", errors.LeaseExpired("lease L expired")))
    assert started == PullStarted("r1", "t1", 2)
    assert failed.request_id == "r2" and failed.message == "LeaseExpired: lease L expired"


def test_a_stream_that_does_not_take_pulls_is_not_sent_to() -> None:
    book = StreamPulls()
    stream = _Stream()
    stream.takes_pulls = False  # type: ignore[misc]
    assert not book.send(stream, ["q"], _orders("r1"), epoch=1) and not stream.sent
    assert not book.send(None, ["q"], _orders("r1"), epoch=1)
    assert not book.send(object(), ["q"], _orders("r1"), epoch=1)  # a fake without the attribute
