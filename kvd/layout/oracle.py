"""The slow, obviously-correct reference for what a pull must produce.

It knows nothing of descriptors, runs, pieces or staging: for every (layer, plane, token, head)
it computes the byte offset straight from the layout's definition,

    block   = block_ids[token // block_size]
    slot    = token % block_size
    NHD:  plane_offset + block * block_stride + (slot * heads + head) * head_bytes
    HND:  plane_offset + block * block_stride + (head * block_size + slot) * head_bytes

and gathers (or scatters) those bytes with plain indexing. Tests compare the fast path with it
bit for bit. Logical tensors are uint8 ``[layers, kv_planes, tokens, heads, head_bytes]`` where
``heads`` are the rank's heads in order, i.e. model-global heads ``spec.head_range()``.

:func:`execute_plan` is the matching reference for the data path: it applies a PullPlan the way
the daemon does (NIXL's reads as torch byte copies, then the postprocess) and logs every byte
read and written, so tests can check plans without NIXL (and a selftest can use it too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvd.layout.geometry import DescGeometry
from kvd.layout.plan import EngineView, PullPlan, Target
from kvd.layout.spec import KvLayout

__all__ = [
    "ExecutionLog",
    "byte_offsets",
    "execute_plan",
    "gather",
    "gather_group",
    "group_tokens",
    "head_ids",
    "scatter",
    "token_mask",
]


def head_ids(view: EngineView) -> range:
    """The model-global KV heads of the rank, in the order of the logical tensor's head axis."""
    first, last = view.spec.head_range()
    return range(first, last)


def byte_offsets(view: EngineView, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
    """Offsets ``[layers, planes, tokens, heads]`` of each head vector inside its layer's region."""
    spec = view.spec
    tokens = np.arange(num_tokens, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[tokens // spec.block_size]
    slots = tokens % spec.block_size
    heads = np.arange(spec.num_kv_heads, dtype=np.int64)
    if spec.layout is KvLayout.NHD:
        within = (slots[:, None] * spec.num_kv_heads + heads[None, :]) * spec.head_bytes_per_token
    else:
        within = (heads[None, :] * spec.block_size + slots[:, None]) * spec.head_bytes_per_token
    token_base = blocks[:, None] * spec.block_stride + within  # [tokens, heads]
    planes = np.array([spec.plane_offsets(p) for p in view.placements], dtype=np.int64)  # [layers, planes]
    return planes[:, :, None, None] + token_base[None, None]


def _byte_index(offsets: np.ndarray, head_bytes: int) -> torch.Tensor:
    return torch.from_numpy(offsets[..., None] + np.arange(head_bytes, dtype=np.int64))


def gather(
    regions: Sequence[torch.Tensor], view: EngineView, block_ids: Sequence[int], num_tokens: int
) -> torch.Tensor:
    """The request's KV as a logical uint8 tensor ``[layers, planes, tokens, heads, head_bytes]``."""
    spec = view.spec
    offsets = byte_offsets(view, block_ids, num_tokens)
    layers = []
    for layer, placement in enumerate(view.placements):
        region = regions[placement.region].cpu()
        layers.append(region[_byte_index(offsets[layer], spec.head_bytes_per_token)])
    return torch.stack(layers)


def scatter(regions: Sequence[torch.Tensor], view: EngineView, block_ids: Sequence[int], logical: torch.Tensor) -> None:
    """Write a logical tensor (as :func:`gather` returns) into the engine's memory, in place."""
    spec = view.spec
    num_tokens = logical.shape[2]
    expected = (spec.num_layers, spec.kv_planes, num_tokens, spec.num_kv_heads, spec.head_bytes_per_token)
    if tuple(logical.shape) != expected:
        raise ValueError(f"logical tensor of shape {tuple(logical.shape)}, expected {expected}")
    offsets = byte_offsets(view, block_ids, num_tokens)
    for layer, placement in enumerate(view.placements):
        region = regions[placement.region]
        index = _byte_index(offsets[layer], spec.head_bytes_per_token).to(region.device)
        region[index] = logical[layer].to(region.device)


def token_mask(
    region_sizes: Sequence[int], view: EngineView, block_ids: Sequence[int], num_tokens: int
) -> list[np.ndarray]:
    """Per region, True on every byte of tokens ``[0, num_tokens)`` of the blocks (all heads)."""
    masks = [np.zeros(size, dtype=bool) for size in region_sizes]
    offsets = byte_offsets(view, block_ids, num_tokens)
    index = offsets[..., None] + np.arange(view.spec.head_bytes_per_token, dtype=np.int64)
    for layer, placement in enumerate(view.placements):
        masks[placement.region][index[layer].reshape(-1)] = True
    return masks


# --- KV cache groups (hybrid models): what each group's pull must produce ----------------------


def group_tokens(view: EngineView, block_ids: Sequence[int], num_tokens: int) -> tuple[int, int]:
    """``(first, last)``: the tokens a request's blocks in this group hold, by the group's kind.

    FULL_ATTENTION: ``[0, num_tokens)``. SLIDING_WINDOW: the block ids are the tail of the
    blocks of ``[0, num_tokens)``, so ``[(blocks - len(ids)) * block_size, num_tokens)``. STATE:
    one "token" per state block, ``[0, len(ids))`` (the state after all ``num_tokens``).
    """
    from kvd_client.v1.schema import KvGroupKind  # noqa: PLC0415

    if view.kind is KvGroupKind.STATE:
        return 0, len(block_ids)
    if view.kind is KvGroupKind.SLIDING_WINDOW:
        return (view.spec.blocks_for(num_tokens) - len(block_ids)) * view.spec.block_size, num_tokens
    return 0, num_tokens


def gather_group(
    regions: Sequence[torch.Tensor], view: EngineView, block_ids: Sequence[int], num_tokens: int, first: int = -1
) -> torch.Tensor:
    """The request's bytes in one group, tokens ``[first, last)`` of :func:`group_tokens` (or from
    ``first`` when given, a block boundary inside the group's span), as :func:`gather` lays them out."""
    start, last = group_tokens(view, block_ids, num_tokens)
    first = start if first < 0 else first
    bs = view.spec.block_size
    assert first % bs == 0 and first >= start, "first must be a block boundary inside the group's span"
    skip = (first - start) // bs
    return gather(regions, view, list(block_ids)[skip:], last - first)


# --- a reference executor: what NIXL and the daemon do with a plan, in plain byte copies ---------

REGION_SHIFT = 40  # region i is "at address" i << REGION_SHIFT, so a row's address names its region


@dataclasses.dataclass
class ExecutionLog:
    """What a reference execution touched, for tests to check plans against."""

    # Per remote rank, per region: True on every byte some read came from.
    remote_read: dict[int, list[np.ndarray]]
    # Per local engine region: how many reads wrote each byte (a plan writes each byte once).
    engine_writes: list[np.ndarray]
    staging_writes: np.ndarray
    descriptors: int = 0


def _rows(geometry: DescGeometry, indices: np.ndarray, num_regions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = geometry.rows_for(indices, [i << REGION_SHIFT for i in range(num_regions)])
    return rows[:, 0] >> REGION_SHIFT, rows[:, 0] & ((1 << REGION_SHIFT) - 1), rows[:, 1]


def _expand(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Byte indices of the ranges [offset, offset + length), concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(offsets - (np.cumsum(lengths) - lengths), lengths)
    return starts + np.arange(total, dtype=np.int64)


def execute_plan(
    plan: PullPlan,
    remote_regions: Mapping[int, Sequence[torch.Tensor]],
    local_regions: Sequence[torch.Tensor],
    staging: torch.Tensor | None = None,
) -> ExecutionLog:
    """Apply ``plan`` the way the daemon does, with torch byte copies standing in for NIXL.

    For each ReadGroup piece j of the remote table is copied to piece j of the local table
    (engine regions, or ``staging`` for Target.STAGING), then the postprocess runs. Raises
    AssertionError on pieces of different lengths, or pieces outside their region or staging.
    """
    if staging is None:
        staging = torch.randint(0, 256, (plan.staging_bytes,), dtype=torch.uint8)
    log = ExecutionLog(
        remote_read={
            rank: [np.zeros(r.numel(), dtype=bool) for r in regions] for rank, regions in remote_regions.items()
        },
        engine_writes=[np.zeros(r.numel(), dtype=np.int64) for r in local_regions],
        staging_writes=np.zeros(staging.numel(), dtype=np.int64),
    )
    for group in plan.reads:
        sources = remote_regions[group.remote_rank]
        s_region, s_off, s_len = _rows(group.remote_geometry, group.remote_indices, len(sources))
        if group.local_target is Target.ENGINE:
            targets, writes = list(local_regions), log.engine_writes
        else:
            targets, writes = [staging], [log.staging_writes]
        d_region, d_off, d_len = _rows(group.local_geometry, group.local_indices, len(targets))
        if group.local_target is Target.STAGING:
            d_off = d_off + group.staging_offset  # several groups stage side by side
        assert np.array_equal(s_len, d_len), "a piece's remote and local lengths differ"
        assert int(s_len.sum()) == group.nbytes, "a group's nbytes disagrees with its pieces"
        log.descriptors += int(s_len.size)
        for src in np.unique(s_region):
            for dst in np.unique(d_region):
                pick = (s_region == src) & (d_region == dst)
                if not pick.any():
                    continue
                src_index = _expand(s_off[pick], s_len[pick])
                dst_index = _expand(d_off[pick], d_len[pick])
                assert src_index.max() < sources[src].numel(), "a read past the end of a remote region"
                assert dst_index.max() < targets[dst].numel(), "a write past the end of its region"
                log.remote_read[group.remote_rank][src][src_index] = True
                np.add.at(writes[dst], dst_index, 1)
                target, source = targets[dst], sources[src]
                values = source[torch.from_numpy(src_index).to(source.device)]
                target[torch.from_numpy(dst_index).to(target.device)] = values.to(target.device)
    if plan.postprocess is not None:
        plan.postprocess.run(staging, list(local_regions))
    return log
