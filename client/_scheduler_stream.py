"""An engine scheduler's long-lived stream to its daemon (sync front end).

The daemon sends :class:`~kvd_client.v1.engine_pb2.SchedulerCommand` s down (verify and pin a
soft hold's blocks, unpin them, forget a hold); the scheduler answers each check and sends its
reader heartbeats and releases up. Like :class:`~kvd_client.EngineStream`, nothing here ever
waits on the daemon: sends are queue puts, a background thread collects what arrives, and
:meth:`poll` drains it without blocking. The scheduler polls from its step hooks, where it may
touch its block pool.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Iterable, Iterator

import grpc

from kvd_client.v1 import engine_pb2, engine_pb2_grpc

from . import errors
from .grpc_errors import to_kvd_error

logger = logging.getLogger(__name__)

_CLOSE = object()


class SchedulerStream:
    """One engine scheduler's bidirectional stream to its daemon, driven by a background thread."""

    @classmethod
    def over(cls, channel: grpc.Channel, engine_id: str) -> SchedulerStream:
        """Open the stream on ``channel`` (e.g. a :class:`~kvd_client.KvdClient`'s ``channel``)."""
        return cls(engine_pb2_grpc.EngineServiceStub(channel), engine_id)

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, engine_id: str) -> None:
        self.engine_id = engine_id
        self._outbox: queue.SimpleQueue[engine_pb2.SchedulerMessage | object] = queue.SimpleQueue()
        self._inbox: collections.deque[engine_pb2.SchedulerCommand] = collections.deque()
        self._closing = False
        self._ended = False
        self._error: errors.KvdError | None = None
        self._call = stub.SchedulerStream(self._requests())
        self._thread = threading.Thread(target=self._receive, name=f"kvd-scheduler-stream-{engine_id}", daemon=True)
        self._thread.start()

    # -- the scheduler's side -----------------------------------------------------------------

    def _send(self, message: engine_pb2.SchedulerMessage) -> bool:
        if self._ended or self._closing:
            return False
        self._outbox.put(message)
        return True

    def send_check_result(self, seq: int, ok: bool, reason: str = "") -> bool:
        """Answer the daemon's HoldCheck ``seq``."""
        result = engine_pb2.HoldCheckResult(seq=seq, ok=ok, reason=reason[:500])
        return self._send(engine_pb2.SchedulerMessage(check_result=result))

    def send_renew(self, leases: Iterable[tuple[str, str]]) -> bool:
        """Heartbeat: ``(daemon_address, lease_id)`` leases requests of this engine will still read."""
        items = [engine_pb2.RemoteLease(daemon_address=a, lease_id=lease) for a, lease in leases]
        return self._send(engine_pb2.SchedulerMessage(renew=engine_pb2.RenewRemoteLeases(leases=items)))

    def send_release(self, leases: Iterable[tuple[str, str]], reason: str) -> bool:
        """Nobody of this engine will read these ``(daemon_address, lease_id)`` leases."""
        items = [engine_pb2.RemoteLease(daemon_address=a, lease_id=lease) for a, lease in leases]
        release = engine_pb2.ReleaseRemoteLeases(leases=items, reason=reason[:500])
        return self._send(engine_pb2.SchedulerMessage(release=release))

    def poll(self) -> list[engine_pb2.SchedulerCommand]:
        """Drain what the daemon sent (never blocks)."""
        out: list[engine_pb2.SchedulerCommand] = []
        inbox = self._inbox
        while inbox:
            out.append(inbox.popleft())
        return out

    @property
    def closed(self) -> bool:
        return self._ended

    @property
    def error(self) -> errors.KvdError | None:
        return self._error

    def close(self, timeout_s: float = 5.0) -> None:
        """Half-close, wait for the daemon to end its side (else cancel), join the thread. Idempotent."""
        if not self._closing:
            self._closing = True
            self._outbox.put(_CLOSE)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._call.cancel()
            self._thread.join(timeout_s)

    # -- the background side ------------------------------------------------------------------

    def _requests(self) -> Iterator[engine_pb2.SchedulerMessage]:
        yield engine_pb2.SchedulerMessage(hello=engine_pb2.SchedulerHello(engine_id=self.engine_id))
        while True:
            item = self._outbox.get()
            if item is _CLOSE:
                return
            assert isinstance(item, engine_pb2.SchedulerMessage)
            yield item

    def _receive(self) -> None:
        try:
            for command in self._call:
                self._inbox.append(command)
            if not self._closing:
                self._error = errors.Unavailable(f"the daemon ended the scheduler stream of {self.engine_id}")
        except grpc.RpcError as rpc_error:
            code = rpc_error.code() if hasattr(rpc_error, "code") else None
            if not (self._closing and code == grpc.StatusCode.CANCELLED):
                err = to_kvd_error(rpc_error)
                err.__cause__ = rpc_error
                self._error = err
        except Exception as exc:  # a background thread must record what killed it
            logger.exception("scheduler stream of %s failed", self.engine_id)
            self._error = errors.Internal(f"scheduler stream failed: {exc!r}")
        finally:
            self._ended = True
            self._outbox.put(_CLOSE)
