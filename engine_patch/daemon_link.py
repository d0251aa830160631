"""One engine rank's connection to its node's daemon, kept alive by a background thread.

The engine must never wait on the daemon and must never crash because of it. So:

* every unary call (registration, starting a pull) runs on the link's own thread; the step
  path only queues commands and polls events;
* when the daemon goes away (the stream ends, a call fails UNAVAILABLE) the link reports
  :class:`Disconnected`, then reconnects with capped exponential backoff and *re-registers
  the same memory by itself*, reporting :class:`Connected` with the new incarnation;
* a pull asked for while there is no daemon fails at once (:class:`PullFailed`): the engine
  recomputes instead of waiting;
* a pull is reported failed (:class:`PullFailed`) only when none of its bytes can land: the
  daemon refused it, or it was never sent. A StartPulls whose answer is lost (a deadline, a
  dropped connection) is asked again, the same orders (idempotent: the daemon answers the
  transfer ids of pulls it already started); still unanswered, its pulls are
  :class:`PullInDoubt` and the link re-registers, which fences every pull of the old
  registration (the daemon cancels them). Every pull event names the connection ``epoch`` its
  StartPulls was sent under, so the worker ends exactly the pulls a re-registration fenced.

:class:`SchedulerLink` is the scheduler process's side: blocking ``hold_blocks`` calls with a
short deadline and a circuit breaker, so a dead daemon costs one timeout, not one per request;
and the scheduler stream (soft-hold checks down, heartbeats and releases up), reopened from the
step path (never blocking) after it ends.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import queue
import socket
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
    "DaemonGone",
    "DaemonLink",
    "DaemonMessage",
    "Disconnected",
    "LinkEvent",
    "PullFailed",
    "PullInDoubt",
    "PullOrder",
    "PullStarted",
    "SchedulerLink",
]


# --- events the step path polls ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Connected:
    """Registered with a daemon (first time or again); ``incarnation`` names that daemon run.

    ``epoch`` counts connections of this link: work started under an epoch belongs to it. A
    registration is made only once the previous one is gone (a new daemon run, the daemon
    dropped it, or the link unregistered it after AlreadyExists): every pull into the memory of
    an older epoch was cancelled and fenced, and every lease of it ended.
    """

    incarnation: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Disconnected:
    """The engine stream of connection ``epoch`` ended. The daemon may still be alive and still
    serving its pulls and leases: they end for sure only at the next :class:`Connected`."""

    reason: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class DaemonGone:
    """Nothing listens on the daemon's socket any more: the daemon of connection ``epoch`` has
    exited (a daemon shutting down keeps its socket until its pulls and leases are over, and one
    that died lost them), so every pull and lease of that connection is over."""

    reason: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PullStarted:
    """The daemon started the pull as ``transfer_id``, under connection ``epoch``."""

    request_id: str
    transfer_id: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PullFailed:
    """The pull did not start (refused, or never sent): none of its bytes can land."""

    request_id: str
    message: str


@dataclasses.dataclass(frozen=True)
class PullInDoubt:
    """StartPulls went out under connection ``epoch`` but no answer came back, even to retries:
    the daemon may be writing. The link re-registers; the pull is over at the next
    :class:`Connected` (that fence cancels it), or when the daemon reports it ended."""

    request_id: str
    message: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class DaemonMessage:
    """A message the daemon sent down the engine stream (a ``kvd.v1.DaemonMessage``)."""

    message: Any


LinkEvent = Connected | Disconnected | DaemonGone | PullStarted | PullFailed | PullInDoubt | DaemonMessage


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

START_ATTEMPTS = 3
"""How many times one StartPulls (StartPull) is asked when no answer comes back. Asking again is
safe (the daemon answers the same transfer id for the same order) and learns the transfer ids
the engine needs to cancel what the daemon started."""

# Codes after which the daemon may have acted on a call although it answered nothing usable.
_IN_DOUBT_CODES = frozenset(
    {
        errors.ErrorCode.DEADLINE_EXCEEDED,
        errors.ErrorCode.UNAVAILABLE,
        errors.ErrorCode.CANCELLED,
        errors.ErrorCode.UNKNOWN,
        errors.ErrorCode.INTERNAL,
    }
)


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
        gone_check: Callable[[], bool] | None = None,
    ) -> None:
        """``gone_check`` tells whether the daemon is known to have exited (default: nothing
        listens on its Unix socket; never for a TCP target)."""
        self.target = target
        self.engine_id = engine_id
        self._gone_check = gone_check or (lambda: _socket_gone(target))
        self._gone_epoch = 0
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
                    self._note_gone()
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

    def _note_gone(self) -> None:
        """After a failed reconnect: report (once per connection) a daemon known to have exited."""
        if self.connects <= self._gone_epoch:
            return
        try:
            gone = self._gone_check()
        except Exception:  # a broken check must not kill the link thread
            logger.debug("checking whether the kvd daemon is gone failed", exc_info=True)
            return
        if gone:
            self._gone_epoch = self.connects
            logger.warning("kvd daemon at %s is gone (nothing listens on its socket)", self.target)
            self._events.append(DaemonGone(f"nothing listens on {self.target}", self.connects))

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
        pull then reports PullStarted, PullFailed or PullInDoubt, and the link notices a daemon gone.
        """
        if self._one_by_one and len(orders) > 1:
            for order in orders:
                self._start_pulls([order])
            return
        if not self.connected:
            # An earlier call of this command lost the link: these were never sent.
            for order in orders:
                self._events.append(PullFailed(order.request_id, "kvd daemon link lost before the pull was sent"))
            return
        try:
            requests = [_pull_request(self.engine_id, self.tp_rank, order) for order in orders]
        except Exception as exc:  # a malformed order: nothing was sent
            logger.exception("kvd link: building %d pulls failed", len(orders))
            for order in orders:
                self._events.append(PullFailed(order.request_id, repr(exc)))
            return
        epoch = self.connects  # the registration these pulls write into
        try:
            results = self._ask(lambda: self._send(requests))
        except errors.KvdError as err:
            if err.code is errors.ErrorCode.UNIMPLEMENTED and not self._one_by_one:
                logger.info("kvd daemon at %s predates StartPulls: starting one pull per call", self.target)
                self._one_by_one = True
                self._start_pulls(orders)
                return
            # The daemon answered the whole call with a refusal: it started none of them.
            for order in orders:
                self._events.append(PullFailed(order.request_id, f"{type(err).__name__}: {err.message}"))
            self._lost_if_daemon_gone(err)
            return
        except _NoAnswer as unknown:
            self._in_doubt(orders, unknown.reason, epoch)
            return
        gone: errors.KvdError | None = None
        for order, result in zip(orders, results, strict=True):
            if isinstance(result, errors.KvdError):
                self._events.append(PullFailed(order.request_id, f"{type(result).__name__}: {result.message}"))
                if _daemon_gone(result):
                    gone = result
            else:
                self._events.append(PullStarted(order.request_id, str(result), epoch))
        if gone is not None:
            self._lost_if_daemon_gone(gone)

    def _send(self, requests: Sequence[Any]) -> list[str | errors.KvdError]:
        """StartPulls, or StartPull of the one request for a daemon that predates StartPulls (its
        refusal is then the whole call's): each pull's transfer id or per-pull error."""
        if self._one_by_one:
            (request,) = requests
            return [self._client.start_pull(request=request, timeout_s=self._rpc_timeout_s).transfer_id]
        return self._client.start_pulls(requests, timeout_s=self._rpc_timeout_s)

    def _ask(self, call: Callable[[], Any]) -> Any:
        """``call`` (a StartPulls or StartPull, idempotent) until the daemon answers.

        Returns the answer; raises the daemon's KvdError when it refused (nothing started), or
        :class:`_NoAnswer` when :data:`START_ATTEMPTS` calls all ended without one (a deadline, a
        dropped connection, an internal error: the daemon may have started the pulls).
        """
        reason = ""
        for attempt in range(START_ATTEMPTS):
            if attempt:
                logger.info("kvd link: no answer to a pull start (%s); asking again", reason)
                if self._stop.wait(self._backoff0 * attempt):
                    break
            try:
                return call()
            except errors.KvdError as err:
                if not _answer_lost(err):
                    raise
                reason = f"{type(err).__name__}: {err.message}"
            except Exception as exc:  # never let the link thread die; the call may have gone out
                logger.exception("kvd link: a pull start failed")
                reason = repr(exc)
        raise _NoAnswer(reason)

    def _in_doubt(self, orders: Sequence[PullOrder], reason: str, epoch: int) -> None:
        """Pulls the daemon may have started under ``epoch`` without telling us: fence them by
        re-registering (the old registration's end cancels every pull into it)."""
        logger.warning(
            "kvd link of %s rank %d: %d pull(s) unanswered (%s); re-registering to fence them",
            self.engine_id,
            self.tp_rank,
            len(orders),
            reason,
        )
        for order in orders:
            self._events.append(PullInDoubt(order.request_id, reason, epoch))
        if self._stream is not None and epoch == self.connects:
            self._lost(f"pull starts unanswered: {reason}")

    def _lost_if_daemon_gone(self, err: errors.KvdError) -> None:
        if _daemon_gone(err):
            self._lost(f"{type(err).__name__}: {err.message}")


class _NoAnswer(Exception):
    """Every attempt of a call ended without the daemon's answer (it may have acted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _answer_lost(err: errors.KvdError) -> bool:
    """Whether ``err`` leaves it unknown what the daemon did (rather than being its refusal)."""
    if isinstance(err, (errors.LeaseExpired, errors.PeerUnavailable)):
        return False  # the daemon's own verdict on the pull, not a lost answer
    return err.code in _IN_DOUBT_CODES


def _socket_gone(target: str) -> bool:
    """Whether nothing listens on ``target``'s Unix socket (False for any other target).

    The daemon removes its socket only after its shutdown released everything, and a dead
    process's listening socket refuses connections: either way no pull of it can still write.
    """
    if not target.startswith("unix:"):
        return False
    path = target[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError as err:
        return err.errno in (errno.ENOENT, errno.ECONNREFUSED)
    finally:
        probe.close()
    return False


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
