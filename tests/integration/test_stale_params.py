"""A pull with a lease's params after the lease ended and its engine's memory was let go.

A router may retry an old request: its params name a lease that was released and a registration
the holder has since unregistered, while the reader's cached handshake still names that memory.
The reader posts its READ beside the admission (the default), so the READ leaves before the
holder can refuse the lease. Unmapped, that memory made the READ fail on the serving side (CMA:
EFAULT, "Unexpected UCX error: Input/output error"), which broke the UCX connection it travelled
on: every later pull between the two daemons failed (REMOTE_DISCONNECT), and where both engines
were on one daemon, its own loopback endpoint broke and every later registration failed
(INTERNAL, NIXL_ERR_BACKEND: the fuzz test's failure in CI). Memory a holder lets go now stays
readable (zeros) for the early-read window its handshake announced (docs/lifetimes.md).

Real daemons, real NIXL (UCX), both transports: the stale pull fails with UnknownLease and
changes nothing; the next pull is byte-exact; a new registration on either daemon works.
"""

from __future__ import annotations

import pytest
from kvtest import ShmEngine, engine_pair, small_spec

from kvd.layout.spec import LayoutSpec
from kvd.spawn import DaemonProcess
from kvd_client.errors import UnknownLease
from kvd_client.v1 import common_pb2

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transport", ["default", "tcp"])
@pytest.mark.parametrize("where", ["two daemons", "one daemon"])
def test_a_pull_of_an_ended_lease_whose_memory_was_let_go_fails_alone(spawn_daemon, where: str, transport: str) -> None:
    env = {"UCX_TLS": "tcp"} if transport == "tcp" else None
    a = spawn_daemon(name="a", env=env)
    b = a if where == "one daemon" else spawn_daemon(name="b", env=env)
    spec = small_spec(num_blocks=16)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=1) as (holder, reader):
        _stale_pull_fails_alone(a, b, spec, holder, reader)


def _stale_pull_fails_alone(
    a: DaemonProcess, b: DaemonProcess, spec: LayoutSpec, holder: ShmEngine, reader: ShmEngine
) -> None:
    def pull(params: common_pb2.KvTransferParams, request_id: str) -> common_pb2.TransferStatus:
        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id=request_id, local_block_ids=[0, 1], remote=params
        )
        return reader.client.wait_transfer(started.transfer_id, timeout_s=30)

    def hold(request_id: str) -> common_pb2.KvTransferParams:
        return holder.client.hold_blocks(
            engine_id="holder", request_id=request_id, block_ids=[2, 3], num_tokens=32, ttl_ms=600_000
        ).kv_transfer_params

    assert pull(hold("first"), "first").state == common_pb2.TRANSFER_STATE_DONE  # the handshake is cached
    stale = hold("stale")
    holder.client.release_lease(lease_id=stale.lease_id)
    holder.client.unregister_kv_cache(engine_id="holder", tp_rank=0)  # its memory is let go

    with pytest.raises(UnknownLease):
        pull(stale, "stale")

    holder.register()
    holder.fill_random(2)
    status = pull(hold("after"), "after")
    assert status.state == common_pb2.TRANSFER_STATE_DONE, status
    assert reader.token_bytes([0, 1], 32).equal(holder.token_bytes([2, 3], 32))
    for target, name in ((a.unix_target, "late-a"), (b.unix_target, "late-b")):
        late = ShmEngine(target, name, spec)
        try:
            late.register()  # the daemon's own NIXL agent still registers memory
        finally:
            late.close()
    for daemon in {a.name: a, b.name: b}.values():
        log = daemon.log_path.read_text()
        assert "Input/output error" not in log and "NIXL_ERR_BACKEND" not in log, daemon.name
