"""A reader's PreparePull checked against the lease it names, before anything is admitted.

Pure checks, shared by the holder's two ways of admitting a read (:meth:`kvd.core.holder.Holder.prepare_pull`,
awaited, and ``prepare_pull_now``, in the turn the call is read): the same request gets the same
error whichever way it came, and nothing is changed by a refusal. Event-loop only (it reads the
lease table and the registry).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.config import KvdConfig
from kvd.core import notif
from kvd.core.leases import Lease, LeaseTable
from kvd.core.peers import PrepareRequest
from kvd.core.registry import Registry
from kvd.layout import groups as kv_groups
from kvd_client.errors import InvalidArgument, UnsupportedModelFeature


def checked_read(request: PrepareRequest, leases: LeaseTable, registry: Registry, config: KvdConfig) -> Lease:
    """The lease ``request`` may read, the request checked against it (InvalidArgument, or the
    lease table's and the model's own errors, naming what to change)."""
    lease_id, engine_id, block_ids = request.lease_id, request.engine_id, request.block_ids
    num_tokens, read_id = request.num_tokens, request.read_id
    reader_tp_rank, reader_tp_size = request.reader_tp_rank, request.reader_tp_size
    if read_id and not notif.valid_read_id(read_id):
        raise InvalidArgument(
            f"read id {read_id[:80]!r} is not 1-{notif.READ_ID_MAX} characters of letters, digits, '.', '_', '-'"
        )
    lease = leases.get(lease_id)
    if lease.engine_id != engine_id:
        raise InvalidArgument(f"lease {lease_id!r} holds engine {lease.engine_id!r}, not {engine_id!r}")
    if tuple(block_ids) != lease.block_ids[: len(block_ids)] or not block_ids:
        raise InvalidArgument(f"block ids {list(block_ids)[:8]} are not a prefix of lease {lease_id!r}'s blocks")
    if not 1 <= num_tokens <= lease.num_tokens:
        raise InvalidArgument(f"the read asks for {num_tokens} tokens, lease {lease_id!r} holds {lease.num_tokens}")
    _check_group_read(lease, request.group_block_ids, num_tokens, registry)
    hold_s = hold_seconds(request, config)
    if hold_s > config.max_lease_ttl_s:
        raise InvalidArgument(
            f"the read asks to be admitted for {hold_s:.1f}s, longer than max_lease_ttl_s "
            f"{config.max_lease_ttl_s}s: use a shorter pull deadline"
        )
    if reader_tp_size < 1 or not 0 <= reader_tp_rank < reader_tp_size:
        raise InvalidArgument(f"reader tp_rank {reader_tp_rank} / tp_size {reader_tp_size} is not a rank")
    if lease.reader_tp_size and lease.reader_tp_size != reader_tp_size:
        raise InvalidArgument(
            f"lease {lease_id!r} is being read by a TP-{lease.reader_tp_size} engine, not TP-{reader_tp_size}"
        )
    return lease


def hold_seconds(request: PrepareRequest, config: KvdConfig) -> float:
    """How long the read asks to be admitted: its own deadline, else the daemon's."""
    return request.read_timeout_s or config.transfer_deadline_s


def _check_group_read(
    lease: Lease, group_block_ids: Sequence[Sequence[int]], num_tokens: int, registry: Registry
) -> None:
    """A read of a hybrid model's lease reads the lease's own group blocks, all its tokens."""
    if tuple(tuple(ids) for ids in group_block_ids) != lease.group_block_ids:
        raise InvalidArgument(
            f"the read names {len(group_block_ids)} KV cache groups' block ids that are not lease "
            f"{lease.lease_id!r}'s ({len(lease.group_block_ids)} groups after group 0)"
        )
    if not lease.group_block_ids or num_tokens == lease.num_tokens:
        return
    ranks = registry.ranks_of(lease.engine_id)
    for index, group in enumerate(next(iter(ranks.values())).groups) if ranks else ():
        if group.kind is not kv_groups.KvGroupKind.FULL_ATTENTION:
            raise UnsupportedModelFeature(
                f"{kv_groups.describe_group(index, group)}: a {group.kind.name.lower()} group holds the state "
                f"after all {lease.num_tokens} held tokens; a read of {num_tokens} tokens cannot use it"
            )
