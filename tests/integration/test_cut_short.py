"""Calls that change NIXL registrations, cut short by their clients, leave nothing half done.

A gRPC handler is cancelled when its client's deadline passes. RegisterKvCache and SelftestHold
map memory, register it with NIXL and prepare descriptor lists in several steps; a cancel
between two of them once left a registration over memory unmapped right after, or a list being
prepared over memory already deregistered (NIXL_ERR_NOT_FOUND, an error nobody read) and, in
one CI run, a SelftestHold answered INTERNAL (NIXL_ERR_BACKEND). Each such call now runs to its
end (kvd.core.finishing): a registration whose caller gave up is undone, a scratch hold is kept.

Real daemons, real NIXL (UCX): a storm of such calls at deadlines of 1-16 ms, several at a time,
then the daemon's log holds no NIXL error and no unread one, its state is what the last
answered calls left, and a pull after it is byte-exact.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import grpc
import pytest
from kvtest import ShmEngine, small_spec

from kvd_client.v1 import common_pb2, engine_pb2, router_pb2

pytestmark = pytest.mark.integration

CALLS = 600
DEADLINES_S = [0.001, 0.002, 0.004, 0.008, 0.016, 10.0]
# What a half-done call left in the log (the daemon's own errors; grpc's "ExecuteBatchError" when a
# reply meets a client already gone is grpc's, and says nothing of the daemon's state).
LOG_ERRORS = ("NIXL_ERR", "never retrieved", "nixlBackendError", "ERROR kvd.", "IndexError")


@pytest.mark.parametrize("transport", ["default", "tcp"])
def test_registrations_and_scratch_holds_cut_short_leave_nothing_behind(spawn_daemon, transport: str) -> None:
    env = {"UCX_TLS": "tcp"} if transport == "tcp" else None
    flags = ("--lease-ttl-s=600",)
    a = spawn_daemon(*flags, name="a", env=env)
    b = spawn_daemon(*flags, name="b", env=env)
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    churn = [ShmEngine(a.unix_target, f"churn-{i}", small_spec(num_blocks=4)) for i in range(3)]
    holder.register()
    reader.register()
    ident = lambda x: x  # noqa: E731
    channel = grpc.insecure_channel(a.unix_target)
    selftest_hold = channel.unary_unary("/kvd.v1.RouterService/SelftestHold", ident, ident)
    register = channel.unary_unary("/kvd.v1.EngineService/RegisterKvCache", ident, ident)
    unregister = channel.unary_unary("/kvd.v1.EngineService/UnregisterKvCache", ident, ident)
    rng = random.Random(20261202)

    def registration(engine: ShmEngine) -> bytes:
        return engine.registration_request(engine_pid=0).SerializeToString()  # no pid: nothing watches it

    def one_call(i: int) -> str:
        timeout = rng.choice(DEADLINES_S)
        kind = rng.random()
        try:
            if kind < 0.5:
                size = rng.choice([1, 1 << 16, 1 << 21, 3 << 21])
                request = router_pb2.SelftestHoldRequest(size_bytes=size, seed=rng.randrange(1 << 20))
                selftest_hold(request.SerializeToString(), timeout=timeout)
            elif kind < 0.8:
                register(registration(rng.choice(churn)), timeout=timeout)
            else:
                engine = rng.choice(churn)
                request = engine_pb2.UnregisterKvCacheRequest(engine_id=engine.engine_id, tp_rank=0)
                unregister(request.SerializeToString(), timeout=timeout)
            return "OK"
        except grpc.RpcError as err:
            code = err.code().name
            # A registration racing another of the same engine, or its undo: ALREADY_EXISTS and
            # NOT_FOUND are the answers a client can act on; anything else is a failure.
            assert code in {"DEADLINE_EXCEEDED", "CANCELLED", "ALREADY_EXISTS", "NOT_FOUND"}, (
                f"call {i}: {code}: {err.details()}"
            )
            return code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one_call, range(CALLS)))
    assert codes.count("DEADLINE_EXCEEDED") > CALLS // 10, "the storm must cut calls short"
    assert codes.count("OK") > CALLS // 10, "and let some finish"

    # Every cut-short call settles: then each churn engine is registered or not, whole, and
    # unregistering those left leaves the node's engines exactly as before the storm.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and holder.client.get_status().transfers_in_flight:
        time.sleep(0.05)
    time.sleep(1.0)
    for engine in churn:
        try:
            unregister(
                engine_pb2.UnregisterKvCacheRequest(engine_id=engine.engine_id, tp_rank=0).SerializeToString(),
                timeout=10,
            )
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
    engines = {e.engine_id for e in holder.client.get_status().engines}
    assert {"holder"} <= engines and not engines & {e.engine_id for e in churn}, engines

    # A real pull after the storm, bytes verified.
    holder.fill_random(7)
    reader.fill(0xAB)
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="after-storm", block_ids=[3, 4], num_tokens=25
    ).kv_transfer_params
    started = reader.client.start_pull(
        engine_id="reader", tp_rank=0, request_id="after-storm", local_block_ids=[5, 6], remote=params
    )
    assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
    assert reader.token_bytes([5, 6], 25).equal(holder.token_bytes([3, 4], 25))

    log = a.log_path.read_text(errors="replace")
    found = [line for line in log.splitlines() if any(mark in line for mark in LOG_ERRORS)]
    assert not found, "daemon a logged:\n" + "\n".join(found[:20])
    channel.close()
    for engine in (holder, reader, *churn):
        engine.close()
