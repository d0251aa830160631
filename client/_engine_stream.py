# Generated from client/_aio_engine_stream.py by tools/gen_sync.py; do not edit.
"""The engine's long-lived stream to its daemon (sync front end).

An inference engine calls :meth:`EngineStream.send_commit` and
:meth:`EngineStream.send_post_forward` on its per-step critical path, so a send is one
``SimpleQueue.put`` of a tuple (a fraction of a microsecond): the proto message is built later, on
grpc's request thread, and nothing ever waits on the daemon. A background thread reads what the
daemon sends into a deque that :meth:`poll` drains without blocking. When the RPC ends for any
reason, :attr:`closed` turns true and :attr:`error` says why (None after a clean :meth:`close`),
so the engine notices a dead daemon at its next poll.

With ``stream_socket`` (the client passes its daemon's: kvd_client._frames) the stream runs over
the daemon's framed socket, without gRPC, where the daemon serves one (a writer thread of its own
sends what the queue holds); over gRPC otherwise.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvd_client.v1 import engine_pb2, engine_pb2_grpc, router_pb2

from . import errors
from ._background import Background, wait_event
from ._engine_messages import (
    CLOSE,
    COMMIT,
    DEFAULT_CLOSE_TIMEOUT_S,
    POST_FORWARD,
    START_PULLS,
    Item,
    ended_by_daemon,
    hello_message,
    takes_pulls,
    to_message,
    unpacked,
)
from ._frames import FramedCall
from .grpc_errors import to_kvd_error

logger = logging.getLogger(__name__)


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
        stream_socket: str | None = None,
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
        self._takes_pulls = False  # the daemon said so (its ready): pulls may start here
        self._seqs = itertools.count(1)
        self._stub = stub
        self._wait_for_ready = wait_for_ready
        self._stream_socket = stream_socket
        self._call: Any = None  # the framed call or the gRPC call, once connected (in the background)
        self._background = Background(self._receive, f"kvd-engine-stream-{engine_id}-{tp_rank}")

    # -- the engine's side -------------------------------------------------------------------

    def send_commit(self, request_id: str, committed_tokens: int) -> bool:
        """Queue the commit watermark of ``request_id``; False once the stream ended. Never waits."""
        if self._ended or self._closing:
            return False
        self._outbox.put((COMMIT, request_id, committed_tokens))
        return True

    def send_post_forward(self, step: int, finished_request_ids: Sequence[str] = ()) -> bool:
        """Queue the post-forward signal of ``step``; False if the stream has ended. Never waits.

        The ids are copied, so the caller may reuse its list.
        """
        if self._ended or self._closing:
            return False
        self._outbox.put((POST_FORWARD, step, tuple(finished_request_ids)))
        return True

    @property
    def takes_pulls(self) -> bool:
        """Whether the daemon takes pulls on this stream (:meth:`send_start_pulls`): it said so in
        its first message. Until then, and from a daemon that predates it, start pulls with
        StartPulls."""
        return self._takes_pulls and not (self._ended or self._closing)

    def send_start_pulls(self, requests: Sequence[router_pb2.StartPullRequest]) -> int:
        """Queue an engine step's pulls, started as StartPulls would start them; never waits.

        Returns the seq that the daemon's answer carries (a ``pulls_started`` message from
        :meth:`poll`, one result per request, read with :func:`kvd_client.pull_results`, and
        before any event of those pulls), or 0 when nothing was sent: the stream ended, or the
        daemon does not take pulls on it (:attr:`takes_pulls`). The requests are the caller's to
        build and are not copied: do not change them after the call. Their ``engine_id`` is left
        empty or is the stream's.
        """
        if not self.takes_pulls:
            return 0
        seq = next(self._seqs)
        self._outbox.put((START_PULLS, seq, tuple(requests)))
        return seq

    def poll(self, timeout_s: float = 0.0) -> list[engine_pb2.DaemonMessage]:
        """Drain what the daemon sent, without waiting by default; with ``timeout_s`` > 0, wait up to
        that long for a first message (tests, idle loops), returning early if the stream ends."""
        inbox = self._inbox
        if not inbox:
            if timeout_s <= 0 or self._ended:
                return []
            self._arrived.clear()
            if not inbox and not self._ended:
                wait_event(self._arrived, timeout_s)
            if not inbox:
                return []
        out: list[engine_pb2.DaemonMessage] = []
        try:
            while True:
                out.append(inbox.popleft())
        except IndexError:
            return out

    @property
    def framed(self) -> bool:
        """Whether the stream runs over the daemon's framed socket (False: over gRPC, or not yet
        connected)."""
        return isinstance(self._call, FramedCall)

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
        """End the stream cleanly (half-close, then wait for the daemon to end its side and the
        background work to finish); cancel the RPC if the daemon does not end its side within
        ``timeout_s``. Idempotent."""
        if not self._closing:
            self._closing = True
            self._outbox.put(CLOSE)
        if not self._background.join(timeout_s):
            logger.warning(
                "daemon did not end the engine stream of %s rank %d within %.1fs; cancelling",
                self.engine_id,
                self.tp_rank,
                timeout_s,
            )
            if self._call is not None:
                self._call.cancel()
            self._background.join(timeout_s)

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
        """What grpc sends: the hello, then each queued item until CLOSE."""
        yield hello_message(self.engine_id, self.tp_rank)
        while True:
            item = self._outbox.get()
            if item is CLOSE:
                return
            message = to_message(item)  # type: ignore[arg-type]
            if message is None:
                self._dropped += 1
            else:
                yield message

    def _connect(self) -> Any:
        """The daemon's framed socket where it serves one (kvd_client._frames), else the gRPC call."""
        if self._stream_socket:
            framed = FramedCall(self._stream_socket, self._requests())
            try:
                framed.connect()
                return framed
            except OSError as exc:  # an older daemon, or one that serves no framed socket
                logger.debug("engine stream over gRPC: %s: %s", self._stream_socket, exc)
        return self._stub.EngineStream(self._requests(), wait_for_ready=self._wait_for_ready)

    def _receive(self) -> None:
        """Background body: collect the daemon's messages until the RPC ends, then record why."""
        try:
            self._call = self._connect()
            for message in self._call:
                events = unpacked(message)
                if not self._takes_pulls and any(map(takes_pulls, events)):  # the daemon's first word
                    self._takes_pulls = True
                    events = [event for event in events if not takes_pulls(event)]
                self._inbox.extend(events)
                self._arrived.set()
            if not self._closing:
                self._error = ended_by_daemon(self.engine_id, self.tp_rank)
        except grpc.RpcError as rpc_error:
            code = rpc_error.code() if hasattr(rpc_error, "code") else None
            if not (self._closing and code == grpc.StatusCode.CANCELLED):
                err = to_kvd_error(rpc_error)
                err.__cause__ = rpc_error
                self._error = err
        except errors.KvdError as ended:  # how a framed stream ended (its status), or that it broke
            if not (self._closing and isinstance(ended, errors.Cancelled)):
                self._error = ended
        except Exception as exc:  # background work must record what killed it
            logger.exception("engine stream of %s rank %d failed", self.engine_id, self.tp_rank)
            err = errors.Internal(f"engine stream failed: {exc!r}")
            err.__cause__ = exc
            self._error = err
        finally:
            self._ended = True
            self._outbox.put(CLOSE)  # ends the request generator (grpc's request thread may wait in get())
            self._arrived.set()
            if self._error is not None:
                logger.warning(
                    "engine stream of %s rank %d ended: %s",
                    self.engine_id,
                    self.tp_rank,
                    self._error,
                )
