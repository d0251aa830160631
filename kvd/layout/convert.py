"""Conversions run after a pull's reads: staging bytes -> the local engine's blocks.

A staged read leaves, per source (remote rank), the remote's blocks in the staging chunk: the
remote's own layout and block size, restricted to the source's heads (or all the remote rank's
heads, when the planner over-read). :class:`ConvertPostprocess` re-lays them into the engine:
layout (NHD/HND), block size, head slice, with at most three vectorised torch ops per copy (one
``index_copy_``/``index_put_`` for whole blocks, plain slice copies for the partial ends), on the
device the tensors live on. Sources of a TP gather are stacked into one copy. No Python loop
per block or per token (only per layer when an engine's layers are not evenly spaced).

Both caches are seen through :class:`BlockFrame`: one strided tensor view per cache,
``[layers, planes, blocks, tokens, heads, words]`` in logical (token, head) order whatever the
physical layout, so a layout change is just a copy between two views. Bytes are moved as the
widest word (up to 16 bytes) that every offset allows: copies of 16-byte words run near memcpy
speed on the CPU where single bytes crawl.

The planner builds these objects without importing torch: torch is imported when they run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvd.layout.spec import KvLayout

if TYPE_CHECKING:
    import torch

    from kvd.layout.plan_types import EngineView

__all__ = ["BlockFrame", "ConvertPostprocess", "StagedSource", "word_size"]

_MAX_WORD = 16


def _pow2_divisor(values: Sequence[int], limit: int = _MAX_WORD) -> int:
    """Largest power of two <= limit dividing every value."""
    word = limit
    for value in values:
        while value % word:
            word //= 2
    return word


def _word_dtype(word: int) -> torch.dtype:
    """A torch dtype of ``word`` bytes whose copies move bits unchanged (moves never touch values)."""
    import torch  # noqa: PLC0415 - keep the planner torch-free

    return {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]


def word_size(tensors: Sequence[torch.Tensor], limit: int) -> int:
    """Largest word <= limit at which every tensor's address (and storage offset) is aligned."""
    return _pow2_divisor([int(v) for t in tensors for v in (t.data_ptr(), t.storage_offset())], limit)


def _as_words(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """A 1-D uint8 tensor seen as ``word``-byte elements (a trailing partial word is dropped)."""
    usable = tensor.numel() - tensor.numel() % word
    return tensor[:usable].view(_word_dtype(word))


@dataclasses.dataclass(frozen=True)
class BlockFrame:
    """Where the blocks of every (layer, plane) of a cache are: enough to view it as a tensor."""

    layout: KvLayout
    block_size: int
    num_heads: int
    head_bytes: int
    block_stride: int
    num_blocks: int
    num_layers: int
    num_planes: int
    regions: tuple[int, ...]  # per (layer, plane), layer-major
    offsets: tuple[int, ...]  # byte offset of block 0 of each (layer, plane)

    @classmethod
    def of(cls, view: EngineView) -> BlockFrame:
        spec = view.spec
        regions, offsets = [], []
        for placement in view.placements:
            for offset in spec.plane_offsets(placement):
                regions.append(placement.region)
                offsets.append(offset)
        return cls(
            layout=spec.layout,
            block_size=spec.block_size,
            num_heads=spec.num_kv_heads,
            head_bytes=spec.head_bytes_per_token,
            block_stride=spec.block_stride,
            num_blocks=spec.num_blocks,
            num_layers=spec.num_layers,
            num_planes=spec.kv_planes,
            regions=tuple(regions),
            offsets=tuple(offsets),
        )

    @property
    def word_limit(self) -> int:
        """The widest word every byte quantity of this frame is a multiple of."""
        return _pow2_divisor([self.head_bytes, self.block_stride, *self.offsets])

    def _grid(self) -> tuple[int, int] | None:
        """(layer stride, plane stride) in bytes if one region holds a regular grid, else None."""
        if len(set(self.regions)) != 1:
            return None
        base = np.asarray(self.offsets, dtype=np.int64).reshape(self.num_layers, self.num_planes)
        layer_stride = int(base[1, 0] - base[0, 0]) if self.num_layers > 1 else 0
        plane_stride = int(base[0, 1] - base[0, 0]) if self.num_planes > 1 else 0
        expect = (
            base[0, 0]
            + np.arange(self.num_layers)[:, None] * layer_stride
            + np.arange(self.num_planes)[None, :] * plane_stride
        )
        if layer_stride < 0 or plane_stride < 0 or not np.array_equal(expect, base):
            return None
        return layer_stride, plane_stride

    def views(self, words: Sequence[torch.Tensor], word: int) -> list[tuple[slice, slice, torch.Tensor]]:
        """Logical views ``[layers, planes, blocks, tokens, heads, words]`` over the regions.

        One view when the layers form a regular grid in one region (the usual allocation),
        else one view per (layer, plane); each with the layers and planes it covers.
        """
        import torch  # noqa: PLC0415

        hw = self.head_bytes // word
        if self.layout is KvLayout.NHD:
            token_stride, head_stride = self.num_heads * hw, hw
        else:
            token_stride, head_stride = hw, self.block_size * hw
        inner = (
            [self.num_blocks, self.block_size, self.num_heads, hw],
            [self.block_stride // word, token_stride, head_stride, 1],
        )
        grid = self._grid()
        if grid is not None:
            region = words[self.regions[0]]
            view = torch.as_strided(
                region,
                [self.num_layers, self.num_planes, *inner[0]],
                [grid[0] // word, grid[1] // word, *inner[1]],
                region.storage_offset() + self.offsets[0] // word,
            )
            return [(slice(None), slice(None), view)]
        out = []
        for index, (region_index, offset) in enumerate(zip(self.regions, self.offsets, strict=True)):
            layer, plane = divmod(index, self.num_planes)
            region = words[region_index]
            view = torch.as_strided(
                region, [1, 1, *inner[0]], [0, 0, *inner[1]], region.storage_offset() + offset // word
            )
            out.append((slice(layer, layer + 1), slice(plane, plane + 1), view))
        return out


@dataclasses.dataclass(frozen=True)
class StagedSource:
    """One source's bytes in staging (``frame``, region 0 = the staging chunk): its heads
    ``[staged_head0, staged_head0 + num_heads)`` of the frame land at ``local_head0`` onward
    among the local rank's heads (the frame may hold more heads: an over-read)."""

    frame: BlockFrame
    local_head0: int
    staged_head0: int
    num_heads: int


@dataclasses.dataclass(frozen=True, eq=False)
class ConvertPostprocess:
    """Staging -> engine: tokens ``[0, num_tokens)`` of every staged source into ``local_block_ids``.

    Writes exactly the pulled tokens of the source's heads: other heads, other blocks and the
    tail of a partial last block keep their bytes.
    """

    sources: tuple[StagedSource, ...]
    target: BlockFrame
    local_block_ids: np.ndarray
    num_tokens: int

    @property
    def nbytes(self) -> int:
        """Bytes the conversion writes into the engine."""
        heads = sum(source.num_heads for source in self.sources)
        return self.target.num_layers * self.target.num_planes * self.num_tokens * heads * self.target.head_bytes

    def run(self, staging: torch.Tensor, engine_regions: Sequence[torch.Tensor]) -> None:
        """Re-lay the staged bytes into the engine (torch ops on the tensors' device)."""
        import torch  # noqa: PLC0415

        limit = _pow2_divisor(
            [self.target.word_limit, *(s.frame.word_limit for s in self.sources)],
        )
        word = word_size([staging, *engine_regions], limit)
        engine_words = [_as_words(region, word) for region in engine_regions]
        staging_words = [_as_words(staging, word)]
        device = engine_regions[self.target.regions[0]].device
        ids = torch.as_tensor(self.local_block_ids, dtype=torch.int64).to(device, non_blocking=True)
        targets = self.target.views(engine_words, word)
        for staged, local_head0, heads in _stacked_sources(self.sources, staging_words, word):
            for layers, planes, target in targets:
                dst = target[:, :, :, :, local_head0 : local_head0 + heads]
                src = staged[layers, planes]
                if src.dim() == 7:  # several sources side by side: split the local heads to match
                    dst = dst.unflatten(4, (src.shape[4], src.shape[5]))
                _copy_tokens(src, dst, ids, self.local_block_ids, self.num_tokens)


def _stack_step(sources: Sequence[StagedSource]) -> int | None:
    """Bytes between consecutive sources' staging frames if they can be viewed as one, else None.

    True for the usual TP gather: equally shaped frames back to back in staging, feeding
    adjacent local heads.
    """
    if len(sources) < 2:
        return None
    first = sources[0]
    step = sources[1].frame.offsets[0] - first.frame.offsets[0]
    shape = (dataclasses.replace(first.frame, offsets=()), first.staged_head0, first.num_heads)
    for i, source in enumerate(sources):
        if (dataclasses.replace(source.frame, offsets=()), source.staged_head0, source.num_heads) != shape:
            return None
        if source.local_head0 != first.local_head0 + i * first.num_heads:
            return None
        if any(o - f != i * step for o, f in zip(source.frame.offsets, first.frame.offsets, strict=True)):
            return None
    return step if step > 0 else None


def _stacked_sources(
    sources: Sequence[StagedSource], staging_words: Sequence[torch.Tensor], word: int
) -> list[tuple[torch.Tensor, int, int]]:
    """(staging view, first local head, heads) per copy to run.

    Stackable sources (see :func:`_stack_step`) become one view
    ``[L, P, blocks, tokens, sources, heads, W]``: one op then writes whole local tokens instead
    of one narrow head slice per source, which halves the cost per byte on the CPU.
    """
    import torch  # noqa: PLC0415

    step = _stack_step(sources)
    if step is not None and step % word == 0:
        first = sources[0]
        ((_, _, view),) = first.frame.views(staging_words, word)
        size, stride = list(view.shape), list(view.stride())
        stacked = torch.as_strided(
            view, [*size[:4], len(sources), *size[4:]], [*stride[:4], step // word, *stride[4:]], view.storage_offset()
        )
        heads = slice(first.staged_head0, first.staged_head0 + first.num_heads)
        return [(stacked[:, :, :, :, :, heads], first.local_head0, len(sources) * first.num_heads)]
    out = []
    for source in sources:
        ((_, _, view),) = source.frame.views(staging_words, word)
        heads = slice(source.staged_head0, source.staged_head0 + source.num_heads)
        out.append((view[:, :, :, :, heads], source.local_head0, source.num_heads))
    return out


def _copy_tokens(
    src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, host_ids: np.ndarray, num_tokens: int
) -> None:
    """Copy tokens [0, num_tokens) from blocks 0, 1, ... of ``src`` into blocks ``ids`` of ``dst``.

    Both are ``[layers, planes, blocks, tokens, ...]`` views with the same trailing shape (heads
    and words, or sources, heads and words). Whole blocks of the smaller block size move in one
    indexed copy; the blocks of a partial larger block and the final partial block are plain
    slice copies. At most three ops, whatever the token count.
    """
    src_bs, dst_bs = src.shape[3], dst.shape[3]
    if src_bs >= dst_bs:
        ratio = src_bs // dst_bs
        full, tail = divmod(num_tokens, dst_bs)  # whole local blocks
        s = src.unflatten(3, (ratio, dst_bs))  # [L, P, src blocks, ratio, dst_bs, H, W]
        whole = full // ratio * ratio  # local blocks filled by whole remote blocks
        if whole and ratio == 1:
            dst.index_copy_(2, ids[:whole], s[:, :, :whole, 0])
        elif whole:
            dst[:, :, ids[:whole].view(whole // ratio, ratio)] = s[:, :, : whole // ratio]
        if full > whole:
            dst.index_copy_(2, ids[whole:full], s[:, :, whole // ratio, : full - whole])
        if tail:
            dst[:, :, int(host_ids[full]), :tail].copy_(s[:, :, full // ratio, full % ratio, :tail])
        return
    ratio = dst_bs // src_bs
    full, tail = divmod(num_tokens, src_bs)  # whole remote blocks
    d = dst.unflatten(3, (ratio, src_bs))  # [L, P, dst blocks, ratio, src_bs, H, W]
    whole = full // ratio  # local blocks filled entirely
    if whole:
        d.index_copy_(2, ids[:whole], src[:, :, : whole * ratio].unflatten(2, (whole, ratio)))
    if full > whole * ratio or tail:
        last = d[:, :, int(host_ids[whole])]  # [L, P, ratio, src_bs, H, W]
        if full > whole * ratio:
            last[:, :, : full - whole * ratio].copy_(src[:, :, whole * ratio : full])
        if tail:
            last[:, :, full - whole * ratio, :tail].copy_(src[:, :, full, :tail])
