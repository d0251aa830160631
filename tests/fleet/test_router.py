"""The fleet router learns how every pull it started ended, even when StartPull got no answer.

Issue 42: a fleet run on a busy machine ended with a daemon that counted two pulls DONE (and
their bytes) that the router never saw. Its StartPull had run out of time (3 s, on two cores at
load 8-14) after the daemon had started the pull; the router took that as a failure, released the
lease, recomputed the blocks, and the pull went on to DONE unwatched. The daemon keeps its
contract (the same pull asked again is answered with the pull already started, running or DONE);
the router broke its side: an unanswered StartPull is not a refusal. No daemon here: a fake
router client plays the daemon's side of that contract.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from fleet import router as router_module
from fleet.router import EngineRef, Held, Router
from kvd_client import errors
from kvd_client.channel import TlsConfig
from kvd_client.v1 import common_pb2, router_pb2

NBYTES = 163840


class FakeDaemon:
    """A reader daemon's router API: StartPull idempotent for the same pull, GetTransfer, and
    WaitTransfer; ``lose_answers`` StartPull answers are lost after the pull started (the caller
    sees ``lost_as``), ``refuse`` StartPulls are refused before anything starts."""

    def __init__(self, lose_answers: int = 0, lost_as: errors.KvdError | None = None) -> None:
        self.lose_answers = lose_answers
        self.lost_as = lost_as or errors.DeadlineExceeded("Deadline Exceeded")
        self.refuse: list[errors.KvdError] = []
        self.started: dict[tuple[Any, ...], str] = {}  # the pull -> its transfer id
        self.calls = 0
        self.done: list[str] = []  # what the daemon counts DONE

    async def start_pull(self, **pull: Any) -> router_pb2.StartPullResponse:
        self.calls += 1
        if self.refuse:
            raise self.refuse.pop(0)
        key = (pull["engine_id"], pull["tp_rank"], pull["request_id"], tuple(pull["local_block_ids"]))
        transfer_id = self.started.get(key)
        if transfer_id is None:
            transfer_id = self.started[key] = f"t{len(self.started)}"
            self.done.append(transfer_id)  # it runs to DONE whether or not anyone watches
        if self.lose_answers:
            self.lose_answers -= 1
            raise self.lost_as
        return router_pb2.StartPullResponse(transfer_id=transfer_id)

    def _status(self, transfer_id: str) -> common_pb2.TransferStatus:
        if transfer_id not in self.done:
            raise errors.UnknownTransfer(transfer_id)
        return common_pb2.TransferStatus(transfer_id=transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes=NBYTES)

    async def wait_transfer(self, transfer_id: str, timeout_s: float | None = None) -> common_pb2.TransferStatus:
        return self._status(transfer_id)

    async def get_transfer(self, transfer_id: str, timeout_s: float | None = None) -> common_pb2.TransferStatus:
        return self._status(transfer_id)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_module, "UNANSWERED_RETRY_S", 0.001, raising=False)


def make_router(daemon: FakeDaemon, epochs: list[int]) -> tuple[Router, Held, EngineRef]:
    router = Router(
        [], ["10.0.0.1:1", "10.0.0.2:1"], TlsConfig(), lambda node: epochs[node], random.Random(1), 4.0, 6.0
    )
    router.clients = [daemon, daemon]  # type: ignore[list-item]
    holder = EngineRef("n0e0-p", 0, "prefill", 1, Path("/nonexistent"))
    reader = EngineRef("n1e0-d", 1, "decode", 1, Path("/nonexistent"))
    params = common_pb2.KvTransferParams(daemon_address="10.0.0.1:1", lease_id="lease-1", block_ids=[1, 2])
    return router, Held(holder, params, [], 40), reader


@pytest.mark.parametrize(
    "lost_as",
    [errors.DeadlineExceeded("Deadline Exceeded"), errors.Unavailable("Socket closed")],
    ids=["DeadlineExceeded", "Unavailable"],
)
def test_a_pull_whose_start_pull_answer_was_lost_is_seen_done(lost_as: errors.KvdError) -> None:
    """The daemon started the pull and counts it DONE; the router, whose StartPull saw no answer
    (twice), asks again, learns the transfer, and counts it DONE with its bytes, under the daemon's
    incarnation: the metrics check agrees."""
    daemon = FakeDaemon(lose_answers=2, lost_as=lost_as)
    router, held, reader = make_router(daemon, [1, 1])

    rank, failure = asyncio.run(router._pull("c1t1", held, reader, 0, [5, 6]))

    assert (rank, failure) == (0, None)
    assert daemon.calls == 3 and len(daemon.done) == 1  # one pull, asked three times
    tally = router.tally
    assert tally.pulls_started == tally.pulls_done == 1 and tally.pulls_failed == 0
    assert tally.done_by_epoch[(1, 1)] == len(daemon.done) and tally.bytes_by_epoch[(1, 1)] == NBYTES
    assert tally.failure_ops == {f"start_pull:{type(lost_as).__name__}": 2}
    assert not tally.undocumented


def test_a_refused_start_pull_is_not_asked_again() -> None:
    """An answer is an answer: a refusal (here the lease is gone) fails the pull at once."""
    daemon = FakeDaemon()
    daemon.refuse.append(errors.UnknownLease("no lease 'lease-1'"))
    router, held, reader = make_router(daemon, [1, 1])

    assert asyncio.run(router._pull("c1t1", held, reader, 0, [5, 6])) == (0, "UnknownLease")
    assert daemon.calls == 1 and router.tally.pulls_started == 0


def test_an_unanswered_start_pull_of_a_daemon_that_restarted_is_retried_as_unavailable() -> None:
    """The reader's daemon was restarted while its StartPull went unanswered: whatever it started
    went with it (and with its counters); the move retries on the new daemon."""
    epochs = [1, 1]
    daemon = FakeDaemon()

    async def restart_while_unanswered(**pull: Any) -> router_pb2.StartPullResponse:
        epochs[1] = 2
        raise errors.Unavailable("Connection refused")

    daemon.start_pull = restart_while_unanswered  # type: ignore[method-assign]
    router, held, reader = make_router(daemon, epochs)

    assert asyncio.run(router._pull("c1t1", held, reader, 0, [5, 6])) == (0, "Unavailable")
    assert router.tally.pulls_started == 0 and not router.tally.undocumented


def test_a_start_pull_never_answered_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that does not answer StartPull for the pull's deadline plus the lost bound,
    without being restarted: the router cannot know the pull's outcome, and says so (lost)."""
    monkeypatch.setattr(router_module, "LOST_AFTER_S", 0.0, raising=False)
    daemon = FakeDaemon(lose_answers=10**9)
    router, held, reader = make_router(daemon, [1, 1])
    router.deadline_s = 0.01

    assert asyncio.run(router._pull("c1t1", held, reader, 0, [5, 6])) == (0, "Lost")
    assert router.tally.pulls_lost == 1 and router.tally.undocumented[0].startswith("LOST: StartPull")
