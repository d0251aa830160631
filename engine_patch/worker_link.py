"""One engine rank's connection to its node's daemon, kept alive by a background thread.

The engine must never wait on the daemon and must never crash because of it. So:

* every unary call (registration, starting a pull) runs on the link's own thread; the step
  path only queues commands and polls events (:mod:`kvd_engine.link_events`);
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
* a daemon that takes pulls on the engine stream (it says so first thing) gets them there: one
  stream message per step instead of a StartPulls call (docs/performance.md), answered on the
  stream before any event of those pulls. An answer that does not come (the stream ends, or
  none within the calls' patience) leaves its pulls :class:`PullInDoubt` and the link
  re-registers, exactly as for a StartPulls unanswered.

The scheduler process's side is :class:`kvd_engine.scheduler_link.SchedulerLink`.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvd_client import errors

from . import link_client
from .link_client import START_ATTEMPTS, ClientFactory, NoAnswer, ask_until_answered, daemon_gone, socket_gone
from .link_events import (
    Connected,
    DaemonGone,
    DaemonMessage,
    Disconnected,
    LinkEvent,
    PullFailed,
    PullInDoubt,
    PullOrder,
    PullStarted,
    start_pull_request,
)
from .stream_pulls import StreamPulls

if TYPE_CHECKING:
    from kvd_client import KvdClient
    from kvd_client.v1 import engine_pb2, router_pb2

logger = logging.getLogger(__name__)

__all__ = ["MAX_PULLS_PER_CALL", "START_ATTEMPTS", "DaemonLink"]


class _Stream(Protocol):
    """The engine stream as the link uses it (:class:`kvd_client.EngineStream`, or a test's fake)."""

    def send_commit(self, request_id: str, committed_tokens: int) -> bool: ...
    def send_post_forward(self, step: int, finished_request_ids: Sequence[str] = ()) -> bool: ...
    def poll(self, timeout_s: float = 0.0) -> list[engine_pb2.DaemonMessage]: ...
    # kvd_client.EngineStream also has takes_pulls and send_start_pulls (kvd_engine.stream_pulls);
    # a test's fake without them gets StartPulls.
    @property
    def closed(self) -> bool: ...
    @property
    def error(self) -> errors.KvdError | None: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class _StartPulls:
    orders: tuple[PullOrder, ...]


MAX_PULLS_PER_CALL = 1024
"""The daemon's bound on one StartPulls (router.proto): a larger step goes out in several calls."""


@dataclasses.dataclass(frozen=True)
class _Cancel:
    transfer_id: str


_STOP = object()

_Command = _StartPulls | _Cancel | object
"""What the step path queues for the link thread (or _STOP)."""


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
        self._gone_check = gone_check or (lambda: socket_gone(target))
        self._gone_epoch = 0
        self.tp_rank = tp_rank
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff0 = reconnect_initial_s
        self._backoff_max = reconnect_max_s
        self._client_factory = client_factory or link_client.default_client  # looked up now: tests replace it
        self._registration: engine_pb2.RegisterKvCacheRequest | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._events: deque[LinkEvent] = deque()
        self._client: KvdClient | None = None
        self._stream: _Stream | None = None
        self._incarnation = ""
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_refusal = ""
        self._one_by_one = False  # the daemon predates StartPulls (UNIMPLEMENTED): StartPull each
        self._on_stream = StreamPulls()  # pulls sent on the engine stream, until answered
        self.connects = 0

    @property
    def epoch(self) -> int:
        """How many times this link has connected (0: never). Tag work with it."""
        return self.connects

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, registration: engine_pb2.RegisterKvCacheRequest) -> None:
        """Register ``registration`` now and after every reconnect."""
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
            for message in stream.poll():
                if message.WhichOneof("kind") == "pulls_started":
                    out.extend(self._on_stream.answered(message.pulls_started))
                else:
                    out.append(DaemonMessage(message))
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
                self._give_up_on_overdue_answers()
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
        self._events.extend(self._on_stream.in_doubt(f"the engine stream they were sent on was lost ({reason})"))
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
            client = self._client
            response = self._register(client)
            stream = client.open_engine_stream(self.engine_id, self.tp_rank)
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

    def _register(self, client: KvdClient) -> engine_pb2.RegisterKvCacheResponse:
        try:
            return client.register_kv_cache(request=self._registration, timeout_s=self._rpc_timeout_s)
        except errors.AlreadyExists:
            # A registration of ours from before the stream dropped is still there: replace it.
            client.unregister_kv_cache(engine_id=self.engine_id, tp_rank=self.tp_rank, timeout_s=self._rpc_timeout_s)
            return client.register_kv_cache(request=self._registration, timeout_s=self._rpc_timeout_s)

    def _live_client(self) -> KvdClient:
        """The client of the link thread's calls (None only once :meth:`close` took it)."""
        client = self._client
        if client is None:
            raise RuntimeError("the kvd daemon link is closed")
        return client

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

    def _execute(self, command: _Command) -> None:
        if isinstance(command, _StartPulls):
            orders = command.orders
            for start in range(0, len(orders), MAX_PULLS_PER_CALL):
                self._start_pulls(orders[start : start + MAX_PULLS_PER_CALL])
            return
        if not isinstance(command, _Cancel):
            return
        try:
            self._live_client().cancel_transfer(command.transfer_id, timeout_s=self._rpc_timeout_s)
        except errors.KvdError as err:
            logger.info("cancelling transfer %s: %s", command.transfer_id, err)
            self._lost_if_daemon_gone(err)
        except Exception:  # never let the link thread die
            logger.exception("kvd link command %r failed", command)

    def _give_up_on_overdue_answers(self) -> None:
        """Pulls on the stream unanswered as long as StartPulls' attempts would have waited (the
        daemon's queue for this rank overflowed, or it is stuck): in doubt, and the link
        re-registers to fence them."""
        overdue = self._on_stream.overdue(self._rpc_timeout_s * START_ATTEMPTS)
        if overdue and self._stream is not None:
            self._lost(f"{overdue} pull start(s) on the engine stream unanswered")

    def _start_pulls(self, orders: Sequence[PullOrder]) -> None:
        """One message on the engine stream for ``orders``, or one StartPulls (StartPull each
        from a daemon that predates it); each pull then reports PullStarted, PullFailed or
        PullInDoubt, and the link notices a daemon gone.
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
            requests = [start_pull_request(self.engine_id, self.tp_rank, order) for order in orders]
        except Exception as exc:  # a malformed order: nothing was sent
            logger.exception("kvd link: building %d pulls failed", len(orders))
            for order in orders:
                self._events.append(PullFailed(order.request_id, repr(exc)))
            return
        if not self._one_by_one and self._on_stream.send(self._stream, requests, orders, self.connects):
            return  # answered on the stream (poll), or in doubt once it is lost
        epoch = self.connects  # the registration these pulls write into
        try:
            results = ask_until_answered(lambda: self._send(requests), self._stop, self._backoff0)
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
        except NoAnswer as unknown:
            self._in_doubt(orders, unknown.reason, epoch)
            return
        gone: errors.KvdError | None = None
        for order, result in zip(orders, results, strict=True):
            if isinstance(result, errors.KvdError):
                self._events.append(PullFailed(order.request_id, f"{type(result).__name__}: {result.message}"))
                if daemon_gone(result):
                    gone = result
            else:
                self._events.append(PullStarted(order.request_id, str(result), epoch))
        if gone is not None:
            self._lost_if_daemon_gone(gone)

    def _send(self, requests: Sequence[router_pb2.StartPullRequest]) -> list[str | errors.KvdError]:
        """StartPulls, or StartPull of the one request for a daemon that predates StartPulls (its
        refusal is then the whole call's): each pull's transfer id or per-pull error."""
        if self._one_by_one:
            (request,) = requests
            return [self._live_client().start_pull(request=request, timeout_s=self._rpc_timeout_s).transfer_id]
        return self._live_client().start_pulls(requests, timeout_s=self._rpc_timeout_s)

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
        if daemon_gone(err):
            self._lost(f"{type(err).__name__}: {err.message}")
