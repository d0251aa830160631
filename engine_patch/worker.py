"""The worker half of kvd's connector: one per TP rank, inside the process that owns the KV.

What it does per step, never waiting on the daemon:

* ``register_kv_caches``: describe the rank's cache (shm or CUDA IPC) and hand it to the
  :class:`~kvd_engine.worker_link.DaemonLink`, which registers it now and after every
  daemon restart;
* ``start_load_kv``: queue the step's pulls;
* ``wait_for_save`` (after the proposer): queue the step's commits and post-forward signal
  behind an event on the step's KV writes (:class:`~kvd_engine.signals.StepSignaler`);
  refused while an NWOR window is still open (the proposer has not run yet);
* ``get_transfer_results``: fold the daemon's completions into vLLM's sets. A failed load is
  reported as received *and* failed (vLLM then recomputes).

A pull's blocks go back to vLLM only once none of its bytes can still land, else a late write
would corrupt whatever request vLLM gives them to next. So a pull is reported failed when the
daemon refused it or reported it ended (``load_failed``, also the answer to a cancel), when the
link re-registered (the old registration's end fences every pull into it: see
:class:`~kvd_engine.link_events.Connected`) or found the daemon gone (nothing listens on its
socket), or, as a last resort, ``pull_last_resort_s`` past its deadline. A pull past its
deadline (sent with it: both sides time it alike) is cancelled, not failed. Likewise a held
request is reported finished (its blocks freed) on the daemon's ``finished_sending`` (sent for
every end of a lease, expiry included: reader heartbeats renew leases, so the expiry heard at
hold time means nothing), at a re-registration or a daemon gone, or as a last resort
``hold_last_resort_s`` after the hold. An engine stream that merely drops ends nothing: the
daemon may still be serving its pulls and leases.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvd_client import load_error

from .cache_layout import CacheGeometry
from .config import KvdConnectorConfig
from .engine_api import TransferResults
from .groups import RankGroups, build_group_registration
from .hostcopy import AsyncHostCopy
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
)
from .metadata import KvdConnectorMetadata
from .registration import build_registration
from .signals import StepSignal, StepSignaler
from .worker_link import DaemonLink

logger = logging.getLogger(__name__)

__all__ = ["KvdWorker", "WorkerStats"]

GeometryResolver = Callable[[Mapping[str, torch.Tensor]], CacheGeometry]
# A hybrid / MLA engine: every KV cache group of the rank (kvd_engine.groups).
GroupsResolver = Callable[[Mapping[str, torch.Tensor]], RankGroups]

_UNKNOWN_RELEASE_TTL_S = 60.0


@dataclasses.dataclass
class _Pull:
    request_id: str
    local_block_ids: tuple[int, ...]
    started_at: float
    cancel_at: float  # its deadline + slack: cancel it (again every slack) while it runs
    last_resort_at: float  # fail it even though nobody confirmed it ended
    epoch: int = 0  # the daemon connection its StartPulls went out under (0: not sent yet)
    transfer_id: str = ""
    in_doubt: bool = False  # sent, never answered: only a fence (or the daemon) ends it


@dataclasses.dataclass
class WorkerStats:
    pulls_started: int = 0
    pulls_done: int = 0
    pulls_failed: int = 0
    reconnects: int = 0
    ordering_refusals: int = 0
    holds_released_by_restart: int = 0
    pulls_cancelled: int = 0  # cancels sent for pulls past their deadline
    last_resort_failures: int = 0  # pulls failed / holds released without the daemon's word


class KvdWorker:
    """Worker-side connector logic of one rank (vLLM-free; the facade adapts vLLM's calls)."""

    def __init__(
        self,
        config: KvdConnectorConfig,
        engine_id: str,
        tp_rank: int,
        *,
        geometry: CacheGeometry | GeometryResolver | None = None,
        groups: GroupsResolver | None = None,
        link: DaemonLink | None = None,
        window_open: Callable[[], bool] | None = None,
        report_invalid_blocks: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``window_open`` tells whether an NWOR window is still open (ordering guard).

        ``geometry`` describes a single-layout cache; ``groups`` every KV cache group of a
        hybrid, MLA or drafter-carrying model (one of the two is given).
        """
        if (geometry is None) == (groups is None):
            raise ValueError("KvdWorker needs exactly one of geometry and groups")
        self.config = config
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self._geometry = geometry
        self._groups = groups
        self.link = link or DaemonLink(
            config.target,
            engine_id,
            tp_rank,
            rpc_timeout_s=config.rpc_timeout_s,
            reconnect_initial_s=config.reconnect_initial_s,
            reconnect_max_s=config.reconnect_max_s,
        )
        self._window_open = window_open or (lambda: False)
        self._report_invalid_blocks = report_invalid_blocks
        self._clock = clock
        self._signaler: StepSignaler | None = None
        self._meta: KvdConnectorMetadata | None = None
        self._step = 0
        self._device_marks: tuple[Sequence[str], AsyncHostCopy] | None = None
        self._pulls: dict[str, _Pull] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._error_blocks: set[int] = set()
        # request -> (last-resort release time on self._clock, the daemon connection of the hold)
        self._held: dict[str, tuple[float, int]] = {}
        self._sent: dict[str, float] = {}  # released by the daemon, not yet reported -> when heard
        self._on_gpu = False
        self._deferred_finished: set[str] = set()
        self._deferred_commits: dict[str, int] = {}
        self._incarnation = ""
        self.geometry: CacheGeometry | None = None
        self.rank_groups: RankGroups | None = None
        self.stats = WorkerStats()

    def bind_nwor(self, manager: Any) -> None:
        """Refuse post-forward signals while ``manager`` (a DeferredWriteManager) has a window open."""
        self._window_open = lambda: bool(manager.window_active)

    # -- registration ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Describe the rank's cache and start (re)registering it in the background."""
        if self._groups is not None:
            rank = self._groups(kv_caches)
            self.geometry = rank.geometry
            self.rank_groups = rank
            request = build_group_registration(
                self.engine_id, kv_caches, rank, require_commits=self.config.require_commits
            )
        else:
            assert self._geometry is not None
            geometry = self._geometry if isinstance(self._geometry, CacheGeometry) else self._geometry(kv_caches)
            self.geometry = geometry
            request = build_registration(
                self.engine_id, kv_caches, geometry, require_commits=self.config.require_commits
            )
        self._on_gpu = next(iter(kv_caches.values())).device.type == "cuda"
        self._signaler = StepSignaler(
            self.link.send_commit,
            self.link.send_post_forward,
            background=self._on_gpu,
            commit_every_steps=self.config.commit_every_steps,
        )
        self.link.start(request)

    # -- per step -------------------------------------------------------------------------------

    def bind_connector_metadata(self, metadata: KvdConnectorMetadata | None) -> None:
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        now = self._clock()
        orders: list[PullOrder] = []
        for spec in meta.pulls:
            # The deadline goes out with the pull, so the daemon ends it when this side expects.
            deadline_ms = spec.deadline_ms or self.config.effective_pull_deadline_ms
            cancel_at = now + deadline_ms / 1000.0 + self.config.pull_timeout_slack_s
            # The epoch is stamped by the link when the StartPulls goes out (PullStarted), not
            # here: a command still queued when the stream drops goes out on the next registration.
            self._pulls[spec.request_id] = _Pull(
                spec.request_id, spec.local_block_ids, now, cancel_at, cancel_at + self.config.pull_last_resort_s
            )
            if spec.refused:  # the scheduler could not pull it: failed now, recomputed
                self._fail_pull(spec.request_id, spec.refused, cancel=False)
                continue
            orders.append(
                PullOrder(
                    spec.request_id,
                    tuple(spec.local_block_ids),
                    spec.remote,
                    deadline_ms,
                    tuple(tuple(ids) for ids in spec.local_group_block_ids),
                )
            )
            self.stats.pulls_started += 1
        self.link.start_pulls(orders)  # one StartPulls for the step's loads; each fails on its own
        # A hold's lease expiry (meta.held's values) is not used: heartbeats renew it at the daemon.
        for rid in meta.held:
            self._held[rid] = (now + self.config.hold_last_resort_s, self.link.epoch)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: pulls load whole requests before vLLM schedules them."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Nothing to save: the daemon reads the engine's memory in place."""
        return None

    def set_step_watermarks(self, request_ids: Sequence[str], watermarks: torch.Tensor) -> None:
        """Device watermarks of this step (from the NWOR commit); copied to host asynchronously."""
        self._device_marks = (request_ids, AsyncHostCopy(watermarks))

    def wait_for_save(self) -> None:
        """After the proposer: queue this step's commits and post-forward signal, in order."""
        if self._window_open():
            # The verification window is still open: the proposer and the NWOR commit have not
            # run. Signalling now would let the daemon serve KV that may still change.
            self.stats.ordering_refusals += 1
            logger.error("kvd: post-forward signal refused: the NWOR window of this step is still open")
            if self._meta is not None:  # not lost: they go out with the next accepted signal
                self._deferred_finished |= self._meta.finished_req_ids
                for rid, tokens in self._meta.final_watermarks.items():
                    self._deferred_commits[rid] = max(tokens, self._deferred_commits.get(rid, 0))
            return
        meta = self._meta
        self._step += 1
        final: dict[str, int] = dict(self._deferred_commits)
        finished: set[str] = set(self._deferred_finished)
        self._deferred_finished.clear()
        self._deferred_commits.clear()
        commits: Mapping[str, int] = {}
        if meta is not None:
            commits = meta.host_commits
            for rid, tokens in meta.final_watermarks.items():
                final[rid] = max(tokens, final.get(rid, 0))
            finished |= meta.finished_req_ids
        device_ids: Sequence[str] = ()
        device_copy: AsyncHostCopy | None = None
        if self._device_marks is not None:
            device_ids, device_copy = self._device_marks
            self._device_marks = None
        event = None
        if self._on_gpu:
            # Completes once every kernel of this step (KV writes, NWOR commit) has run.
            event = torch.cuda.Event()
            event.record()
        if self._signaler is None:
            return  # not registered yet: nothing the daemon could serve
        signal = StepSignal(
            step=self._step,
            commits=commits,
            device_request_ids=device_ids,
            device_marks=device_copy,
            finished=tuple(finished),
            final=final,
            event=event,
        )
        self._signaler.submit(signal)

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        """Completions since the last call (never blocks)."""
        self._drain()
        self._expire_pulls()
        results = TransferResults()
        results.finished_recving = self._recv_done | self._recv_failed
        results.failed_recving = set(self._recv_failed)
        self._recv_done = set()
        self._recv_failed = set()
        self._expire_holds()
        # Report only requests the scheduler told us it held (vLLM requires them to have been
        # finished); a release heard before the step that announces the hold waits a little.
        now = self._clock()
        for rid, heard in list(self._sent.items()):
            if rid in self._held:
                results.finished_sending.add(rid)
                del self._held[rid]
                del self._sent[rid]
            elif now - heard > _UNKNOWN_RELEASE_TTL_S:
                del self._sent[rid]
        if self._signaler is not None:
            self._signaler.pump()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._error_blocks = self._error_blocks, set()
        return blocks if self._report_invalid_blocks else set()

    def shutdown(self) -> None:
        if self._signaler is not None:
            self._signaler.flush(timeout_s=2.0)
            self._signaler.close()
        self.link.close()

    # -- events -----------------------------------------------------------------------------------

    def _drain(self) -> None:
        for event in self.link.poll():
            self._on_event(event)

    def _on_event(self, event: LinkEvent) -> None:
        if isinstance(event, DaemonMessage):
            self._on_message(event.message)
        elif isinstance(event, PullStarted):
            pull = self._pulls.get(event.request_id)
            if pull is None:
                # Given up already (the last resort): the daemon must not write on.
                self.link.cancel_pull(event.transfer_id)
            else:
                pull.transfer_id = event.transfer_id
                pull.epoch = event.epoch
        elif isinstance(event, PullInDoubt):
            pull = self._pulls.get(event.request_id)
            if pull is not None:
                pull.epoch = event.epoch
                pull.in_doubt = True
                logger.warning(
                    "kvd pull of request %s unanswered (%s); waiting for the link's re-registration to end it",
                    event.request_id,
                    event.message,
                )
        elif isinstance(event, PullFailed):
            self._fail_pull(event.request_id, event.message)
        elif isinstance(event, Disconnected):
            # The daemon may live on and still be writing our pulls and serving our leases:
            # nothing ends before the re-registration (Connected) fences them.
            logger.info("kvd engine stream of %s rank %d lost (%s)", self.engine_id, self.tp_rank, event.reason)
        elif isinstance(event, DaemonGone):
            # The daemon exited: what it did for connection ``epoch`` (and older) is over.
            self._fence(event.epoch + 1)
        elif isinstance(event, Connected):
            self._fence(event.epoch)
            if self._incarnation:
                self.stats.reconnects += 1
            self._incarnation = event.incarnation
            if self._signaler is not None:
                self._signaler.resend_all()

    def _on_message(self, message: Any) -> None:
        kind = message.WhichOneof("kind")
        if kind == "finished_recving":
            body = message.finished_recving
            pull = self._pulls.get(body.request_id)
            if pull is None or (pull.transfer_id and body.transfer_id and pull.transfer_id != body.transfer_id):
                return  # stale: a pull we already gave up on
            del self._pulls[body.request_id]
            self._recv_done.add(body.request_id)
            self.stats.pulls_done += 1
        elif kind == "load_failed":
            body = message.load_failed
            pull = self._pulls.get(body.request_id)
            if pull is None or (pull.transfer_id and body.transfer_id and pull.transfer_id != body.transfer_id):
                return
            error = load_error(body)  # the daemon's exact class, e.g. HeldKvEvicted or IncompatibleLayout
            self._fail_pull(body.request_id, f"{type(error).__name__}: {error}", list(body.block_ids))
        elif kind == "finished_sending":
            body = message.finished_sending
            self._sent.setdefault(body.request_id, self._clock())
        else:
            logger.debug("ignoring daemon message %r", kind)

    def _fail_pull(
        self, request_id: str, message: str, block_ids: Sequence[int] | None = None, *, cancel: bool = True
    ) -> None:
        """Report a pull failed (vLLM recomputes and reuses its blocks). Only for a pull none of
        whose bytes can land any more (see the module docstring)."""
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return
        logger.warning("kvd pull of request %s failed (%s); it will be recomputed", request_id, message)
        self._recv_failed.add(request_id)
        self._error_blocks.update(block_ids if block_ids else pull.local_block_ids)
        self.stats.pulls_failed += 1
        if cancel and pull.transfer_id:
            self.link.cancel_pull(pull.transfer_id)

    def _expire_pulls(self) -> None:
        """Cancel pulls past their deadline; fail only those past the last resort.

        A cancelled pull is reported failed when the daemon says it ended (``load_failed``), not
        here: until then the daemon may still be writing into its blocks.
        """
        if not self._pulls:
            return
        now = self._clock()
        for rid, pull in list(self._pulls.items()):
            if now > pull.last_resort_at:
                self.stats.last_resort_failures += 1
                logger.error(
                    "kvd pull of request %s (transfer %r): no end confirmed by the daemon %.0f s past its deadline",
                    rid,
                    pull.transfer_id,
                    self.config.pull_last_resort_s,
                )
                self._fail_pull(rid, "no end confirmed by the daemon (last resort)")
            elif now > pull.cancel_at and pull.transfer_id:
                pull.cancel_at = now + self.config.pull_timeout_slack_s  # again, should this one be lost
                self.stats.pulls_cancelled += 1
                logger.warning(
                    "kvd pull of request %s past its deadline: cancelling transfer %s", rid, pull.transfer_id
                )
                self.link.cancel_pull(pull.transfer_id)

    def _expire_holds(self) -> None:
        """Release holds the daemon has not ended long after any lease could last (last resort).

        The daemon reports every end of a lease (``finished_sending``, expiry included) and
        reader heartbeats renew leases there, so the expiry heard at hold time is no bound.
        """
        if not self._held:
            return
        now = self._clock()
        for rid, (last_resort, _epoch) in list(self._held.items()):
            if now > last_resort and rid not in self._sent:
                self.stats.last_resort_failures += 1
                logger.error(
                    "kvd hold of request %s: no end from the daemon %.0f s after it was made; releasing its blocks",
                    rid,
                    self.config.hold_last_resort_s,
                )
                self._sent[rid] = now

    def _fence(self, epoch: int) -> None:
        """Registration ``epoch`` replaced every older one, which fenced their pulls (the daemon
        cancelled them) and ended their leases: fail those pulls, release those holds.

        Pulls not sent yet (epoch 0) go out on the new registration, and work of the new one
        (started before this event was polled) is left alone.
        """
        for rid, pull in [(rid, p) for rid, p in self._pulls.items() if 0 < p.epoch < epoch]:
            self._fail_pull(rid, f"the daemon of connection {pull.epoch} is gone or was replaced", cancel=False)
        gone = [rid for rid, (_last_resort, e) in self._held.items() if e < epoch]
        if gone:
            self.stats.holds_released_by_restart += len(gone)
            now = self._clock()
            for rid in gone:
                self._sent.setdefault(rid, now)
