"""The worker's NIXL thread answers heartbeats between the READs of one batch (kvd.worker.nixl_agent).

Over shared memory UCX copies a READ within its post, so a batch of large READs keeps the owner
thread inside NIXL for as long as the copies take. The control process's heartbeat must still be
answered between them, or a working worker on a busy machine is killed as hung; a thread stuck in
one NIXL call must still answer nothing. A fake agent stands in for NIXL: its ``transfer`` blocks
until the test lets it go, as a long copy would.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import numpy as np

from kvd.worker.nixl_agent import NixlAgent, NixlRead, PostedRead

WAIT_S = 10.0


class BlockingAgent:
    """The NIXL calls the owner thread makes, each ``transfer`` held until released."""

    def __init__(self) -> None:
        self.posting = threading.Semaphore(0)  # released by the fake when a transfer starts
        self.go = threading.Semaphore(0)  # released by the test to let one transfer finish
        self.transfers_done = 0

    def make_prepped_xfer(self, *_args: Any) -> object:
        return object()

    def transfer(self, _handle: object) -> str:
        self.posting.release()
        assert self.go.acquire(timeout=WAIT_S)
        self.transfers_done += 1
        return "DONE"  # copied within the post, as over shared memory

    def release_xfer_handle(self, _handle: object) -> None:
        pass

    def check_xfer_state(self, _handle: object) -> str:
        return "DONE"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


def _read(xfer_id: int) -> NixlRead:
    indices = np.arange(1, dtype=np.int32)
    return NixlRead(xfer_id, object(), indices, object(), indices, b"", "peer", 1 << 27)


def _started(fake: BlockingAgent) -> tuple[NixlAgent, threading.Thread]:
    agent = NixlAgent("test-heartbeats")
    agent.agent = fake
    thread = threading.Thread(target=agent._owner.run, name="kvd-nixl-test", daemon=True)
    agent._owner.thread = thread
    thread.start()
    return agent, thread


def _stop(agent: NixlAgent, thread: threading.Thread) -> None:
    agent._owner.stopping = True
    agent._owner.wake()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_heartbeat_is_answered_between_the_reads_of_one_batch() -> None:
    fake = BlockingAgent()
    agent, thread = _started(fake)
    answered: concurrent.futures.Future[list[PostedRead | Exception]] = concurrent.futures.Future()
    try:
        agent.post_reads([_read(1), _read(2), _read(3)], answered.set_result)
        assert fake.posting.acquire(timeout=WAIT_S)  # the first READ is being copied
        heartbeat = agent.submit(lambda: fake.transfers_done, activity=False)
        time.sleep(0.05)
        assert not heartbeat.done(), "a thread inside one NIXL call answers nothing"
        fake.go.release()  # the first copy ends: the heartbeat is answered before the second
        assert heartbeat.result(timeout=WAIT_S) == 1
        assert fake.posting.acquire(timeout=WAIT_S)
        fake.go.release()
        assert fake.posting.acquire(timeout=WAIT_S)
        assert not answered.done()
        fake.go.release()
        results = answered.result(timeout=WAIT_S)
        assert [r.xfer_id for r in results if isinstance(r, PostedRead)] == [1, 2, 3]
    finally:
        for _ in range(3):
            fake.go.release()
        _stop(agent, thread)


def test_a_heartbeat_is_answered_between_the_pieces_of_one_large_read() -> None:
    """One READ over the bound goes to NIXL in pieces: a heartbeat waits for the piece being copied
    only, not for the whole READ."""
    fake = BlockingAgent()
    agent, thread = _started(fake)
    agent._max_post_bytes = 1 << 26
    indices = np.arange(3, dtype=np.int32)
    answered: concurrent.futures.Future[list[PostedRead | Exception]] = concurrent.futures.Future()
    try:
        agent.post_reads(
            [NixlRead(1, object(), indices, object(), indices, b"n", "peer", 3 << 26)], answered.set_result
        )
        assert fake.posting.acquire(timeout=WAIT_S)  # the first piece is being copied
        heartbeat = agent.submit(lambda: fake.transfers_done, activity=False)
        fake.go.release()
        assert heartbeat.result(timeout=WAIT_S) == 1, "answered only after the whole READ"
        for _ in range(2):
            assert fake.posting.acquire(timeout=WAIT_S)
            fake.go.release()
        (result,) = answered.result(timeout=WAIT_S)
        assert isinstance(result, PostedRead) and fake.transfers_done == 3
    finally:
        for _ in range(3):
            fake.go.release()
        _stop(agent, thread)


def test_a_heartbeat_is_answered_between_commands() -> None:
    """Queued behind a long command, a heartbeat is answered before the next command runs."""
    fake = BlockingAgent()
    agent, thread = _started(fake)
    order: list[str] = []
    running, gate = threading.Event(), threading.Event()
    try:
        first = agent.submit(lambda: (running.set(), gate.wait(WAIT_S), order.append("first")))
        assert running.wait(WAIT_S)
        second = agent.submit(lambda: order.append("second"))
        heartbeat = agent.submit(lambda: order.append("heartbeat"), activity=False)
        gate.set()
        for future in (first, second, heartbeat):
            future.result(timeout=WAIT_S)
        assert order == ["first", "heartbeat", "second"]
    finally:
        _stop(agent, thread)
