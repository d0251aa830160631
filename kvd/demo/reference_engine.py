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

The step path never calls ``.item()``/``.cpu()``/``.tolist()``: host values come through
:class:`~kvd_engine.hostcopy.AsyncHostCopy`, as vLLM's async output copy does.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from random import Random  # the name `random` is shadowed inside AcceptancePattern
from typing import Any

import numpy as np
import torch

from kvd_engine.cache_layout import NULL_BLOCK, CacheGeometry, KvFormat, KvLayout, SlotIO
from kvd_engine.engine_api import (
    NullSchedulerConnector,
    NullWorkerConnector,
    ScheduledRequest,
    SchedulerConnector,
    StepView,
    TransferResults,
    WorkerConnector,
)
from kvd_engine.hostcopy import AsyncHostCopy
from kvd_engine.nwor import DeferredWriteManager, NworMode, acceptance_mask, committed_watermarks, num_valid_tokens
from kvd_engine.shm import ShmRegion, create_shm_region

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

K, V, Q = 0, 1, 2


def layer_name(index: int) -> str:
    """The name vLLM gives attention layer ``index`` (what ``register_kv_caches`` keys on)."""
    return f"model.layers.{index}.self_attn.attn"


# --- the deterministic "model" -----------------------------------------------------------------


def kv_values(
    tokens: torch.Tensor, positions: torch.Tensor, layer: int, head_ids: torch.Tensor, head_dim: int, which: int
) -> torch.Tensor:
    """``[T, H, D]`` float32: K (``which=0``), V (1) or Q (2) of tokens at positions.

    Values are multiples of 1/128 in [-125/128, 125/128]: exact in float16, bfloat16 and
    float32, so a cast is lossless and bytes can be compared across engines and dtypes.
    """
    dims = torch.arange(head_dim, device=tokens.device, dtype=torch.int64)
    x = (
        tokens.to(torch.int64)[:, None, None] * 131
        + positions.to(torch.int64)[:, None, None] * 31
        + layer * 17
        + head_ids.to(tokens.device, torch.int64)[None, :, None] * 7
        + dims[None, None, :] * 3
        + which * 53
    )
    return ((x % 251) - 125).to(torch.float32) / 128.0


def expected_kv(
    token_ids: Sequence[int],
    *,
    layer: int,
    head_ids: Iterable[int],
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    start_position: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V ``[T, H, D]`` any engine must hold for ``token_ids`` (at consecutive positions)."""
    tokens = torch.as_tensor(list(token_ids), dtype=torch.int64)
    positions = torch.arange(start_position, start_position + tokens.shape[0], dtype=torch.int64)
    heads = torch.as_tensor(list(head_ids), dtype=torch.int64)
    return (
        kv_values(tokens, positions, layer, heads, head_dim, K).to(dtype),
        kv_values(tokens, positions, layer, heads, head_dim, V).to(dtype),
    )


_MULT = 1103515245
_INC = 12345


def oracle_next_token(token: int, position: int, vocab_size: int) -> int:
    """The "model": the token at ``position`` that follows ``token``. Deterministic."""
    return (token * _MULT + position * _INC + 7) % vocab_size


def _oracle_next_tokens(tokens: torch.Tensor, next_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vectorised :func:`oracle_next_token` (same values)."""
    return (tokens.to(torch.int64) * _MULT + next_positions.to(torch.int64) * _INC + 7) % vocab_size


# --- speculative decoding -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AcceptancePattern:
    """How many of each step's drafts the proposer gets right (so how many are accepted)."""

    kind: str  # "all", "none", "partial", "random"
    accept: int = 0  # partial: drafts right per step
    seed: int = 0  # random: the draw of each step

    def __post_init__(self) -> None:
        if self.kind not in ("all", "none", "partial", "random"):
            raise ValueError(f"unknown acceptance pattern {self.kind!r}")
        if self.accept < 0:
            raise ValueError("AcceptancePattern.accept must be >= 0")

    @classmethod
    def all(cls) -> AcceptancePattern:
        return cls("all")

    @classmethod
    def none(cls) -> AcceptancePattern:
        return cls("none")

    @classmethod
    def partial(cls, accept: int) -> AcceptancePattern:
        return cls("partial", accept=accept)

    @classmethod
    def random(cls, seed: int) -> AcceptancePattern:
        return cls("random", seed=seed)

    def correct_drafts(self, num_drafts: int, rng: Random) -> int:
        if self.kind == "all":
            return num_drafts
        if self.kind == "none":
            return 0
        if self.kind == "partial":
            return min(self.accept, num_drafts)
        return rng.randint(0, num_drafts)


class DraftProposer:
    """Proposes ``k`` drafts: the first ``pattern.correct_drafts(k)`` right, the rest wrong."""

    def __init__(self, num_speculative_tokens: int, pattern: AcceptancePattern, vocab_size: int) -> None:
        self.k = num_speculative_tokens
        self.pattern = pattern
        self.vocab_size = vocab_size
        self._rng = random.Random(pattern.seed)

    def propose(self, last_token: int, next_position: int) -> list[int]:
        """Drafts for positions ``next_position, next_position + 1, ...`` (k is small: a plain loop)."""
        if self.k == 0:
            return []
        right = self.pattern.correct_drafts(self.k, self._rng)
        drafts = []
        token = last_token
        for j in range(self.k):
            true = oracle_next_token(token, next_position + j, self.vocab_size)
            token = true if j < right else (true + 1) % self.vocab_size
            drafts.append(token)
        return drafts


# --- requests and blocks --------------------------------------------------------------------------


class OutOfBlocks(RuntimeError):
    """The engine's cache has no free block left."""


class KvReadMismatch(AssertionError):
    """Attention read KV bytes from the cache that are not what the tokens say they must be."""


class BlockAllocator:
    """Free list of block ids; block 0 is the null block and is never handed out."""

    def __init__(self, num_blocks: int) -> None:
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        self._free.extend(block_ids)


class RequestStatus(enum.Enum):
    WAITING = "WAITING"
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    RUNNING = "RUNNING"
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"
    FINISHED_ABORTED = "FINISHED_ABORTED"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclasses.dataclass(eq=False)
class EngineRequest:
    """One request, with the attributes the connector reads (named as vLLM's ``Request``)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_external_tokens: int = 0
    load_failed: bool = False
    output_kv_transfer_params: dict[str, Any] | None = None
    released_block_ids: list[int] = dataclasses.field(default_factory=list)  # for inspection after finish

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclasses.dataclass
class StepResult:
    """What one :meth:`ReferenceEngine.step` did."""

    step: int
    num_scheduled_tokens: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    finished: list[str] = dataclasses.field(default_factory=list)
    attention: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # rank 0, last layer


@dataclasses.dataclass
class _Rank:
    tp_rank: int
    geometry: CacheGeometry
    head_ids: torch.Tensor
    head_list: list[int]
    region: ShmRegion | None
    kv_caches: dict[str, torch.Tensor]
    io: SlotIO
    nwor: DeferredWriteManager
    worker: WorkerConnector


# --- the engine -----------------------------------------------------------------------------------


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
        self.ranks: list[_Rank] = []
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
            if tp_size <= total_num_kv_heads:
                first = tp_rank * local_heads
            else:
                first = tp_rank // (tp_size // total_num_kv_heads)
            head_ids = torch.arange(first, first + local_heads, dtype=torch.int64)
            region = None
            if use_shm and self.device.type == "cpu":
                region = create_shm_region(geometry.total_bytes, prefix=f"kvd-ref-{engine_id}-r{tp_rank}")
                flat = region.tensor
            else:
                flat = torch.zeros(geometry.total_bytes, dtype=torch.uint8, device=self.device)
            caches = {layer_name(i): t for i, t in enumerate(geometry.layer_views(flat))}
            io = geometry.slot_io()
            worker = worker_connector_factory(tp_rank, geometry) if worker_connector_factory else NullWorkerConnector()
            self.ranks.append(
                _Rank(
                    tp_rank,
                    geometry,
                    head_ids,
                    list(range(first, first + local_heads)),
                    region,
                    caches,
                    io,
                    DeferredWriteManager(nwor_mode),
                    worker,
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
                ScheduledRequest(
                    r.request_id, r.num_computed_tokens, n, len(r.draft_token_ids) if self._is_decode(r) else 0
                )
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

        batch = self._build_batch(scheduled) if scheduled else None
        if batch is not None:
            for rank in self.ranks:
                self._forward(rank, batch, result)
        # Transfer results before sampling (vLLM's runner with deferred finalize).
        results = [rank.worker.get_transfer_results(finished_ids) for rank in self.ranks]
        error_blocks = set().union(*(rank.worker.get_block_ids_with_load_errors() for rank in self.ranks))
        if batch is not None:
            sampled_copy, valid_copy = self._sample_and_commit(batch)
            # The output copy: on a GPU the bookkeeping waits for it (vLLM does this in its
            # async output path); the commit path above never did.
            sampled_copy.wait()
            valid_copy.wait()
            tokens_host = sampled_copy.numpy()
            valid_host = valid_copy.numpy()
            new_tokens = self._new_tokens(batch, tokens_host, valid_host)
            # Propose the next drafts (after sampling, before the post-forward signal).
            for (request, _), toks in zip(batch.requests, new_tokens, strict=True):
                if self.num_speculative_tokens and toks:
                    pos = request.num_tokens + len(toks)
                    request.draft_token_ids = self.proposer.propose(toks[-1], pos)
        for rank in self.ranks:
            rank.worker.wait_for_save()
            rank.worker.clear_connector_metadata()
        for rank in self.ranks:
            rank.nwor.poll()

        if batch is not None:
            self._update_from_output(batch, new_tokens, valid_host, result)
        self._handle_transfer_results(results, error_blocks)
        return result

    # -- scheduling ---------------------------------------------------------------------------

    @staticmethod
    def _is_decode(request: EngineRequest) -> bool:
        return request.num_computed_tokens >= request.num_prompt_tokens

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

    # -- the forward --------------------------------------------------------------------------

    @dataclasses.dataclass
    class _Batch:
        requests: list[tuple[EngineRequest, int]]
        tokens: torch.Tensor  # [T]
        positions: torch.Tensor  # [T]
        slots: torch.Tensor  # [T]
        starts: torch.Tensor  # [R + 1] int32
        starts_host: list[int]
        num_scheduled: torch.Tensor  # [R]
        num_draft: torch.Tensor  # [R]
        block_tables: list[torch.Tensor]
        num_lanes: int
        has_drafts: bool

    def _build_batch(self, scheduled: list[tuple[EngineRequest, int]]) -> ReferenceEngine._Batch:
        """Lay out the step's token lanes (host bookkeeping, then one transfer to the device)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[np.ndarray] = []
        starts = [0]
        drafts = []
        tables = []
        for request, n in scheduled:
            start = request.num_computed_tokens
            if self._is_decode(request):
                lane_tokens = [request.all_token_ids[-1]] + request.draft_token_ids
                drafts.append(len(request.draft_token_ids))
            else:
                lane_tokens = request.all_token_ids[start : start + n]
                drafts.append(0)
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(request.block_ids, dtype=np.int64)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            tokens += lane_tokens
            positions += pos.tolist()
            starts.append(starts[-1] + n)
            tables.append(torch.as_tensor(table, device=self.device))
        dev = self.device
        return ReferenceEngine._Batch(
            requests=scheduled,
            tokens=torch.as_tensor(tokens, dtype=torch.int64, device=dev),
            positions=torch.as_tensor(positions, dtype=torch.int64, device=dev),
            slots=torch.as_tensor(np.concatenate(slots), dtype=torch.int64, device=dev),
            starts=torch.as_tensor(starts, dtype=torch.int32, device=dev),
            starts_host=starts,
            num_scheduled=torch.as_tensor([n for _, n in scheduled], dtype=torch.int64, device=dev),
            num_draft=torch.as_tensor(drafts, dtype=torch.int64, device=dev),
            block_tables=tables,
            num_lanes=starts[-1],
            has_drafts=any(drafts),
        )

    def _forward(self, rank: _Rank, batch: ReferenceEngine._Batch, result: StepResult) -> None:
        geometry = rank.geometry
        if batch.has_drafts:
            rank.nwor.begin_window(batch.num_lanes)
        dtype = geometry.dtype
        scale = 1.0 / math.sqrt(geometry.head_dim)
        for layer in range(geometry.num_layers):
            name = layer_name(layer)
            rank.worker.wait_for_layer_load(name)
            cache = rank.kv_caches[name]
            k_new = kv_values(batch.tokens, batch.positions, layer, rank.head_ids, geometry.head_dim, K).to(dtype)
            v_new = kv_values(batch.tokens, batch.positions, layer, rank.head_ids, geometry.head_dim, V).to(dtype)
            q = kv_values(batch.tokens, batch.positions, layer, rank.head_ids, geometry.head_dim, Q)
            rank.nwor.write(name, k_new, v_new, cache, batch.slots, rank.io.write)
            k_view, v_view = geometry.kv_views(cache)
            for i, (request, n) in enumerate(batch.requests):
                lo, hi = batch.starts_host[i], batch.starts_host[i + 1]
                past = request.num_computed_tokens
                pos = torch.arange(past, device=self.device)
                table = batch.block_tables[i]
                b, o = table[pos // geometry.block_size], pos % geometry.block_size
                k_past, v_past = k_view[b, o], v_view[b, o]
                if self.check_kv_reads and past:
                    self._check_reads(request, rank, layer, k_past, v_past)
                keys = torch.cat((k_past, k_new[lo:hi])).to(torch.float32)  # [S, H, D]
                values = torch.cat((v_past, v_new[lo:hi])).to(torch.float32)
                scores = torch.einsum("thd,shd->hts", q[lo:hi], keys) * scale
                causal = (
                    torch.arange(past + n, device=self.device)[None, :]
                    <= (past + torch.arange(n, device=self.device))[:, None]
                )
                scores = scores.masked_fill(~causal[None], float("-inf"))
                out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values)
                if rank.tp_rank == 0 and layer == geometry.num_layers - 1:
                    result.attention[request.request_id] = out
            rank.worker.save_kv_layer(name, cache, None)

    def _check_reads(self, request: EngineRequest, rank: _Rank, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Debug mode: the KV attention read must be what the tokens say (torch.equal, no .cpu())."""
        past = request.num_computed_tokens
        ek, ev = expected_kv(
            request.all_token_ids[:past],
            layer=layer,
            head_ids=rank.head_list,
            head_dim=rank.geometry.head_dim,
            dtype=rank.geometry.dtype,
        )
        ek, ev = ek.to(k.device), ev.to(v.device)
        if not (torch.equal(k, ek) and torch.equal(v, ev)):
            bad = torch.nonzero(((k != ek) | (v != ev)).flatten(1).any(dim=1)).flatten()
            raise KvReadMismatch(
                f"{self.engine_id} rank {rank.tp_rank} layer {layer}: request {request.request_id} read wrong KV at "
                f"positions {np.asarray(bad[:8].to('cpu'))} of {past}"
            )

    # -- sampling, NWOR commit ------------------------------------------------------------------

    def _sample_and_commit(self, batch: ReferenceEngine._Batch) -> tuple[AsyncHostCopy, AsyncHostCopy]:
        """Verify drafts, commit NWOR windows, hand watermarks to the workers. All device ops."""
        model = _oracle_next_tokens(batch.tokens, batch.positions + 1, self.vocab_size)  # [T]
        width = 1 + self.num_speculative_tokens
        # Lane index of column j of request r: the last lane for prefill rows, start + j for decode.
        cols = torch.arange(width, device=self.device)
        starts = batch.starts[:-1].to(torch.int64)
        is_decode = batch.num_draft > 0
        last = starts + batch.num_scheduled - 1
        lane = torch.where(is_decode[:, None], starts[:, None] + cols[None, :], last[:, None])
        in_row = cols[None, :] <= batch.num_draft[:, None]
        lane = torch.where(in_row, lane, last[:, None])
        model_tok = model[lane]  # [R, width]
        # drafts[r, j] = token of lane start + j + 1 (for j < num_draft).
        draft_lane = torch.clamp(starts[:, None] + cols[None, :] + 1, max=batch.num_lanes - 1)
        draft_tok = batch.tokens[draft_lane]
        match = (draft_tok == model_tok) & (cols[None, :] < batch.num_draft[:, None])
        accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)  # [R]
        valid_count = accepted + 1
        sampled = torch.where(cols[None, :] < valid_count[:, None], model_tok, torch.full_like(model_tok, -1))
        num_valid = num_valid_tokens(batch.num_scheduled, batch.num_draft, valid_count)
        mask = acceptance_mask(batch.starts, num_valid, batch.num_lanes)
        marks = committed_watermarks(batch.positions, batch.starts, num_valid)
        ids = [r.request_id for r, _ in batch.requests]
        for rank in self.ranks:
            rank.nwor.commit(mask)
            rank.worker.set_step_watermarks(ids, marks)
        return AsyncHostCopy(sampled), AsyncHostCopy(valid_count)

    def _new_tokens(self, batch: ReferenceEngine._Batch, sampled: np.ndarray, valid: np.ndarray) -> list[list[int]]:
        """Host bookkeeping (the async output copy has landed): each request's new tokens."""
        out: list[list[int]] = []
        for i, (request, n) in enumerate(batch.requests):
            if not self._is_decode(request) and request.num_computed_tokens + n < request.num_prompt_tokens:
                out.append([])  # a partial prefill chunk: its sample is discarded
                continue
            out.append([int(t) for t in sampled[i, : int(valid[i])]])
        return out

    # -- bookkeeping ------------------------------------------------------------------------------

    def _update_from_output(
        self, batch: ReferenceEngine._Batch, new_tokens: list[list[int]], valid: np.ndarray, result: StepResult
    ) -> None:
        result.num_scheduled_tokens = batch.num_lanes
        for (request, n), toks, v in zip(batch.requests, new_tokens, valid, strict=True):
            drafts = n - 1 if self._is_decode(request) else 0
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
