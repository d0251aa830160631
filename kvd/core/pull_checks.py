"""The checks of a pull's order before anything starts (one part of :class:`kvd.core.pulls.Puller`):
the holder's params name a holder, a lease and tokens; the local blocks are the rank's and as many
as the tokens need, in every KV cache group; the deadline is not negative. A failed check is
INVALID_ARGUMENT naming what to fix, and nothing has started. Pure: no state, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from kvd.core.params import TransferParams
from kvd.core.registry import EngineRank
from kvd.layout import groups as kv_groups
from kvd_client.errors import InvalidArgument


def check_order(
    rank: EngineRank,
    remote: TransferParams,
    local_block_ids: Sequence[int],
    local_group_block_ids: Sequence[Sequence[int]],
    deadline_s: float,
) -> None:
    """Raise InvalidArgument unless a pull of ``remote`` into ``rank`` may start as asked."""
    if not remote.daemon_address:
        raise InvalidArgument("kv_transfer_params.daemon_address is empty: which daemon holds the KV?")
    if not remote.lease_id:
        raise InvalidArgument("kv_transfer_params.lease_id is empty: the holder must hold the blocks first")
    if not remote.engine_id:
        raise InvalidArgument("kv_transfer_params.engine_id is empty")
    if remote.num_tokens < 1:
        raise InvalidArgument(f"kv_transfer_params.num_tokens must be >= 1, got {remote.num_tokens}")
    need = rank.spec.blocks_for(remote.num_tokens)
    if len(local_block_ids) != need:
        raise InvalidArgument(
            f"{remote.num_tokens} tokens need {need} local blocks of {rank.spec.block_size} tokens, "
            f"got {len(local_block_ids)} local block ids"
        )
    rank.spec.validate_block_ids(local_block_ids, "local block ids")
    tables = kv_groups.num_tables(rank.groups)
    if len(local_group_block_ids) != tables - 1:
        raise InvalidArgument(
            f"engine {rank.engine_id!r} has {len(rank.groups)} KV cache groups over {tables} block tables: a pull "
            f"needs {tables - 1} local block id lists after local_block_ids, got {len(local_group_block_ids)}"
        )
    for index, group in enumerate(rank.groups):
        table = kv_groups.table_of(index, group)
        if table == 0:
            continue
        ids = local_group_block_ids[table - 1]
        if not ids:
            raise InvalidArgument(f"{kv_groups.describe_group(index, group)}: no local block ids")
        group.spec.validate_block_ids(ids, f"{kv_groups.describe_group(index, group)} local block ids")
    if deadline_s < 0:
        raise InvalidArgument(f"deadline must be >= 0, got {deadline_s}")
