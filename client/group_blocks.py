"""Per-group block ids on the wire: one flat list plus per-group counts.

A hybrid model's request has one block list per KV cache group. Group 0's list stays in the
messages' ``block_ids`` (so single-group engines and callers never see groups); groups 1 and up
travel flattened in ``group_block_ids`` with their lengths in ``group_block_counts``, which keeps
:class:`kvd_client.v1.schema.KvTransferParams` a flat record (and ``kv_transfer_params`` plain
JSON). Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd_client.errors import InvalidArgument

__all__ = ["flatten_groups", "split_groups"]


def flatten_groups(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(ids, counts)`` for the wire, from groups 1.. (group 0 is not included)."""
    ids = tuple(int(b) for group in groups for b in group)
    return ids, tuple(len(group) for group in groups)


def split_groups(
    ids: Sequence[int], counts: Sequence[int], what: str = "group block ids"
) -> tuple[tuple[int, ...], ...]:
    """The per-group lists back from the wire; InvalidArgument if the counts do not add up."""
    if sum(counts) != len(ids):
        raise InvalidArgument(
            f"{what}: group_block_counts {list(counts)[:8]} add up to {sum(counts)}, "
            f"but {len(ids)} group_block_ids were given"
        )
    out: list[tuple[int, ...]] = []
    start = 0
    for count in counts:
        out.append(tuple(int(b) for b in ids[start : start + count]))
        start += count
    return tuple(out)
