"""The engine's long-lived stream to its daemon (sync front end).

An inference engine calls :meth:`EngineStream.send_commit` and
:meth:`EngineStream.send_post_forward` on its per-step critical path, so a send is one
``SimpleQueue.put`` of a tuple (a fraction of a microsecond): the proto message is built later, on
grpc's request thread, and nothing ever waits on the daemon. A background thread reads what the
daemon sends into a deque that :meth:`poll` drains without blocking. When the RPC ends for any
reason, :attr:`closed` turns true and :attr:`error` says why (None after a clean :meth:`close`),
so the engine notices a dead daemon at its next poll.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Final, cast

import grpc

from kvd_client.v1 import engine_pb2, engine_pb2_grpc

from . import errors
from .grpc_errors import to_kvd_error

logger = logging.getLogger(__name__)

COMMIT: Final = 1
POST_FORWARD: Final = 2
CLOSE: Final = object()
"""Queued to end the request stream (a half-close: the daemon then ends its side)."""

CommitItem = tuple[int, str, int]
"""(COMMIT, request_id, committed_tokens)"""
PostForwardItem = tuple[int, int, tuple[str, ...]]
"""(POST_FORWARD, step, finished_request_ids)"""
Item = CommitItem | PostForwardItem

DEFAULT_CLOSE_TIMEOUT_S = 5.0
"""How long close() waits for the daemon to end its side before cancelling the RPC."""


def hello_message(engine_id: str, tp_rank: int) -> engine_pb2.EngineMessage:
    """The first message of every engine stream: who is speaking, and that it reads batches
    (:func:`unpacked` gives the engine one message per event all the same)."""
    return engine_pb2.EngineMessage(
        hello=engine_pb2.EngineHello(engine_id=engine_id, tp_rank=tp_rank, accepts_batches=True)
    )


def unpacked(message: engine_pb2.DaemonMessage) -> Sequence[engine_pb2.DaemonMessage]:
    """The events one daemon message carries, in order: a batch's messages (the events that were
    ready together on the daemon), or the message itself. Callers see one message per event."""
    if message.WhichOneof("kind") == "batch":
        return message.batch.messages
    return (message,)


def to_message(item: Item) -> engine_pb2.EngineMessage | None:
    """The EngineMessage for a queued item; None (logged) when the caller passed bad values.

    A bad value is dropped rather than ending the stream: the stream carries every request's
    commits, and a watermark is caught up by the request's next commit.
    """
    try:
        if item[0] == COMMIT:
            _, request_id, tokens = cast(CommitItem, item)
            return engine_pb2.EngineMessage(commit=engine_pb2.Commit(request_id=request_id, committed_tokens=tokens))
        _, step, finished = cast(PostForwardItem, item)
        return engine_pb2.EngineMessage(post_forward=engine_pb2.PostForward(step=step, finished_request_ids=finished))
    except (TypeError, ValueError) as exc:
        logger.error("dropping engine stream message %r: %s", item, exc)
        return None


def ended_by_daemon(engine_id: str, tp_rank: int) -> errors.KvdError:
    """The error for a stream the daemon ended without being asked (it is shutting down)."""
    return errors.Unavailable(f"the daemon ended the engine stream of {engine_id} rank {tp_rank}")


class EngineStream:
    """One engine rank's bidirectional stream to its daemon, driven by a background thread.

    Use one consumer for :meth:`poll`; sends may come from any thread. Messages sent after the
    stream has ended are dropped and the send returns False.
    """

    def __init__(
        self,
        stub: engine_pb2_grpc.EngineServiceStub,
        engine_id: str,
        tp_rank: int,
        *,
        wait_for_ready: bool = False,
    ) -> None:
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self._outbox: queue.SimpleQueue[Item | object] = queue.SimpleQueue()
        self._inbox: collections.deque[engine_pb2.DaemonMessage] = collections.deque()
        self._arrived = threading.Event()
        self._closing = False
        self._ended = False
        self._error: errors.KvdError | None = None
        self._dropped = 0
        self._call = stub.EngineStream(self._requests(), wait_for_ready=wait_for_ready)
        self._thread = threading.Thread(
            target=self._receive, name=f"kvd-engine-stream-{engine_id}-{tp_rank}", daemon=True
        )
        self._thread.start()

    # -- the engine's side -------------------------------------------------------------------

    def send_commit(self, request_id: str, committed_tokens: int) -> bool:
        """Queue the commit watermark of ``request_id``; False once the stream ended. No wait."""
        if self._ended or self._closing:
            return False
        self._outbox.put((COMMIT, request_id, committed_tokens))
        return True

    def send_post_forward(self, step: int, finished_request_ids: Sequence[str] = ()) -> bool:
        """Queue the post-forward signal of ``step``; False if the stream has ended. Never blocks.

        The ids are copied, so the caller may reuse its list.
        """
        if self._ended or self._closing:
            return False
        self._outbox.put((POST_FORWARD, step, tuple(finished_request_ids)))
        return True

    def poll(self, timeout_s: float = 0.0) -> list[engine_pb2.DaemonMessage]:
        """Drain what the daemon sent. Non-blocking by default; with ``timeout_s`` > 0, waits up to
        that long for a first message (tests, idle loops), returning early if the stream ends."""
        inbox = self._inbox
        if not inbox:
            if timeout_s <= 0 or self._ended:
                return []
            self._arrived.clear()
            if not inbox and not self._ended:
                self._arrived.wait(timeout_s)
            if not inbox:
                return []
        out: list[engine_pb2.DaemonMessage] = []
        try:
            while True:
                out.append(inbox.popleft())
        except IndexError:
            return out

    @property
    def closed(self) -> bool:
        """Whether the RPC is over (closed by us, ended by the daemon, or failed)."""
        return self._ended

    @property
    def error(self) -> errors.KvdError | None:
        """Why the RPC ended, when it was not a clean :meth:`close` (e.g. the daemon died)."""
        return self._error

    @property
    def dropped(self) -> int:
        """How many queued messages were dropped because their values could not be encoded."""
        return self._dropped

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """End the stream cleanly (half-close, then wait for the daemon) and join the thread.

        If the daemon does not end its side within ``timeout_s`` the RPC is cancelled. Idempotent.
        """
        if not self._closing:
            self._closing = True
            self._outbox.put(CLOSE)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "daemon did not end the engine stream of %s rank %d within %.1fs; cancelling",
                self.engine_id,
                self.tp_rank,
                timeout_s,
            )
            self._call.cancel()
            self._thread.join(timeout_s)

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the background side -----------------------------------------------------------------

    def _requests(self) -> Iterator[engine_pb2.EngineMessage]:
        """What grpc's request thread sends: the hello, then each queued item until CLOSE."""
        yield hello_message(self.engine_id, self.tp_rank)
        get = self._outbox.get
        while True:
            item = get()
            if item is CLOSE:
                return
            message = to_message(item)  # type: ignore[arg-type]
            if message is None:
                self._dropped += 1
            else:
                yield message

    def _receive(self) -> None:
        """Thread body: collect the daemon's messages until the RPC ends, then record why."""
        try:
            for message in self._call:
                self._inbox.extend(unpacked(message))
                self._arrived.set()
            if not self._closing:
                self._error = ended_by_daemon(self.engine_id, self.tp_rank)
        except grpc.RpcError as rpc_error:
            code = rpc_error.code() if hasattr(rpc_error, "code") else None
            if not (self._closing and code == grpc.StatusCode.CANCELLED):
                err = to_kvd_error(rpc_error)
                err.__cause__ = rpc_error
                self._error = err
        except Exception as exc:  # a background thread must record what killed it
            logger.exception("engine stream of %s rank %d failed", self.engine_id, self.tp_rank)
            err = errors.Internal(f"engine stream failed: {exc!r}")
            err.__cause__ = exc
            self._error = err
        finally:
            self._ended = True
            self._outbox.put(CLOSE)  # frees grpc's request thread if it waits in get()
            self._arrived.set()
            if self._error is not None:
                logger.warning(
                    "engine stream of %s rank %d ended: %s",
                    self.engine_id,
                    self.tp_rank,
                    self._error,
                )
