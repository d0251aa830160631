"""One engine rank's connection to its node's daemon, kept alive by a background thread.

The engine must never wait on the daemon and must never crash because of it. So:

* every unary call (registration, starting a pull) runs on the link's own thread; the step
  path only queues commands and polls events;
* when the daemon goes away (the stream ends, a call fails UNAVAILABLE) the link reports
  :class:`Disconnected`, then reconnects with capped exponential backoff and *re-registers
  the same memory by itself*, reporting :class:`Connected` with the new incarnation;
* a pull asked for while there is no daemon fails at once (:class:`PullFailed`): the engine
  recomputes instead of waiting.

:class:`SchedulerLink` is the scheduler process's side: blocking ``hold_blocks`` calls with a
short deadline and a circuit breaker, so a dead daemon costs one timeout, not one per request;
and the scheduler stream (soft-hold checks down, heartbeats and releases up), reopened from the
step path (never blocking) after it ends.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kvd_client import errors
from kvd_client.records import as_fields, from_fields, from_message, to_message
from kvd_client.v1.schema import KvTransferParams

logger = logging.getLogger(__name__)

__all__ = [
    "Connected",
    "DaemonLink",
    "DaemonMessage",
    "Disconnected",
    "LinkEvent",
    "PullFailed",
    "PullOrder",
    "PullStarted",
    "SchedulerLink",
]


# --- events the step path polls ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Connected:
    """Registered with a daemon (first time or again); ``incarnation`` names that daemon run.

    ``epoch`` counts connections of this link: work started under an epoch belongs to it.
    """

    incarnation: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Disconnected:
    """The daemon of connection ``epoch`` went away: its leases and in-flight pulls are gone."""

    reason: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PullStarted:
    request_id: str
    transfer_id: str


@dataclasses.dataclass(frozen=True)
class PullFailed:
    request_id: str
    message: str


@dataclasses.dataclass(frozen=True)
class DaemonMessage:
    """A message the daemon sent down the engine stream (a ``kvd.v1.DaemonMessage``)."""

    message: Any


LinkEvent = Connected | Disconnected | PullStarted | PullFailed | DaemonMessage


class _Stream(Protocol):
    def send_commit(self, request_id: str, committed_tokens: int) -> bool: ...
    def send_post_forward(self, step: int, finished_request_ids: Sequence[str] = ()) -> bool: ...
    def poll(self, timeout_s: float = 0.0) -> list[Any]: ...
    @property
    def closed(self) -> bool: ...
    @property
    def error(self) -> errors.KvdError | None: ...
    def close(self) -> None: ...


ClientFactory = Callable[[str, float], Any]


def _default_scheduler_stream(client: Any, engine_id: str) -> Any:
    from kvd_client import SchedulerStream  # noqa: PLC0415 - grpc loads with the first stream, not the import

    return SchedulerStream.over(client.channel, engine_id)


def _default_client(target: str, timeout_s: float) -> Any:
    from kvd_client import KvdClient  # noqa: PLC0415 - grpc loads with the first link, not the import

    return KvdClient(target, timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class PullOrder:
    """One pull of :meth:`DaemonLink.start_pulls`: into which local blocks, from which lease."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote: Mapping[str, Any]
    deadline_ms: int = 0
    local_groups: tuple[tuple[int, ...], ...] = ()  # a hybrid model's other groups' local blocks


@dataclasses.dataclass(frozen=True)
class _StartPulls:
    orders: tuple[PullOrder, ...]


MAX_PULLS_PER_CALL = 1024
"""The daemon's bound on one StartPulls (router.proto): a larger step goes out in several calls."""


@dataclasses.dataclass(frozen=True)
class _Cancel:
    transfer_id: str


_STOP = object()


class DaemonLink:
    """Registration, engine stream and pull starts of one engine rank. Thread-safe sends."""

    def __init__(
        self,
        target: str,
        engine_id: str,
        tp_rank: int,
        *,
        rpc_timeout_s: float = 2.0,
        reconnect_initial_s: float = 0.2,
        reconnect_max_s: float = 5.0,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.target = target
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff0 = reconnect_initial_s
        self._backoff_max = reconnect_max_s
        self._client_factory = client_factory or _default_client
        self._registration: Any = None
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._events: deque[LinkEvent] = deque()
        self._client: Any = None
        self._stream: _Stream | None = None
        self._incarnation = ""
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_refusal = ""
        self._one_by_one = False  # the daemon predates StartPulls (UNIMPLEMENTED): StartPull each
        self.connects = 0

    @property
    def epoch(self) -> int:
        """How many times this link has connected (0: never). Tag work with it."""
        return self.connects

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, registration: Any) -> None:
        """Register ``registration`` (a RegisterKvCacheRequest) now and after every reconnect."""
        self._registration = registration
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvd-link-{self.engine_id}-{self.tp_rank}", daemon=True
            )
            self._thread.start()
        self._kick.set()

    @property
    def connected(self) -> bool:
        stream = self._stream
        return stream is not None and not stream.closed

    @property
    def incarnation(self) -> str:
        return self._incarnation

    def close(self, unregister: bool = True) -> None:
        """Stop the thread, close the stream, and unregister (best effort). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._kick.set()
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout=self._rpc_timeout_s + 2)
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        client, self._client = self._client, None
        if client is not None:
            if unregister and self._registration is not None and self._incarnation:
                try:
                    client.unregister_kv_cache(
                        engine_id=self.engine_id, tp_rank=self.tp_rank, timeout_s=self._rpc_timeout_s
                    )
                except errors.KvdError as err:
                    logger.info("unregistering %s rank %d: %s", self.engine_id, self.tp_rank, err)
            client.close()

    # -- step path (non-blocking) -------------------------------------------------------------

    def send_commit(self, request_id: str, tokens: int) -> bool:
        stream = self._stream
        return stream is not None and stream.send_commit(request_id, tokens)

    def send_post_forward(self, step: int, finished: Sequence[str]) -> bool:
        stream = self._stream
        return stream is not None and stream.send_post_forward(step, finished)

    def start_pull(
        self,
        request_id: str,
        local_block_ids: Sequence[int],
        remote: Mapping[str, Any],
        deadline_ms: int = 0,
        local_groups: Sequence[Sequence[int]] = (),
    ) -> None:
        """Queue a pull; its outcome comes back as PullStarted/PullFailed, then daemon messages."""
        self.start_pulls(
            [
                PullOrder(
                    request_id,
                    tuple(local_block_ids),
                    remote,
                    deadline_ms,
                    tuple(tuple(int(b) for b in ids) for ids in local_groups),
                )
            ]
        )

    def start_pulls(self, orders: Sequence[PullOrder]) -> None:
        """Queue an engine step's pulls, started with one StartPulls call; each pull's outcome
        comes back on its own (PullStarted or PullFailed), exactly as for :meth:`start_pull`."""
        if not orders:
            return
        if not self.connected:
            for order in orders:
                self._events.append(PullFailed(order.request_id, f"kvd daemon at {self.target} is not connected"))
            return
        self._commands.put(
            _StartPulls(
                tuple(
                    dataclasses.replace(
                        order,
                        local_block_ids=tuple(int(b) for b in order.local_block_ids),
                        remote=dict(order.remote),
                        local_groups=tuple(tuple(int(b) for b in ids) for ids in order.local_groups),
                    )
                    for order in orders
                )
            )
        )

    def cancel_pull(self, transfer_id: str) -> None:
        self._commands.put(_Cancel(transfer_id))

    def poll(self) -> list[LinkEvent]:
        """Everything that happened since the last poll, in order. Never blocks."""
        out: list[LinkEvent] = []
        events = self._events
        while events:
            out.append(events.popleft())
        stream = self._stream
        if stream is not None:
            out.extend(DaemonMessage(m) for m in stream.poll())
        return out

    # -- the link thread ----------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._backoff0
        while not self._stop.is_set():
            if not self.connected:
                if self._stream is not None:
                    self._lost(self._describe_stream_end())
                if self._connect():
                    backoff = self._backoff0
                else:
                    self._fail_queued_pulls()
                    self._kick.wait(backoff)
                    self._kick.clear()
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
            try:
                command = self._commands.get(timeout=0.05)
            except queue.Empty:
                continue
            if command is _STOP:
                return
            self._execute(command)

    def _describe_stream_end(self) -> str:
        stream = self._stream
        err = stream.error if stream is not None else None
        return f"engine stream ended: {err.message if err is not None else 'closed by the daemon'}"

    def _lost(self, reason: str) -> None:
        logger.warning("kvd daemon link of %s rank %d lost (%s); reconnecting", self.engine_id, self.tp_rank, reason)
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception:  # closing a dead stream must not kill the link thread
                logger.debug("closing a dead engine stream failed", exc_info=True)
        self._events.append(Disconnected(reason, self.connects))

    def _connect(self) -> bool:
        if self._registration is None:
            return False
        try:
            if self._client is None:
                self._client = self._client_factory(self.target, self._rpc_timeout_s)
            response = self._register()
            stream = self._client.open_engine_stream(self.engine_id, self.tp_rank)
        except (errors.Unavailable, errors.DeadlineExceeded) as err:
            logger.debug("kvd daemon at %s not reachable: %s", self.target, err)
            return False
        except errors.KvdError as err:
            # The daemon answered and refused: an operator must see why (kept retrying, in
            # case the daemon is fixed or upgraded). Logged once per distinct reason.
            reason = f"{type(err).__name__}: {err.message}"
            if reason != self._last_refusal:
                self._last_refusal = reason
                logger.warning(
                    "kvd daemon at %s refused %s rank %d: %s", self.target, self.engine_id, self.tp_rank, reason
                )
            return False
        except Exception:  # the link thread must survive anything a broken daemon does
            logger.exception("connecting to the kvd daemon at %s failed", self.target)
            return False
        self._stream = stream
        self._one_by_one = False  # a new daemon run may be a newer release
        self._incarnation = str(getattr(response, "daemon_incarnation", ""))
        self.connects += 1
        logger.info(
            "%s rank %d registered with kvd daemon %s (incarnation %s)",
            self.engine_id,
            self.tp_rank,
            self.target,
            self._incarnation,
        )
        self._events.append(Connected(self._incarnation, self.connects))
        return True

    def _register(self) -> Any:
        try:
            return self._client.register_kv_cache(request=self._registration, timeout_s=self._rpc_timeout_s)
        except errors.AlreadyExists:
            # A registration of ours from before the stream dropped is still there: replace it.
            self._client.unregister_kv_cache(
                engine_id=self.engine_id, tp_rank=self.tp_rank, timeout_s=self._rpc_timeout_s
            )
            return self._client.register_kv_cache(request=self._registration, timeout_s=self._rpc_timeout_s)

    def _fail_queued_pulls(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is _STOP:
                self._commands.put(_STOP)
                return
            if isinstance(command, _StartPulls):
                for order in command.orders:
                    self._events.append(PullFailed(order.request_id, "kvd daemon not connected"))

    def _execute(self, command: Any) -> None:
        if isinstance(command, _StartPulls):
            orders = command.orders
            for start in range(0, len(orders), MAX_PULLS_PER_CALL):
                self._start_pulls(orders[start : start + MAX_PULLS_PER_CALL])
            return
        try:
            if isinstance(command, _Cancel):
                self._client.cancel_transfer(command.transfer_id, timeout_s=self._rpc_timeout_s)
        except errors.KvdError as err:
            logger.info("cancelling transfer %s: %s", command.transfer_id, err)
            self._lost_if_daemon_gone(err)
        except Exception:  # never let the link thread die
            logger.exception("kvd link command %r failed", command)

    def _start_pulls(self, orders: Sequence[PullOrder]) -> None:
        """One StartPulls for ``orders`` (StartPull each from a daemon that predates it); each
        pull then reports PullStarted or PullFailed, and the link notices a daemon gone."""
        if self._one_by_one:
            for order in orders:
                self._start_one(order)
            return
        try:
            results = self._client.start_pulls(
                [_pull_request(self.engine_id, self.tp_rank, order) for order in orders],
                timeout_s=self._rpc_timeout_s,
            )
        except errors.KvdError as err:
            if err.code is errors.ErrorCode.UNIMPLEMENTED:
                logger.info("kvd daemon at %s predates StartPulls: starting one pull per call", self.target)
                self._one_by_one = True
                for order in orders:
                    self._start_one(order)
                return
            for order in orders:
                self._events.append(PullFailed(order.request_id, f"{type(err).__name__}: {err.message}"))
            self._lost_if_daemon_gone(err)
            return
        except Exception as exc:  # never let the link thread die
            logger.exception("kvd link: starting %d pulls failed", len(orders))
            for order in orders:
                self._events.append(PullFailed(order.request_id, repr(exc)))
            return
        gone: errors.KvdError | None = None
        for order, result in zip(orders, results, strict=True):
            if isinstance(result, errors.KvdError):
                self._events.append(PullFailed(order.request_id, f"{type(result).__name__}: {result.message}"))
                if _daemon_gone(result):
                    gone = result
            else:
                self._events.append(PullStarted(order.request_id, str(result)))
        if gone is not None:
            self._lost_if_daemon_gone(gone)

    def _start_one(self, order: PullOrder) -> None:
        try:
            response = self._client.start_pull(
                request=_pull_request(self.engine_id, self.tp_rank, order), timeout_s=self._rpc_timeout_s
            )
            self._events.append(PullStarted(order.request_id, str(response.transfer_id)))
        except errors.KvdError as err:
            self._events.append(PullFailed(order.request_id, f"{type(err).__name__}: {err.message}"))
            self._lost_if_daemon_gone(err)
        except Exception as exc:  # never let the link thread die
            logger.exception("kvd link: starting pull %s failed", order.request_id)
            self._events.append(PullFailed(order.request_id, repr(exc)))

    def _lost_if_daemon_gone(self, err: errors.KvdError) -> None:
        if _daemon_gone(err):
            self._lost(f"{type(err).__name__}: {err.message}")


def _daemon_gone(err: errors.KvdError) -> bool:
    """Whether ``err`` says this link's daemon is unreachable (a peer's being down is not)."""
    return isinstance(err, errors.Unavailable) and not isinstance(err, errors.PeerUnavailable)


def _pull_request(engine_id: str, tp_rank: int, order: PullOrder) -> Any:
    """The StartPullRequest of ``order`` for this rank."""
    from kvd_client.v1 import router_pb2  # noqa: PLC0415 - protobuf loads with the first pull

    return router_pb2.StartPullRequest(
        engine_id=engine_id,
        tp_rank=tp_rank,
        request_id=order.request_id,
        local_block_ids=order.local_block_ids,
        remote=_transfer_params(order.remote),
        deadline_ms=order.deadline_ms,
        local_group_block_ids=[b for ids in order.local_groups for b in ids],
        local_group_block_counts=[len(ids) for ids in order.local_groups],
    )


def _transfer_params(fields: Mapping[str, Any]) -> Any:
    from kvd_client.v1 import common_pb2  # noqa: PLC0415 - protobuf loads with the first pull

    return to_message(from_fields(KvTransferParams, fields), common_pb2.KvTransferParams)


def held_fields(response: Any) -> dict[str, Any]:
    """The KvTransferParams fields of a HoldBlocksResponse, as plain Python values."""
    return as_fields(from_message(KvTransferParams, response.kv_transfer_params))


class SchedulerLink:
    """Holds blocks for the scheduler process; fails fast while the daemon is known down."""

    def __init__(
        self,
        target: str,
        *,
        rpc_timeout_s: float = 2.0,
        retry_after_s: float = 2.0,
        client_factory: ClientFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream_factory: Callable[[Any, str], Any] | None = None,
    ) -> None:
        self.target = target
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_after_s = retry_after_s
        self._client_factory = client_factory or _default_client
        self._client: Any = None
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._engine_id = ""
        self._stream: Any = None
        self._stream_retry_at = 0.0
        self._stream_lost = False
        self._stream_factory = stream_factory or _default_scheduler_stream
        self.stream_opens = 0

    def available(self) -> bool:
        """False while a recent failure says the daemon is down (no call is made)."""
        return self._clock() >= self._down_until

    def hold_blocks(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        ttl_ms: int = 0,
        group_block_ids: Sequence[Sequence[int]] = (),
        soft: bool = False,
    ) -> dict[str, Any]:
        """The KvTransferParams fields of a new lease; raises a KvdError when it cannot be had."""
        if not self.available():
            raise errors.Unavailable(f"kvd daemon at {self.target} is down (retrying later)")
        with self._lock:
            if self._client is None:
                self._client = self._client_factory(self.target, self._rpc_timeout_s)
            client = self._client
        try:
            fields: dict[str, Any] = {
                "engine_id": engine_id,
                "request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
                "ttl_ms": ttl_ms,
            }
            if soft:
                fields["soft"] = True
            if group_block_ids:  # a hybrid model: every group's blocks
                from kvd_client.v1 import engine_pb2  # noqa: PLC0415 - protobuf loads with the first hold

                fields = {
                    "request": engine_pb2.HoldBlocksRequest(
                        **fields,
                        group_block_ids=[int(b) for ids in group_block_ids for b in ids],
                        group_block_counts=[len(ids) for ids in group_block_ids],
                    )
                }
            response = client.hold_blocks(**fields, timeout_s=self._rpc_timeout_s)
        except (errors.Unavailable, errors.DeadlineExceeded):
            self._down_until = self._clock() + self._retry_after_s
            raise
        return held_fields(response)

    # -- the scheduler stream ------------------------------------------------------------------

    def start_stream(self, engine_id: str) -> None:
        """Open the engine's scheduler stream now (soft holds need it before the first hold)."""
        self._engine_id = engine_id
        self._ensure_stream()

    @property
    def stream_connected(self) -> bool:
        stream = self._stream
        return stream is not None and not stream.closed

    def _ensure_stream(self) -> Any:
        """The open stream, or None; opens one (a non-blocking call) when due."""
        stream = self._stream
        if stream is not None and not stream.closed:
            return stream
        if stream is not None:
            self._stream = None
            self._stream_lost = True
            self._stream_retry_at = self._clock() + self._retry_after_s
            logger.info("kvd scheduler stream of %s ended: %s", self._engine_id, stream.error)
            try:
                stream.close(timeout_s=0.1)
            except Exception:  # a dead stream must not break the step path
                logger.debug("closing a dead scheduler stream failed", exc_info=True)
        if not self._engine_id or self._clock() < self._stream_retry_at:
            return None
        with self._lock:
            if self._client is None:
                self._client = self._client_factory(self.target, self._rpc_timeout_s)
            client = self._client
        try:
            self._stream = self._stream_factory(client, self._engine_id)
        except Exception:  # never let the step path fail on the daemon
            logger.exception("kvd scheduler stream of %s could not open", self._engine_id)
            self._stream_retry_at = self._clock() + self._retry_after_s
            return None
        self.stream_opens += 1
        return self._stream

    def poll_commands(self) -> tuple[list[Any], bool]:
        """The daemon's commands since the last poll, and whether the stream was lost meanwhile
        (then every soft hold and pin of the old stream is void). Never blocks."""
        stream = self._ensure_stream()
        lost, self._stream_lost = self._stream_lost, False
        return (stream.poll() if stream is not None else []), lost

    def send_check_result(self, seq: int, ok: bool, reason: str = "") -> bool:
        stream = self._stream
        return stream is not None and stream.send_check_result(seq, ok, reason)

    def renew(self, leases: Sequence[tuple[str, str]]) -> bool:
        """Heartbeat for ``(holder daemon address, lease id)`` leases (best effort)."""
        stream = self._ensure_stream()
        return stream is not None and stream.send_renew(leases)

    def release(self, leases: Sequence[tuple[str, str]], reason: str) -> bool:
        """Nobody here will read these leases (best effort: unreleased ones expire)."""
        stream = self._ensure_stream()
        return stream is not None and stream.send_release(leases, reason)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        self._engine_id = ""
        if stream is not None:
            stream.close(timeout_s=1.0)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
