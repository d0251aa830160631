"""A lease as kvd's services describe it to their callers (``common.LeaseInfo``)."""

from __future__ import annotations

from kvd.core.daemon import Daemon
from kvd.core.leases import Lease
from kvd_client.v1 import common_pb2


def lease_to_pb(daemon: Daemon, lease: Lease) -> common_pb2.LeaseInfo:
    """A lease as the engine (HoldBlocks) and routers (RenewLease) are told of it."""
    params = daemon.params_of(lease)
    return common_pb2.LeaseInfo(
        lease_id=lease.lease_id,
        engine_id=lease.engine_id,
        request_id=lease.request_id,
        block_ids=list(lease.block_ids),
        num_tokens=lease.num_tokens,
        expires_unix_ms=params.lease_expires_unix_ms,
        group_block_ids=list(params.group_block_ids),
        group_block_counts=list(params.group_block_counts),
    )
