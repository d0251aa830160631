"""A step's READs from one holder engine, posted as one NIXL transfer with one notification.

An engine step starts many pulls at once (StartPulls), and most of them read from the same
holder engine rank into the same local engine rank: the same two prepared descriptor lists. Each
pull used to be its own NIXL transfer: one ``make_prepped_xfer``, one post, one poll, one
notification to the holder, and one descriptor per block per layer, since a pull of one block
has nothing adjacent to merge with. On shared memory UCX pays ~2-4 us per descriptor inside the
post, on the one thread that posts: a step of 32 one-block pulls of a 32-layer model was 2,048
descriptors of 32 KiB, more time in the post than the bytes' own copy.

Here the READs that :class:`kvd.core.read_batches.ReadBatcher` collects in one turn of the event
loop are grouped by (local list, remote list, peer, both geometries), and each group of two or
more becomes one READ (:func:`combine`):

* its descriptor pairs are the group's pairs, each expanded to units, sorted by plane and
  unit, and cut again into the longest runs the two lists hold (:func:`merge_indices`): blocks
  adjacent on both sides across pulls become one descriptor per plane, as within one pull;
* its notification names every read it carries (:func:`kvd.core.notif.encode_many`), so the
  holder counts each pull's part as if it had come alone. It is sent only to a holder that
  decodes it (``RemoteEngine.step_notifications``): the pull says so by giving its part;
* every pull keeps its own :class:`~kvd.dataplane_protocol.Xfer`, settled with the step READ's
  outcome (:class:`kvd.core.dataplane.DataPlane` maps the one to the many). The pulls share the
  READ's fate, and nothing else: each has its own admission, fence, pins, lease and report.

Sharing the fate is sound for the same reason a lone READ's failure is: a failed READ fails the
pulls it carried and their blocks are recomputed (docs/lifetimes.md, "A step's READs"). Pure
numpy and bookkeeping; event-loop only where it is called.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvd.core import notif
from kvd.dataplane_protocol import ReadOrder
from kvd.layout.geometry import DescGeometry, split_runs


class StepPart(NamedTuple):
    """What lets a READ join a step's READ: the geometries of its two lists (to merge runs) and
    its own notification (to be named in the step's). Given by the pull, never sent."""

    local_geometry: DescGeometry
    remote_geometry: DescGeometry
    # None: the READ notifies no one (its read ends with a FinishRead: kvd.core.pull_reads).
    notification: notif.ReadNotification | None


class Queued(NamedTuple):
    """A READ waiting for the end of the loop turn: the order, its waiter, its StepPart if any."""

    order: ReadOrder
    future: asyncio.Future[Any]
    part: StepPart | None


class Posting(NamedTuple):
    """One READ to send: a lone order with its one waiter, or a step's READ with every waiter of
    the orders it carries (``merged``: their ``xfer_id`` s, in the waiters' order)."""

    order: ReadOrder
    futures: tuple[asyncio.Future[Any], ...]
    merged: tuple[int, ...] = ()


STEP_READ_MAX_BYTES = 64 << 20
"""Most bytes one step READ carries: a READ that would take it past this starts the next one (a
READ this large alone goes alone). Every READ a step READ carries is final only when all of it
is, so a small pull beside a large one would otherwise wait for the large one's bytes; and past
a few MiB per READ the per-transfer and per-descriptor costs that merging saves are small."""


def combine(
    queued: Sequence[Queued], next_xfer_id: Callable[[], int], most: int, most_bytes: int = STEP_READ_MAX_BYTES
) -> list[Posting]:
    """The READs of one loop turn as postings: orders that can share a NIXL transfer (the same
    two lists, peer and geometries, each with a StepPart) in groups of at most ``most`` READs
    and ``most_bytes`` bytes, every other order alone. Order of first appearance is kept."""
    postings: list[Posting | list[Queued]] = []
    groups: dict[tuple[Any, ...], tuple[list[Queued], int]] = {}
    for item in queued:
        part = item.part
        order = item.order
        if part is None or order.nbytes >= most_bytes:
            postings.append(Posting(order, (item.future,)))
            continue
        key = (order.local_table, order.remote_table, order.peer, part.local_geometry, part.remote_geometry)
        group, nbytes = groups.get(key, (None, 0))
        if group is None or len(group) >= most or nbytes + order.nbytes > most_bytes:
            group, nbytes = [], 0
            postings.append(group)
        group.append(item)
        groups[key] = (group, nbytes + order.nbytes)
    out: list[Posting] = []
    for posting in postings:
        if isinstance(posting, Posting):
            out.append(posting)
        elif len(posting) == 1:
            out.append(Posting(posting[0].order, (posting[0].future,)))
        else:
            out.append(_step_read(posting, next_xfer_id()))
    return out


def _step_read(group: Sequence[Queued], xfer_id: int) -> Posting:
    first = group[0]
    assert first.part is not None
    local_geo, remote_geo = first.part.local_geometry, first.part.remote_geometry
    local_idx, remote_idx = merge_indices(
        local_geo, remote_geo, [q.order.local_indices for q in group], [q.order.remote_indices for q in group]
    )
    named = [q.part.notification for q in group if q.part is not None and q.part.notification is not None]
    message = notif.encode_many(named) if named else b""
    order = first.order._replace(
        xfer_id=xfer_id,
        local_indices=local_idx,
        remote_indices=remote_idx,
        notif=message,
        nbytes=sum(q.order.nbytes for q in group),
    )
    return Posting(order, tuple(q.future for q in group), tuple(q.order.xfer_id for q in group))


def merge_indices(
    local_geo: DescGeometry,
    remote_geo: DescGeometry,
    local_parts: Sequence[np.ndarray],
    remote_parts: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """One pair of index arrays reading every pair of the parts, adjacent units merged into the
    longest runs both lists hold (int32 for NIXL).

    Each descriptor pair reads ``2**k`` units on both sides (a pull's plan cuts matching runs);
    the pairs are expanded to unit pairs, sorted by (local plane, remote plane, local unit), and
    cut again with :func:`kvd.layout.geometry.split_runs`, planes kept apart. Where the two sides'
    units differ in size, or a pair's run lengths differ, the parts are concatenated as they are
    (one transfer still, no merging)."""
    local = np.concatenate(local_parts).astype(np.int64, copy=False)
    remote = np.concatenate(remote_parts).astype(np.int64, copy=False)
    max_log2 = min(local_geo.max_run_log2, remote_geo.max_run_log2)
    if local_geo.unit_bytes != remote_geo.unit_bytes or max_log2 == 0:
        return local.astype(np.int32), remote.astype(np.int32)
    l_plane, l_unit, l_log2 = local_geo.runs_at(local)
    r_plane, r_unit, r_log2 = remote_geo.runs_at(remote)
    if not np.array_equal(l_log2, r_log2):
        return local.astype(np.int32), remote.astype(np.int32)
    lengths = np.int64(1) << l_log2
    which = np.repeat(np.arange(lengths.size), lengths)
    step = np.arange(which.size, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    l_plane, r_plane = l_plane[which], r_plane[which]
    l_unit, r_unit = l_unit[which] + step, r_unit[which] + step
    order = np.lexsort((r_unit, l_unit, r_plane, l_plane))
    l_plane, r_plane, l_unit, r_unit = l_plane[order], r_plane[order], l_unit[order], r_unit[order]
    # Units of different planes (or plane pairs) are never adjacent: each plane pair gets its own
    # stretch of a line, one unit apart from the next stretch.
    pair = np.concatenate(([0], np.cumsum((np.diff(l_plane) != 0) | (np.diff(r_plane) != 0))))
    l_span, r_span = local_geo.num_units + 1, remote_geo.num_units + 1
    l_start, r_start, log2_len, _ = split_runs(pair * l_span + l_unit, pair * r_span + r_unit, max_log2)
    l_pair, r_pair = l_start // l_span, r_start // r_span
    first_of_pair = np.searchsorted(pair, np.arange(pair[-1] + 1))
    return (
        local_geo.index(l_plane[first_of_pair][l_pair], l_start - l_pair * l_span, log2_len),
        remote_geo.index(r_plane[first_of_pair][r_pair], r_start - r_pair * r_span, log2_len),
    )
