"""A small paged-attention engine in torch, for testing kvd end to end without a GPU or vLLM.

It is a stand-in for vLLM's GPU model runner that keeps what matters to kvd:

* a paged KV cache per layer in a chosen layout (:class:`~kvd_engine.cache_layout.CacheGeometry`:
  SPLIT/JOINT/PACKED, NHD/HND, block size, heads per TP rank, head dim, dtype), allocated in
  POSIX shm so a daemon can register it, one cache per TP rank;
* KV values that are a pure function of (token id, position, layer, head, dim)
  (:func:`kv_values`), so any engine, daemon or test can say what the bytes must be
  (:func:`expected_kv`);
* a block allocator with a reserved null block 0, prefill, decode, and speculative decoding
  with a draft proposer whose acceptance the test chooses (:class:`AcceptancePattern`);
  drafts are verified against a deterministic "model" (:func:`oracle_next_token`), so the
  token stream is the same whatever the pattern, only the number of steps changes;
* real paged attention over the cache (with ``check_kv_reads`` it also verifies every KV
  vector it reads against :func:`kv_values`, so a bad pull is caught where it is used);
* the connector hooks in vLLM 0.33's order (see :mod:`kvd_engine.engine_api`): forward
  (``save_kv_layer`` per layer) -> transfer results -> sample -> NWOR commit -> propose ->
  ``wait_for_save``;
* NWOR (:mod:`kvd_engine.nwor`) for the verification windows, deferred strategy (its
  attention reads the window's fresh K/V, never the cache).

The deterministic model is :mod:`kvd.demo.model`, the requests and blocks
:mod:`kvd.demo.engine_requests`, each rank's cache and forward pass :mod:`kvd.demo.runner`; this
module schedules and keeps the books, in vLLM's order. The step path never calls
``.item()``/``.cpu()``/``.tolist()``: host values come through
:class:`~kvd_engine.hostcopy.AsyncHostCopy`, as vLLM's async output copy does.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvd_engine.cache_layout import CacheGeometry, KvFormat, KvLayout
from kvd_engine.engine_api import (
    NullSchedulerConnector,
    NullWorkerConnector,
    ScheduledRequest,
    SchedulerConnector,
    StepView,
    TransferResults,
    WorkerConnector,
)
from kvd_engine.nwor import DeferredWriteManager, NworMode

from .engine_requests import BlockAllocator, EngineRequest, KvReadMismatch, OutOfBlocks, RequestStatus, StepResult
from .model import AcceptancePattern, DraftProposer, expected_kv, kv_values, layer_name, oracle_next_token
from .runner import Batch, Rank, build_batch, forward, is_decode, make_rank, new_tokens, sample_and_commit

logger = logging.getLogger(__name__)

__all__ = [
    "AcceptancePattern",
    "BlockAllocator",
    "DraftProposer",
    "EngineRequest",
    "KvReadMismatch",
    "OutOfBlocks",
    "ReferenceEngine",
    "RequestStatus",
    "StepResult",
    "expected_kv",
    "kv_values",
    "layer_name",
    "oracle_next_token",
]


class ReferenceEngine:
    """A paged-attention engine with TP ranks in one process, driven one step at a time."""

    def __init__(
        self,
        *,
        num_layers: int = 2,
        total_num_kv_heads: int = 2,
        head_dim: int = 8,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float16,
        kv_format: KvFormat = KvFormat.SPLIT,
        layout: KvLayout = KvLayout.NHD,
        tp_size: int = 1,
        vocab_size: int = 1000,
        num_speculative_tokens: int = 0,
        acceptance: AcceptancePattern | None = None,
        nwor_mode: NworMode | str = NworMode.STAGE,
        scheduler_connector: SchedulerConnector | None = None,
        worker_connector_factory: Callable[[int, CacheGeometry], WorkerConnector] | None = None,
        use_shm: bool = True,
        device: str | torch.device = "cpu",
        check_kv_reads: bool = False,
        max_num_batched_tokens: int = 4096,
        engine_id: str = "reference",
    ) -> None:
        """Allocate the caches (in shm unless ``use_shm=False``) and register them."""
        if total_num_kv_heads % tp_size and tp_size % total_num_kv_heads:
            raise ValueError(f"{total_num_kv_heads} KV heads cannot be split over tp_size {tp_size}")
        self.engine_id = engine_id
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_speculative_tokens = num_speculative_tokens
        self.proposer = DraftProposer(num_speculative_tokens, acceptance or AcceptancePattern.all(), vocab_size)
        self.check_kv_reads = check_kv_reads
        self.max_num_batched_tokens = max_num_batched_tokens
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler_connector: SchedulerConnector = scheduler_connector or NullSchedulerConnector()
        local_heads = max(1, total_num_kv_heads // tp_size)
        self.ranks: list[Rank] = []
        for tp_rank in range(tp_size):
            geometry = CacheGeometry(
                num_layers=num_layers,
                num_blocks=num_blocks,
                block_size=block_size,
                num_kv_heads=local_heads,
                head_dim=head_dim,
                dtype=dtype,
                kv_format=kv_format,
                layout=layout,
                total_num_kv_heads=total_num_kv_heads,
                tp_rank=tp_rank,
                tp_size=tp_size,
            )
            worker = worker_connector_factory(tp_rank, geometry) if worker_connector_factory else NullWorkerConnector()
            self.ranks.append(
                make_rank(
                    geometry,
                    engine_id=engine_id,
                    device=self.device,
                    use_shm=use_shm,
                    nwor=DeferredWriteManager(nwor_mode),
                    worker=worker,
                )
            )
        for rank in self.ranks:
            bind = getattr(rank.worker, "bind_nwor", None)
            if bind is not None:
                bind(rank.nwor)
            rank.worker.register_kv_caches(rank.kv_caches)
        self.requests: dict[str, EngineRequest] = {}
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._finished_since_last_step: set[str] = set()
        self._held: dict[str, list[int]] = {}  # request -> blocks kept for a remote reader
        self._recv_reports: dict[str, int] = {}
        self._send_reports: dict[str, int] = {}
        self._failed_recv: set[str] = set()
        self.step_count = 0
        self.closed = False

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> EngineRequest:
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        request = EngineRequest(
            request_id,
            list(prompt_token_ids),
            max_tokens,
            dict(kv_transfer_params) if kv_transfer_params is not None else None,
        )
        self.requests[request_id] = request
        self._waiting.append(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def has_work(self) -> bool:
        """Whether stepping can still change something (requests, held blocks, pending reports)."""
        return self.has_unfinished_requests() or bool(self._held) or bool(self._finished_since_last_step)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One engine step: schedule, forward, sample, propose, post-forward, bookkeeping."""
        if self.closed:
            raise RuntimeError("engine is closed")
        self.step_count += 1
        result = StepResult(step=self.step_count)
        self._admit_waiting()
        scheduled = self._schedule()
        view = StepView(
            scheduled=[
                ScheduledRequest(r.request_id, r.num_computed_tokens, n, len(r.draft_token_ids) if is_decode(r) else 0)
                for r, n in scheduled
            ],
            finished_req_ids=frozenset(self._finished_since_last_step),
        )
        finished_ids = set(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        metadata = self.scheduler_connector.build_connector_meta(view)
        for rank in self.ranks:
            rank.worker.bind_connector_metadata(metadata)
            rank.worker.start_load_kv()

        batch = build_batch(scheduled, self.block_size, self.device) if scheduled else None
        if batch is not None:
            for rank in self.ranks:
                forward(rank, batch, result, check_kv_reads=self.check_kv_reads, engine_id=self.engine_id)
        # Transfer results before sampling (vLLM's runner with deferred finalize).
        results = [rank.worker.get_transfer_results(finished_ids) for rank in self.ranks]
        error_blocks = set().union(*(rank.worker.get_block_ids_with_load_errors() for rank in self.ranks))
        if batch is not None:
            sampled_copy, valid_copy = sample_and_commit(
                batch, self.ranks, self.vocab_size, self.num_speculative_tokens
            )
            # The output copy: on a GPU the bookkeeping waits for it (vLLM does this in its
            # async output path); the commit path above never did.
            sampled_copy.wait()
            valid_copy.wait()
            tokens_host = sampled_copy.numpy()
            valid_host = valid_copy.numpy()
            step_tokens = new_tokens(batch, tokens_host, valid_host)
            # Propose the next drafts (after sampling, before the post-forward signal).
            for (request, _), toks in zip(batch.requests, step_tokens, strict=True):
                if self.num_speculative_tokens and toks:
                    pos = request.num_tokens + len(toks)
                    request.draft_token_ids = self.proposer.propose(toks[-1], pos)
        for rank in self.ranks:
            rank.worker.wait_for_save()
            rank.worker.clear_connector_metadata()
        for rank in self.ranks:
            rank.nwor.poll()

        if batch is not None:
            self._update_from_output(batch, step_tokens, valid_host, result)
        self._handle_transfer_results(results, error_blocks)
        return result

    # -- scheduling ---------------------------------------------------------------------------

    def _admit_waiting(self) -> None:
        still: deque[EngineRequest] = deque()
        while self._waiting:
            request = self._waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                still.append(request)
                continue
            matched, _is_async = self.scheduler_connector.get_num_new_matched_tokens(
                request, request.num_computed_tokens
            )
            matched = matched or 0
            need = math.ceil(
                (request.num_computed_tokens + max(matched, request.num_prompt_tokens - request.num_computed_tokens))
                / self.block_size
            )
            try:
                request.block_ids += self.allocator.allocate(max(0, need - len(request.block_ids)))
            except OutOfBlocks:
                still.append(request)
                still.extend(self._waiting)
                self._waiting.clear()
                break
            self.scheduler_connector.update_state_after_alloc(request, list(request.block_ids), matched)
            if matched > 0:
                request.num_external_tokens = matched
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                still.append(request)
            else:
                request.status = RequestStatus.RUNNING
                self._running.append(request)
        self._waiting = still

    def _schedule(self) -> list[tuple[EngineRequest, int]]:
        scheduled: list[tuple[EngineRequest, int]] = []
        budget = self.max_num_batched_tokens
        for request in self._running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                n = min(request.num_prompt_tokens - request.num_computed_tokens, budget)
            else:
                n = 1 + len(request.draft_token_ids)
            if n <= 0 or n > budget:
                continue
            need = math.ceil((request.num_computed_tokens + n) / self.block_size)
            if need > len(request.block_ids):
                request.block_ids += self.allocator.allocate(need - len(request.block_ids))
            scheduled.append((request, n))
            budget -= n
        return scheduled

    # -- bookkeeping ------------------------------------------------------------------------------

    def _update_from_output(
        self, batch: Batch, new_tokens: list[list[int]], valid: np.ndarray, result: StepResult
    ) -> None:
        result.num_scheduled_tokens = batch.num_lanes
        for (request, n), toks, v in zip(batch.requests, new_tokens, valid, strict=True):
            drafts = n - 1 if is_decode(request) else 0
            result.drafts_proposed += drafts
            result.drafts_accepted += min(int(v) - 1, drafts) if drafts else 0
            request.num_computed_tokens += n - drafts + (int(v) - 1 if drafts else 0)
            room = request.max_tokens - len(request.output_token_ids)
            request.output_token_ids += toks[:room]
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            if toks and len(request.output_token_ids) >= request.max_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                result.finished.append(request.request_id)

    def _finish(self, request: EngineRequest, status: RequestStatus) -> None:
        request.status = status
        request.draft_token_ids = []
        if request in self._running:
            self._running.remove(request)
        self._finished_since_last_step.add(request.request_id)
        was_receiving = request.num_external_tokens > 0 and request in self._waiting
        if was_receiving:
            self._waiting.remove(request)
        delay, params = self.scheduler_connector.request_finished(request, list(request.block_ids))
        request.output_kv_transfer_params = params
        if delay or was_receiving:
            # Held for a remote reader, or a pull may still be writing them: freed on the report.
            self._held[request.request_id] = request.block_ids
        else:
            self.allocator.free(request.block_ids)
        request.released_block_ids = request.block_ids
        request.block_ids = []

    def abort(self, request_id: str) -> None:
        """Abort a request (frees its blocks; a pending pull is abandoned)."""
        request = self.requests[request_id]
        if request.status.finished:
            return
        if request in self._waiting and request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _handle_transfer_results(self, results: list[TransferResults], error_blocks: set[int]) -> None:
        """Fold every rank's completions in; a request is done once all ranks reported it."""
        merged = TransferResults()
        world = len(self.ranks)
        for res in results:
            self._failed_recv |= res.failed_recving
            for rid in res.finished_recving:
                self._recv_reports[rid] = self._recv_reports.get(rid, 0) + 1
                if self._recv_reports[rid] == world:
                    del self._recv_reports[rid]
                    merged.finished_recving.add(rid)
            for rid in res.finished_sending:
                self._send_reports[rid] = self._send_reports.get(rid, 0) + 1
                if self._send_reports[rid] == world:
                    del self._send_reports[rid]
                    merged.finished_sending.add(rid)
        merged.failed_recving = self._failed_recv & merged.finished_recving
        self.scheduler_connector.update_connector_output(merged)
        for rid in merged.finished_recving:
            request = self.requests.get(rid)
            if request is not None and request.status is RequestStatus.FINISHED_ABORTED:
                self._failed_recv.discard(rid)
                blocks = self._held.pop(rid, None)
                if blocks is not None:
                    self.allocator.free(blocks)
                continue
            if request is None or request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            failed = rid in self._failed_recv or bool(error_blocks & set(request.block_ids))
            self._failed_recv.discard(rid)
            request.load_failed = failed
            request.num_computed_tokens = 0 if failed else request.num_external_tokens
            if request.num_computed_tokens >= request.num_prompt_tokens:
                # Recompute the last prompt token to get its logits (as vLLM does).
                request.num_computed_tokens = request.num_prompt_tokens - 1
            request.status = RequestStatus.RUNNING
            self._waiting.remove(request)
            self._running.append(request)
        for rid in merged.finished_sending:
            blocks = self._held.pop(rid, None)
            if blocks is not None:
                self.allocator.free(blocks)

    # -- inspection ---------------------------------------------------------------------------

    def request_kv(
        self, request_id: str, layer: int, tp_rank: int = 0, num_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache holds for a request's first ``num_tokens`` tokens (default: all computed)."""
        request = self.requests[request_id]
        blocks = request.block_ids or self._held.get(request_id) or request.released_block_ids
        n = request.num_computed_tokens if num_tokens is None else num_tokens
        rank = self.ranks[tp_rank]
        k_view, v_view = rank.geometry.kv_views(rank.kv_caches[layer_name(layer)])
        pos = torch.arange(n)
        table = torch.as_tensor(blocks, dtype=torch.int64)
        b, o = table[pos // self.block_size], pos % self.block_size
        return k_view[b, o].cpu(), v_view[b, o].cpu()

    def expected_request_kv(
        self, request_id: str, layer: int, tp_rank: int = 0, num_tokens: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`request_kv` must return: :func:`expected_kv` of the request's tokens."""
        request = self.requests[request_id]
        n = request.num_computed_tokens if num_tokens is None else num_tokens
        rank = self.ranks[tp_rank]
        return expected_kv(
            request.all_token_ids[:n],
            layer=layer,
            head_ids=rank.head_list,
            head_dim=rank.geometry.head_dim,
            dtype=rank.geometry.dtype,
        )

    def nwor_stats(self) -> list[Any]:
        return [rank.nwor.poll() for rank in self.ranks]

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left to do (or ``max_steps``); returns the steps taken."""
        steps = 0
        while self.has_work() and steps < max_steps:
            self.step()
            steps += 1
        return steps

    def close(self) -> None:
        """Shut the connectors down and remove the shm files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for rank in self.ranks:
            try:
                rank.worker.shutdown()
            finally:
                if rank.region is not None:
                    rank.region.unlink()
        self.scheduler_connector.shutdown()

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
