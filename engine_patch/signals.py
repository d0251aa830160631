"""Ordering and batching of what an engine rank tells its daemon after each step.

After step N the daemon may serve step N's KV only when (1) its writes have landed in
memory and (2) the draft proposer has finished (vLLM's ``wait_for_save`` under deferred
finalize). The engine's critical path must not wait for (1), so :class:`StepSignaler` queues
the step's signal behind a CUDA event recorded at ``wait_for_save`` and sends, strictly in
step order, the step's commits and then ``post_forward(N, finished_request_ids)``.

Commits are watermarks, so only the latest value per request matters. A gRPC stream carries
a few thousand messages a second, and a decode step moves every running request's
watermark: sending each of them every step would saturate it. So the signaler keeps only the
latest step's watermarks (a reference into that step's async host copy: no per-request work
until it is needed) and sends

* at once, the exact final count of each request that finished (the ones the daemon may be
  asked to serve: finished requests are the ones held for readers),
* for the running ones, one ``1/commit_every_steps`` slice of them per step, so each grown
  watermark leaves at least every ``commit_every_steps`` steps and no step pays for all of
  them; all of them again after a reconnect.

On CPU the event is trivially complete and everything goes out inline. On GPU a background
thread waits on the oldest event (blocking only itself) so an idle engine's last signals still
leave; the step path only polls.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from .hostcopy import AsyncHostCopy

logger = logging.getLogger(__name__)

__all__ = ["StepSignal", "StepSignaler"]

SendCommit = Callable[[str, int], bool]
SendPostForward = Callable[[int, Sequence[str]], bool]


@dataclasses.dataclass
class StepSignal:
    """Everything one step tells the daemon."""

    step: int
    commits: Mapping[str, int] = dataclasses.field(default_factory=dict)  # exact host watermarks
    device_request_ids: Sequence[str] = ()
    device_marks: AsyncHostCopy | None = None  # watermarks of device_request_ids, in flight
    finished: tuple[str, ...] = ()
    final: Mapping[str, int] = dataclasses.field(default_factory=dict)  # finished requests' exact counts
    event: torch.cuda.Event | None = None  # the step's KV writes are done when it completes

    def ready(self) -> bool:
        if self.event is not None and not self.event.query():
            return False
        return self.device_marks is None or self.device_marks.ready()

    def wait(self) -> None:
        """Block until ready (background thread only)."""
        if self.event is not None:
            self.event.synchronize()
        if self.device_marks is not None:
            self.device_marks.wait()


class StepSignaler:
    """Sends step signals in order, once each is ready; commits watermarks in slices."""

    def __init__(
        self,
        send_commit: SendCommit,
        send_post_forward: SendPostForward,
        *,
        background: bool = False,
        commit_every_steps: int = 8,
    ) -> None:
        if commit_every_steps < 1:
            raise ValueError("commit_every_steps must be >= 1")
        self._send_commit = send_commit
        self._send_post_forward = send_post_forward
        self._every = commit_every_steps
        self._queue: deque[StepSignal] = deque()
        self._lock = threading.Lock()
        # The latest step's watermarks: every running request is in every step's batch, so
        # the latest step alone names them all (no per-request state to keep or to leak).
        self._host: Mapping[str, int] = {}
        self._device: tuple[Sequence[str], AsyncHostCopy] | None = None
        self._sent: dict[str, int] = {}  # what the daemon was told, per live request
        self._signals_sent = 0
        self._commits_sent = 0
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvd-step-signaler", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def signals_sent(self) -> int:
        return self._signals_sent

    @property
    def commits_sent(self) -> int:
        return self._commits_sent

    def watermarks(self) -> dict[str, int]:
        """The latest step's watermark per request (sent or not)."""
        with self._lock:
            return dict(self._latest(0, 1))

    def submit(self, signal: StepSignal) -> None:
        """Queue a step's signal and send what is ready. Never blocks on the device."""
        with self._lock:
            self._queue.append(signal)
            if self._thread is not None:
                self._wake.notify()
        self.pump()

    def pump(self) -> int:
        """Send every queued signal that is ready, oldest first; stop at the first that is not."""
        sent = 0
        with self._lock:
            while self._queue and self._queue[0].ready():
                self._send(self._queue.popleft())
                sent += 1
        return sent

    def resend_all(self) -> None:
        """Send the latest watermark of every request again (the daemon came back and forgot)."""
        with self._lock:
            self._sent.clear()
            for rid, tokens in self._latest(0, 1):
                self._commit(rid, tokens)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (off the step path: shutdown, tests) until every queued signal went out."""
        waited = 0.0
        pause = threading.Event()
        while self._queue and waited < timeout_s:
            head = self._queue[0]
            head.wait()
            self.pump()
            if self._queue and self._queue[0] is head:
                pause.wait(0.01)
                waited += 0.01
        return not self._queue

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- internals (lock held) ---------------------------------------------------------------

    def _latest(self, start: int, stride: int) -> list[tuple[str, int]]:
        """One slice (every ``stride``-th from ``start``) of the latest step's watermarks."""
        out: list[tuple[str, int]] = []
        if self._host:
            out.extend(itertools.islice(self._host.items(), start, None, stride))
        if self._device is not None:
            ids, copy = self._device
            values = copy.numpy()
            out.extend((ids[j], int(values[j])) for j in range(start, len(ids), stride))
        return out

    def _commit(self, request_id: str, tokens: int) -> None:
        if tokens > self._sent.get(request_id, 0):
            self._sent[request_id] = tokens
            self._send_commit(request_id, tokens)
            self._commits_sent += 1

    def _send(self, signal: StepSignal) -> None:
        if signal.commits:
            self._host = signal.commits
        if signal.device_marks is not None:
            self._device = (signal.device_request_ids, signal.device_marks)
        # Finished requests first: their exact final count, before their post-forward signal.
        for rid, tokens in signal.final.items():
            self._commit(rid, tokens)
        for rid, tokens in self._latest(signal.step % self._every, self._every):
            self._commit(rid, tokens)
        self._send_post_forward(signal.step, signal.finished)
        for rid in signal.finished:
            self._sent.pop(rid, None)
        self._signals_sent += 1

    def _run(self) -> None:
        """Background (GPU): wait for the oldest signal's event, then send."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                head = self._queue[0]
            try:
                head.wait()
            except RuntimeError:  # a CUDA error: the engine itself will report it
                logger.exception("waiting for a step's KV writes failed")
            self.pump()
