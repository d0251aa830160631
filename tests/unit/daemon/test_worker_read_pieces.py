"""A READ larger than the worker's bound is posted in pieces (kvd.worker.nixl_agent).

Over shared memory UCX copies a READ within its post, and the worker's NIXL thread answers no
heartbeat meanwhile: one huge host READ on a busy machine got a working worker killed as hung. So
a READ over ``max_post_bytes`` goes to NIXL in pieces, one after the other, each next piece only
once the previous is DONE, its notification with the last piece alone (the holder ends its hold on
it: it must come after every byte). A fake agent stands in for NIXL and records each post.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np
import pytest

from kvd.dataplane_protocol import XferState
from kvd.worker.nixl_agent import NixlAgent
from kvd.worker.nixl_reads import NixlRead, PostedRead, split_read
from kvd_client.errors import Internal, KvdError, PeerUnavailable

WAIT_S = 10.0
MIB = 1 << 20


class RecordingAgent:
    """NIXL's calls on the owner thread, recorded. ``transfer`` answers from ``post_states``
    ("DONE": copied within the post; "PROC": in flight until ``finish`` lets the piece end)."""

    def __init__(self, post_states: list[str] | None = None, refuse_build_at: int | None = None) -> None:
        self.posts: list[tuple[list[int], list[int], bytes]] = []
        self.post_states = post_states or []
        self.refuse_build_at = refuse_build_at
        self.finished: set[int] = set()  # handles whose piece the test let end
        self.released: list[int] = []
        self.lock = threading.Lock()

    def make_prepped_xfer(self, _op: str, _lt: Any, li: np.ndarray, _rt: Any, ri: np.ndarray, notif: bytes) -> int:
        with self.lock:
            if self.refuse_build_at is not None and len(self.posts) == self.refuse_build_at:
                raise ValueError("cannot build")
            self.posts.append((li.tolist(), ri.tolist(), notif))
            return len(self.posts) - 1

    def transfer(self, handle: int) -> str:
        with self.lock:
            return self.post_states[handle] if handle < len(self.post_states) else "DONE"

    def check_xfer_state(self, handle: int) -> str:
        with self.lock:
            return "DONE" if handle in self.finished else "PROC"

    def finish(self, handle: int) -> None:
        with self.lock:
            self.finished.add(handle)

    def release_xfer_handle(self, handle: int) -> None:
        with self.lock:
            self.released.append(handle)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


class Started:
    """A NixlAgent over a fake, its owner thread running, settled READs collected."""

    def __init__(self, fake: RecordingAgent, max_post_bytes: int) -> None:
        self.agent = NixlAgent("test-pieces", max_post_bytes=max_post_bytes)
        self.agent.agent = fake
        self.settled: concurrent.futures.Future[PostedRead] = concurrent.futures.Future()
        self.agent._on_settled = self.settled.set_result
        self.thread = threading.Thread(target=self.agent._owner.run, name="kvd-nixl-test", daemon=True)
        self.agent._owner.thread = self.thread
        self.thread.start()

    def post(self, read: NixlRead) -> PostedRead | KvdError:
        answered: concurrent.futures.Future[list[PostedRead | KvdError]] = concurrent.futures.Future()
        self.agent.post_reads([read], answered.set_result)
        return answered.result(timeout=WAIT_S)[0]

    def stop(self) -> None:
        self.agent._owner.stopping = True
        self.agent._owner.wake()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def _read(runs: int, nbytes: int, notif: bytes = b"done") -> NixlRead:
    local = np.arange(runs, dtype=np.int32)
    return NixlRead(7, object(), local, object(), local + 100, notif, "peer", nbytes)


@pytest.fixture
def started() -> Any:
    made: list[Started] = []

    def make(fake: RecordingAgent, max_post_bytes: int = 3 * MIB) -> Started:
        made.append(Started(fake, max_post_bytes))
        return made[-1]

    yield make
    for each in made:
        each.stop()


def test_a_read_within_the_bound_is_one_post_with_its_notification(started: Any) -> None:
    fake = RecordingAgent()
    result = started(fake).post(_read(3, 3 * MIB))
    assert isinstance(result, PostedRead) and result.state is XferState.DONE
    assert fake.posts == [([0, 1, 2], [100, 101, 102], b"done")]


def test_a_larger_read_goes_in_pieces_in_order_the_notification_with_the_last(started: Any) -> None:
    """10 runs of 1 MiB, bound 3 MiB: pieces of 3, 3, 3 and 1 runs; every run once, in order; the
    notification only on the last; each piece's handle released; DONE within the post."""
    fake = RecordingAgent()
    result = started(fake).post(_read(10, 10 * MIB))
    assert isinstance(result, PostedRead) and result.state is XferState.DONE and result.error is None
    assert [len(local) for local, _, _ in fake.posts] == [3, 3, 3, 1]
    assert [i for local, _, _ in fake.posts for i in local] == list(range(10))
    assert [i for _, remote, _ in fake.posts for i in remote] == list(range(100, 110))
    assert [notif for _, _, notif in fake.posts] == [b"", b"", b"", b"done"]
    assert fake.released == [0, 1, 2, 3]


def test_the_next_piece_is_posted_only_once_the_previous_is_done(started: Any) -> None:
    """Pieces in flight after their post (TCP): the next piece waits for the previous one's DONE,
    the READ settles once, after its last piece."""
    fake = RecordingAgent(post_states=["PROC", "PROC", "PROC"])
    s = started(fake)
    result = s.post(_read(6, 6 * MIB))
    assert isinstance(result, PostedRead) and result.state is XferState.IN_PROGRESS
    threading.Event().wait(0.05)  # the owner thread polls the first piece meanwhile
    assert len(fake.posts) == 1, "the next piece is posted before the previous is done"
    fake.finish(0)
    _wait_until(lambda: len(fake.posts) == 2)
    assert [notif for _, _, notif in fake.posts] == [b"", b"done"]
    assert not s.settled.done()
    fake.finish(1)
    settled = s.settled.result(timeout=WAIT_S)
    assert settled.xfer_id == 7 and settled.state is XferState.DONE and settled.error is None
    assert [i for local, _, _ in fake.posts for i in local] == list(range(6))
    assert fake.released == [0, 1]


def test_a_later_piece_that_cannot_be_built_ends_the_read_in_error_and_nothing_more_is_posted(started: Any) -> None:
    """The first piece landed; the second cannot be built: the READ is final with an error (its
    answer is not DONE, it settles on the next poll), and no further piece is posted."""
    fake = RecordingAgent(refuse_build_at=1)
    s = started(fake)
    result = s.post(_read(9, 9 * MIB))
    assert isinstance(result, PostedRead) and result.state is XferState.ERROR
    settled = s.settled.result(timeout=WAIT_S)
    assert settled.state is XferState.ERROR and isinstance(settled.error, Internal)
    assert len(fake.posts) == 1 and fake.posts[0][2] == b""


def test_a_first_piece_that_cannot_be_built_refuses_the_read(started: Any) -> None:
    fake = RecordingAgent(refuse_build_at=0)
    result = started(fake).post(_read(9, 9 * MIB))
    assert isinstance(result, Internal)
    assert fake.posts == []


def test_a_piece_that_fails_its_post_ends_the_read_with_no_further_piece(started: Any) -> None:
    """A piece NIXL answers ERR at its post: polled to its end, the READ settles in error, the
    rest (and the notification) never posted."""
    fake = RecordingAgent(post_states=["DONE", "ERR"])
    s = started(fake)
    result = s.post(_read(9, 9 * MIB))
    assert isinstance(result, PostedRead) and isinstance(result.error, PeerUnavailable)
    fake.finish(1)
    s.agent._owner.wake()
    settled = s.settled.result(timeout=WAIT_S)
    assert isinstance(settled.error, PeerUnavailable)
    assert [notif for _, _, notif in fake.posts] == [b"", b""]


@pytest.mark.parametrize(
    ("runs", "nbytes", "bound", "first"),
    [
        (10, 10 * MIB, 3 * MIB, 3),
        (1, 100 * MIB, 3 * MIB, 1),  # one run: cannot be split
        (4, 4 * MIB, 4 * MIB, 4),  # at the bound: whole
        (1000, 1000 * MIB, 3 * MIB, 3),
        (3, 100 * MIB, 1 * MIB, 1),  # runs larger than the bound: one run a piece
    ],
)
def test_split_takes_about_the_bound_and_at_least_one_run(runs: int, nbytes: int, bound: int, first: int) -> None:
    piece, rest = split_read(_read(runs, nbytes), bound)
    assert len(piece.local_indices) == first
    if first == runs:
        assert rest is None and piece.notif == b"done"
    else:
        assert rest is not None and piece.notif == b"" and rest.notif == b"done"
        assert piece.nbytes + rest.nbytes == nbytes
        assert len(rest.local_indices) == runs - first


def _wait_until(condition: Any) -> None:
    deadline = threading.Event()
    for _ in range(int(WAIT_S / 0.005)):
        if condition():
            return
        deadline.wait(0.005)
    raise AssertionError("timed out")
