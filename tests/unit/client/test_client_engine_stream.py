"""EngineStream (sync): hello first, ordered delivery, non-blocking sends and polls, errors."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from client_fakes import END, FakeDaemon

from kvd_client import EngineStream, KvdClient, errors
from kvd_client.v1 import engine_pb2


def finished_recving(request_id: str) -> engine_pb2.DaemonMessage:
    return engine_pb2.DaemonMessage(finished_recving=engine_pb2.FinishedRecving(request_id=request_id, transfer_id="t"))


def poll_until(stream: EngineStream, count: int, timeout_s: float = 5.0) -> list[engine_pb2.DaemonMessage]:
    """Poll (as an engine loop would) until ``count`` messages came or time ran out."""
    got: list[engine_pb2.DaemonMessage] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(stream.poll(timeout_s=0.05))
    return got


def test_hello_first_then_messages_in_order(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 1)
        for i in range(100):
            assert stream.send_commit(f"r{i % 3}", i)
        assert stream.send_post_forward(7, ["r0", "r1"])
        fake = daemon.engine.wait_stream()
        received = fake.wait_received(102)
        stream.close()

    assert received[0].WhichOneof("kind") == "hello"
    assert (received[0].hello.engine_id, received[0].hello.tp_rank) == ("e0", 1)
    commits = [m.commit for m in received[1:101]]
    assert [c.committed_tokens for c in commits] == list(range(100))
    assert [c.request_id for c in commits] == [f"r{i % 3}" for i in range(100)]
    assert received[101].post_forward.step == 7
    assert list(received[101].post_forward.finished_request_ids) == ["r0", "r1"]
    assert stream.closed and stream.error is None


def test_post_forward_copies_the_callers_list(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        finished = ["a"]
        stream.send_post_forward(1, finished)
        finished.append("b")
        received = daemon.engine.wait_stream().wait_received(2)
        stream.close()
    assert list(received[1].post_forward.finished_request_ids) == ["a"]


def test_poll_is_non_blocking_and_returns_daemon_messages(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.tcp) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        started = time.monotonic()
        assert stream.poll() == []
        assert time.monotonic() - started < 2  # a poll that waited would wait for ever: nothing is sent yet
        fake = daemon.engine.wait_stream()
        for rid in ("a", "b", "c"):
            fake.outbound.put(finished_recving(rid))
        got = poll_until(stream, 3)
        assert [m.finished_recving.request_id for m in got] == ["a", "b", "c"]
        assert stream.poll() == []
        stream.close()


def test_error_surfaces_when_the_daemon_aborts_the_stream(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        fake = daemon.engine.wait_stream()
        fake.outbound.put(finished_recving("last"))
        fake.outbound.put((grpc.StatusCode.UNAVAILABLE, "daemon shutting down"))
        got = poll_until(stream, 1)
        deadline = time.monotonic() + 5
        while not stream.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.finished_recving.request_id for m in got] == ["last"]
        assert stream.closed
        assert isinstance(stream.error, errors.Unavailable)
        assert "shutting down" in str(stream.error)
        assert isinstance(stream.error.__cause__, grpc.RpcError)
        assert stream.send_commit("r", 1) is False
        stream.close()  # still fine after the end


def test_daemon_ending_the_stream_unasked_is_an_error(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e3", 2)
        daemon.engine.wait_stream().outbound.put(END)
        assert stream.poll(timeout_s=5) == []
        deadline = time.monotonic() + 5
        while not stream.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(stream.error, errors.Unavailable)
        assert "e3 rank 2" in str(stream.error)


def test_error_surfaces_when_the_daemon_dies(daemon: FakeDaemon) -> None:
    kvd = KvdClient(daemon.unix)
    stream = kvd.open_engine_stream("e0", 0)
    daemon.engine.wait_stream()
    daemon.server.stop(grace=None)
    deadline = time.monotonic() + 5
    while not stream.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.closed
    assert isinstance(stream.error, errors.KvdError)
    assert stream.send_post_forward(1) is False
    kvd.close()


def test_stream_to_nowhere_fails_unavailable(nowhere: str) -> None:
    with KvdClient(nowhere) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        stream.poll(timeout_s=5)
        stream.close()
        assert isinstance(stream.error, errors.Unavailable)


def test_close_cancels_when_the_daemon_does_not_end_its_side(
    daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    with KvdClient(daemon.tcp) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        fake = daemon.engine.wait_stream()
        # A daemon that ignores half-close: keep its handler from seeing the client's end.
        monkeypatch.setattr(fake.outbound, "put", lambda item: None)
        started = time.monotonic()
        stream.close(timeout_s=0.3)
        assert time.monotonic() - started < 3
        assert stream.closed and stream.error is None


def test_client_close_closes_its_streams(daemon: FakeDaemon) -> None:
    kvd = KvdClient(daemon.unix)
    stream = kvd.open_engine_stream("e0", 0)
    fake = daemon.engine.wait_stream()
    kvd.close()
    assert stream.closed and stream.error is None
    assert fake.client_done.wait(5)


def test_bad_values_are_dropped_not_fatal(daemon: FakeDaemon) -> None:
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        stream.send_commit("r", -1)  # committed_tokens is unsigned
        stream.send_commit("r", 5)
        received = daemon.engine.wait_stream().wait_received(2)
        stream.close()
    assert [m.commit.committed_tokens for m in received[1:]] == [5]
    assert stream.dropped == 1
    assert stream.error is None


def test_sending_never_waits_for_the_daemon(daemon: FakeDaemon) -> None:
    """The engine's step loop pays for a send: it must be a queue put, not a round trip to the
    daemon. So sends complete while the daemon's handler reads none of them (its event loop busy
    elsewhere), and every one arrives, in order, once it reads. (What a send costs is not timed
    here: a bound on a shared CI machine fails on load, not on a regression.)"""
    daemon.engine.reads_held = threading.Event()
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        fake = daemon.engine.wait_stream()
        n = 20_000
        sent: list[bool] = []
        sender = threading.Thread(target=lambda: sent.extend(stream.send_commit("r-1", i) for i in range(n)))
        sender.start()
        sender.join(30)  # (a send that waited for the daemon would hold the sender here)
        assert not sender.is_alive() and len(sent) == n and all(sent)
        assert fake.received == []  # every send returned while the daemon had read none
        daemon.engine.reads_held.set()
        received = fake.wait_received(n + 1, timeout_s=30)
        stream.close()
    assert [m.commit.committed_tokens for m in received[1:]] == list(range(n))


def batch(*messages: engine_pb2.DaemonMessage) -> engine_pb2.DaemonMessage:
    return engine_pb2.DaemonMessage(batch=engine_pb2.DaemonMessageBatch(messages=messages))


def test_the_hello_asks_for_batches_and_a_batch_arrives_as_its_events(daemon: FakeDaemon) -> None:
    """The daemon may send the events that were ready together as one message; poll returns them
    one by one, in order, among single messages, exactly as if each had come alone."""
    with KvdClient(daemon.unix) as kvd:
        stream = kvd.open_engine_stream("e0", 0)
        fake = daemon.engine.wait_stream()
        failed = engine_pb2.DaemonMessage(load_failed=engine_pb2.LoadFailed(request_id="c", error_code="NOT_FOUND"))
        fake.outbound.put(finished_recving("a"))
        fake.outbound.put(batch(finished_recving("b"), failed, finished_recving("d")))
        fake.outbound.put(finished_recving("e"))
        got = poll_until(stream, 5)
        hello = fake.wait_received(1)[0].hello
        stream.close()
    assert hello.accepts_batches
    assert [m.WhichOneof("kind") for m in got] == ["finished_recving"] * 2 + ["load_failed"] + ["finished_recving"] * 2
    assert [getattr(m, m.WhichOneof("kind")).request_id for m in got] == ["a", "b", "c", "d", "e"]
