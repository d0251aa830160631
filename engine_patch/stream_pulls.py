"""An engine step's pulls started on the engine stream, and the book of those awaiting an answer.

A daemon that takes pulls on the engine stream (it says so in its first message) gets a step's
pulls as one stream message instead of a StartPulls call: the engine's hop then costs one stream
message each way, not a unary call (docs/performance.md). The daemon answers on the same stream
before any event of those pulls, so an answer is always read before the pulls' FinishedRecving.

The link thread sends (:meth:`StreamPulls.send`); the engine's step thread reads the answers
(:meth:`StreamPulls.answered`, from the link's poll); the link thread gives up on answers that do
not come (:meth:`StreamPulls.in_doubt`: the stream lost, or an answer overdue), and then
re-registers, which fences every pull of the old registration. Whichever of the two threads
takes a seq first decides its pulls' events; a lock makes that one decision.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvd_client import errors

from .link_events import LinkEvent, PullFailed, PullInDoubt, PullOrder, PullStarted

if TYPE_CHECKING:
    from kvd_client.v1 import engine_pb2, router_pb2

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Unanswered:
    """Pulls sent on the engine stream under connection ``epoch``, not answered yet."""

    orders: tuple[PullOrder, ...]
    epoch: int
    sent_at: float


class StreamPulls:
    """The pulls a link sent on its engine stream, by seq, until answered or given up on."""

    def __init__(self) -> None:
        self._unanswered: dict[int, _Unanswered] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._unanswered)

    def send(
        self,
        stream: Any,
        requests: Sequence[router_pb2.StartPullRequest],
        orders: Sequence[PullOrder],
        epoch: int,
    ) -> bool:
        """Start ``orders`` with one message on ``stream`` if its daemon takes pulls there; False
        when it does not (nothing was sent: start them with StartPulls). A test's fake stream
        without ``takes_pulls`` never does."""
        if stream is None or not getattr(stream, "takes_pulls", False):
            return False
        with self._lock:  # the answer's reader finds the entry, however fast the answer comes
            seq = stream.send_start_pulls(requests)
            if seq:
                self._unanswered[seq] = _Unanswered(tuple(orders), epoch, time.monotonic())
        return bool(seq)

    def answered(self, answer: engine_pb2.PullsStarted) -> list[LinkEvent]:
        """Each pull's event of a stream's answer: PullStarted or PullFailed (none if the link
        gave up on it already: those pulls are in doubt, and the re-registration fences them)."""
        from kvd_client import pull_results  # noqa: PLC0415 - grpc loads with the first link

        with self._lock:
            sent = self._unanswered.pop(answer.seq, None)
        if sent is None:
            logger.debug("kvd link: an answer to pull starts %d no longer awaited", answer.seq)
            return []
        try:
            results = pull_results(answer, len(sent.orders))
        except errors.KvdError as err:  # a broken answer: nothing in it can be trusted
            return [PullInDoubt(order.request_id, err.message, sent.epoch) for order in sent.orders]
        return [
            PullFailed(order.request_id, f"{type(result).__name__}: {result.message}")
            if isinstance(result, errors.KvdError)
            else PullStarted(order.request_id, result, sent.epoch)
            for order, result in zip(sent.orders, results, strict=True)
        ]

    def overdue(self, patience_s: float) -> int:
        """How many sends have waited longer than ``patience_s`` for their answer."""
        if not self._unanswered:
            return 0
        oldest = time.monotonic() - patience_s
        with self._lock:
            return sum(1 for sent in self._unanswered.values() if sent.sent_at < oldest)

    def in_doubt(self, reason: str) -> list[LinkEvent]:
        """Every pull still awaiting an answer, now :class:`PullInDoubt` (the link re-registers)."""
        with self._lock:
            unanswered, self._unanswered = self._unanswered, {}
        return [
            PullInDoubt(order.request_id, reason, sent.epoch) for sent in unanswered.values() for order in sent.orders
        ]
