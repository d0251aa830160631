"""The reference engine's model runner: one TP rank's paged cache, and a step's forward pass.

What vLLM's GPU model runner does for kvd, on torch: each :class:`Rank` owns its cache (in POSIX
shm so a daemon can register it), its slot I/O, its NWOR manager and its worker connector;
:func:`build_batch` lays out a step's token lanes; :func:`forward` runs real paged attention
over one rank's cache, layer by layer, with the connector's per-layer hooks (with
``check_kv_reads`` it verifies every KV vector it reads against :func:`~kvd.demo.model.kv_values`);
:func:`sample_and_commit` verifies drafts on the device and commits the NWOR windows. The
scheduling and bookkeeping are :class:`~kvd.demo.reference_engine.ReferenceEngine`'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvd_engine.cache_layout import CacheGeometry, SlotIO
from kvd_engine.engine_api import WorkerConnector
from kvd_engine.hostcopy import AsyncHostCopy
from kvd_engine.nwor import DeferredWriteManager, acceptance_mask, committed_watermarks, num_valid_tokens
from kvd_engine.shm import ShmRegion, create_shm_region

from .engine_requests import EngineRequest, KvReadMismatch, StepResult
from .model import K, Q, V, expected_kv, kv_values, layer_name, oracle_next_tokens

__all__ = ["Batch", "Rank", "build_batch", "forward", "is_decode", "make_rank", "new_tokens", "sample_and_commit"]


@dataclasses.dataclass
class Rank:
    """One TP rank of the engine: its cache and what writes, reads and moves it."""

    tp_rank: int
    geometry: CacheGeometry
    head_ids: torch.Tensor
    head_list: list[int]
    region: ShmRegion | None
    kv_caches: dict[str, torch.Tensor]
    io: SlotIO
    nwor: DeferredWriteManager
    worker: WorkerConnector


def make_rank(
    geometry: CacheGeometry,
    *,
    engine_id: str,
    device: torch.device,
    use_shm: bool,
    nwor: DeferredWriteManager,
    worker: WorkerConnector,
) -> Rank:
    """Allocate ``geometry``'s cache (in shm on a CPU unless ``use_shm=False``) for its TP rank."""
    tp_rank, local_heads, total_heads = geometry.tp_rank, geometry.num_kv_heads, geometry.total_num_kv_heads
    # The rank's first KV head (several ranks share one when there are more ranks than heads).
    first = tp_rank * local_heads if geometry.tp_size <= total_heads else tp_rank // (geometry.tp_size // total_heads)
    head_ids = torch.arange(first, first + local_heads, dtype=torch.int64)
    region = None
    if use_shm and device.type == "cpu":
        region = create_shm_region(geometry.total_bytes, prefix=f"kvd-ref-{engine_id}-r{tp_rank}")
        flat = region.tensor
    else:
        flat = torch.zeros(geometry.total_bytes, dtype=torch.uint8, device=device)
    caches = {layer_name(i): t for i, t in enumerate(geometry.layer_views(flat))}
    return Rank(
        tp_rank,
        geometry,
        head_ids,
        list(range(first, first + local_heads)),
        region,
        caches,
        geometry.slot_io(),
        nwor,
        worker,
    )


def is_decode(request: EngineRequest) -> bool:
    return request.num_computed_tokens >= request.num_prompt_tokens


@dataclasses.dataclass
class Batch:
    """One step's token lanes, on the device (and the lane starts on the host)."""

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


def build_batch(scheduled: list[tuple[EngineRequest, int]], block_size: int, device: torch.device) -> Batch:
    """Lay out the step's token lanes (host bookkeeping, then one transfer to the device)."""
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[np.ndarray] = []
    starts = [0]
    drafts = []
    tables = []
    for request, n in scheduled:
        start = request.num_computed_tokens
        if is_decode(request):
            lane_tokens = [request.all_token_ids[-1]] + request.draft_token_ids
            drafts.append(len(request.draft_token_ids))
        else:
            lane_tokens = request.all_token_ids[start : start + n]
            drafts.append(0)
        pos = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(request.block_ids, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tokens += lane_tokens
        positions += pos.tolist()
        starts.append(starts[-1] + n)
        tables.append(torch.as_tensor(table, device=device))
    return Batch(
        requests=scheduled,
        tokens=torch.as_tensor(tokens, dtype=torch.int64, device=device),
        positions=torch.as_tensor(positions, dtype=torch.int64, device=device),
        slots=torch.as_tensor(np.concatenate(slots), dtype=torch.int64, device=device),
        starts=torch.as_tensor(starts, dtype=torch.int32, device=device),
        starts_host=starts,
        num_scheduled=torch.as_tensor([n for _, n in scheduled], dtype=torch.int64, device=device),
        num_draft=torch.as_tensor(drafts, dtype=torch.int64, device=device),
        block_tables=tables,
        num_lanes=starts[-1],
        has_drafts=any(drafts),
    )


def forward(rank: Rank, batch: Batch, result: StepResult, *, check_kv_reads: bool, engine_id: str) -> None:
    """One rank's forward: each layer's K/V written (through NWOR), attention over the cache."""
    device = batch.tokens.device
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
            pos = torch.arange(past, device=device)
            table = batch.block_tables[i]
            b, o = table[pos // geometry.block_size], pos % geometry.block_size
            k_past, v_past = k_view[b, o], v_view[b, o]
            if check_kv_reads and past:
                _check_reads(engine_id, request, rank, layer, k_past, v_past)
            keys = torch.cat((k_past, k_new[lo:hi])).to(torch.float32)  # [S, H, D]
            values = torch.cat((v_past, v_new[lo:hi])).to(torch.float32)
            scores = torch.einsum("thd,shd->hts", q[lo:hi], keys) * scale
            causal = torch.arange(past + n, device=device)[None, :] <= (past + torch.arange(n, device=device))[:, None]
            scores = scores.masked_fill(~causal[None], float("-inf"))
            out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values)
            if rank.tp_rank == 0 and layer == geometry.num_layers - 1:
                result.attention[request.request_id] = out
        rank.worker.save_kv_layer(name, cache, None)


def _check_reads(
    engine_id: str, request: EngineRequest, rank: Rank, layer: int, k: torch.Tensor, v: torch.Tensor
) -> None:
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
            f"{engine_id} rank {rank.tp_rank} layer {layer}: request {request.request_id} read wrong KV at "
            f"positions {np.asarray(bad[:8].to('cpu'))} of {past}"
        )


# -- sampling, NWOR commit ------------------------------------------------------------------


def sample_and_commit(
    batch: Batch, ranks: Sequence[Rank], vocab_size: int, num_speculative_tokens: int
) -> tuple[AsyncHostCopy, AsyncHostCopy]:
    """Verify drafts, commit NWOR windows, hand watermarks to the workers. All device ops."""
    model = oracle_next_tokens(batch.tokens, batch.positions + 1, vocab_size)  # [T]
    width = 1 + num_speculative_tokens
    # Lane index of column j of request r: the last lane for prefill rows, start + j for decode.
    cols = torch.arange(width, device=batch.tokens.device)
    starts = batch.starts[:-1].to(torch.int64)
    decoding = batch.num_draft > 0
    last = starts + batch.num_scheduled - 1
    lane = torch.where(decoding[:, None], starts[:, None] + cols[None, :], last[:, None])
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
    for rank in ranks:
        rank.nwor.commit(mask)
        rank.worker.set_step_watermarks(ids, marks)
    return AsyncHostCopy(sampled), AsyncHostCopy(valid_count)


def new_tokens(batch: Batch, sampled: np.ndarray, valid: np.ndarray) -> list[list[int]]:
    """Host bookkeeping (the async output copy has landed): each request's new tokens."""
    out: list[list[int]] = []
    for i, (request, n) in enumerate(batch.requests):
        if not is_decode(request) and request.num_computed_tokens + n < request.num_prompt_tokens:
            out.append([])  # a partial prefill chunk: its sample is discarded
            continue
        out.append([int(t) for t in sampled[i, : int(valid[i])]])
    return out
