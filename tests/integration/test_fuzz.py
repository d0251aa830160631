"""Fuzz every RPC and the engine stream of two real daemons: >= 10,000 calls.

Random fields with boundary values (0, 2^32-1, 2^63, 2^64-1, empty and 1 MiB strings, ids that
exist), huge repeated fields, garbage and truncated bytes, streams in the wrong order or closed
early. For every call: the daemon is alive, the status is one of the precise codes (never
UNKNOWN or INTERNAL, never RESOURCE_EXHAUSTED from an echoed input), and when the call failed,
the state seen through GetStatus / LookupHeld is what it was before. A real pull, bytes
verified, works after the fuzz. The counts by status are printed (``-s``) for the record.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from kvtest import ShmEngine, small_spec

from kvd.server import convert
from kvd_client import grpc_errors
from kvd_client.v1 import common_pb2, engine_pb2, peer_pb2, router_pb2

pytestmark = pytest.mark.integration

CALLS = int(os.environ.get("FUZZ_CALLS", "10000"))
SEED = int(os.environ.get("FUZZ_SEED", "20261124"))
PRECISE = {
    "OK",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "OUT_OF_RANGE",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "ABORTED",
    "CANCELLED",
}
"""Codes a bad input may get. UNAVAILABLE: a pull naming an unreachable peer; DEADLINE_EXCEEDED and
CANCELLED: the fuzzer's own short deadlines and early closes (counted separately)."""

READ_ONLY = {"GetStatus", "LookupHeld", "GetTransfer", "WatchTransfer", "WatchTransfers", "Handshake"}

U32 = [0, 1, 2, 15, 16, 17, 31, 32, 33, 2**31 - 1, 2**31, 2**32 - 1]
U64 = [*U32, 2**53, 2**63 - 1, 2**63, 2**64 - 1]
I64 = [-(2**63), -1, 0, 1, 2**62, 2**63 - 1]


class Fuzzer:
    def __init__(self, rng: random.Random, ids: list[str]) -> None:
        self.rng = rng
        self.ids = ids

    def string(self) -> str:
        r = self.rng.random()
        if r < 0.45:
            return self.rng.choice(self.ids)
        if r < 0.6:
            return ""
        if r < 0.7:
            return "".join(self.rng.choice("abc-_/.:%\x00é\u2603") for _ in range(self.rng.randint(1, 40)))
        if r < 0.8:
            return self.rng.choice(["../etc/passwd", "127.0.0.1:1", "localhost:0", "[::1]:99999", "x" * 255])
        if r < 0.98:
            return "y" * self.rng.choice([4096, 4097, 20000])
        return "z" * (1 << 20)  # 1 MiB: never echoed whole

    def scalar(self, field: FieldDescriptor) -> Any:
        t = field.type
        if t == FieldDescriptor.TYPE_STRING:
            return self.string()
        if t == FieldDescriptor.TYPE_BYTES:
            return self.rng.randbytes(self.rng.choice([0, 1, 16, 64, 1000]))
        if t == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if t == FieldDescriptor.TYPE_ENUM:
            return self.rng.choice([v.number for v in field.enum_type.values] + [99, -1])
        if t == FieldDescriptor.TYPE_UINT32:
            return self.rng.choice(U32) if self.rng.random() < 0.8 else self.rng.randrange(64)
        if t == FieldDescriptor.TYPE_UINT64:
            return self.rng.choice(U64) if self.rng.random() < 0.8 else self.rng.randrange(1 << 20)
        if t == FieldDescriptor.TYPE_INT64:
            return self.rng.choice(I64)
        if t == FieldDescriptor.TYPE_DOUBLE:
            return self.rng.choice([0.0, -1.0, float("inf"), float("nan"), 1e308])
        raise AssertionError(f"no generator for field type {t}")

    def message(self, descriptor: Descriptor, cls: type[Message] | None = None, depth: int = 0) -> Message:
        from google.protobuf import message_factory

        msg = (cls or message_factory.GetMessageClass(descriptor))()
        for field in descriptor.fields:
            if self.rng.random() < 0.35:
                continue
            repeated = field.is_repeated
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if depth >= 3:
                    continue
                if repeated:
                    for _ in range(self.rng.choice([0, 1, 2, 3, 40])):
                        getattr(msg, field.name).add().CopyFrom(self.message(field.message_type, None, depth + 1))
                else:
                    getattr(msg, field.name).CopyFrom(self.message(field.message_type, None, depth + 1))
            elif repeated:
                n = self.rng.choice([0, 1, 2, 3, 17, 1000] + ([(1 << 20) + 1] if self.rng.random() < 0.005 else []))
                if field.type == FieldDescriptor.TYPE_STRING:
                    getattr(msg, field.name).extend(self.string() for _ in range(min(n, 50)))
                elif n > 1000:
                    getattr(msg, field.name).extend(range(n))
                else:
                    getattr(msg, field.name).extend(self.scalar(field) for _ in range(n))
            else:
                with contextlib.suppress(ValueError):  # e.g. a negative enum: protobuf refuses to build it
                    setattr(msg, field.name, self.scalar(field))
        return msg

    def mutate(self, template: Message) -> Message:
        """A valid request with one or two fields replaced by fuzzed values (reaches deep paths)."""
        msg = type(template)()
        msg.CopyFrom(template)
        # engine_pid stays unset: a registration of a random pid that succeeds would be released
        # later, when the daemon notices that pid is gone (a change no failed call made).
        fields = [f for f in msg.DESCRIPTOR.fields if f.type != FieldDescriptor.TYPE_MESSAGE and f.name != "engine_pid"]
        for field in self.rng.sample(fields, min(len(fields), self.rng.choice([1, 1, 2]))):
            msg.ClearField(field.name)
            if self.rng.random() < 0.2:
                continue  # left unset
            if field.is_repeated:
                getattr(msg, field.name).extend(self.scalar(field) for _ in range(self.rng.choice([0, 1, 2, 5, 40])))
            else:
                with contextlib.suppress(ValueError):
                    setattr(msg, field.name, self.scalar(field))
        return msg

    def payload(self, cls: type[Message], template: Message | None = None) -> bytes:
        r = self.rng.random()
        if template is not None and r < 0.3:
            return self.mutate(template).SerializeToString()
        if r < 0.65:
            return self.message(cls.DESCRIPTOR, cls).SerializeToString()
        if r < 0.85:
            return self.rng.randbytes(self.rng.choice([1, 2, 7, 64, 500]))
        whole = self.message(cls.DESCRIPTOR, cls).SerializeToString()
        return whole[: self.rng.randrange(len(whole))] if whole else b"\xff"


def _methods() -> list[tuple[str, Any]]:
    out = []
    for module in (engine_pb2, peer_pb2, router_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                out.append((f"/{service.full_name}/{method.name}", method))
    return out


def _cls(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def holder_layout(engine: ShmEngine) -> common_pb2.KvLayoutSpec:
    return convert.layout_to_pb(engine.spec)


@pytest.fixture
def fuzz_pair(spawn_daemon) -> Iterator[tuple[Any, Any, ShmEngine, ShmEngine]]:
    # Long leases: nothing the fuzz did not do may change the state it compares.
    flags = ("--lease-ttl-s=600", "--commit-wait-s=0.2", "--transfer-deadline-s=3", "--handshake-timeout-s=2")
    a, b = spawn_daemon(*flags, name="a"), spawn_daemon(*flags, name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    holder.register()
    reader.register()
    yield a, b, holder, reader
    holder.close()
    reader.close()


def test_fuzz_every_rpc_and_the_stream(fuzz_pair) -> None:
    a, b, holder, reader = fuzz_pair
    rng = random.Random(SEED)
    lease = holder.client.hold_blocks(
        engine_id="holder", request_id="kept", block_ids=[4, 5], num_tokens=20, ttl_ms=600_000
    )
    ids = ["holder", "reader", "nosuch", lease.lease.lease_id, "kept", a.tcp, b.tcp, a.incarnation, "selftest"]
    fuzz = Fuzzer(rng, ids)
    channels = {
        ("a", "unix"): grpc.insecure_channel(a.unix_target),
        ("a", "tcp"): grpc.insecure_channel(a.tcp),
        ("b", "unix"): grpc.insecure_channel(b.unix_target),
        ("b", "tcp"): grpc.insecure_channel(b.tcp),
    }
    engines = {"a": holder, "b": reader}
    daemons = {"a": a, "b": b}
    ident = lambda x: x  # noqa: E731

    def snapshot(node: str) -> tuple:
        ch = channels[(node, "unix")]
        status = router_pb2.GetStatusResponse.FromString(
            ch.unary_unary("/kvd.v1.RouterService/GetStatus", ident, ident)(b"", timeout=10)
        )
        held = router_pb2.LookupHeldResponse.FromString(
            ch.unary_unary("/kvd.v1.RouterService/LookupHeld", ident, ident)(b"", timeout=10)
        )
        # Leases a successful fuzzed hold took with a short TTL expire on their own: only leases with
        # a minute or more left are compared (none of them can end without a call ending it).
        horizon = time.time() * 1000 + 60_000
        return (
            sorted((e.engine_id, e.tp_rank, e.registered_bytes) for e in status.engines),
            sorted(p.lease_id for p in held.held if p.lease_expires_unix_ms > horizon),
        )

    def finishing(node: str) -> int:
        ch = channels[(node, "unix")]
        status = router_pb2.GetStatusResponse.FromString(
            ch.unary_unary("/kvd.v1.RouterService/GetStatus", ident, ident)(b"", timeout=10)
        )
        return status.finishing_calls

    def settled(node: str) -> tuple:
        """The state once the calls cut short have finished: none still running (a call that
        reached the daemon after its client gave up runs too, hence twice, 50 ms apart)."""
        previous, deadline = None, time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if finishing(node):
                previous = None
                continue
            current = snapshot(node)
            if current == previous:
                return current
            previous = current
        raise AssertionError(f"{node}: calls cut short still running after 15 s ({finishing(node)})")

    def restore(node: str) -> None:
        """A successful fuzz call may unregister the test's engine: register it again."""
        engine = engines[node]
        status = engine.client.get_status()
        if not any(e.engine_id == engine.engine_id for e in status.engines):
            engine.register()

    def wait_transfers(node: str) -> None:
        deadline = time.monotonic() + 15
        while engines[node].client.get_status().transfers_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)

    def stream_messages() -> Iterator[bytes]:
        kind = rng.random()
        hello = engine_pb2.EngineMessage(hello=engine_pb2.EngineHello(engine_id=rng.choice(ids), tp_rank=0))
        commit = engine_pb2.EngineMessage(
            commit=engine_pb2.Commit(request_id=fuzz.string(), committed_tokens=rng.choice(U64))
        )
        post = engine_pb2.EngineMessage(
            post_forward=engine_pb2.PostForward(step=rng.choice(U64), finished_request_ids=[fuzz.string()])
        )
        if kind < 0.2:  # wrong order: no hello first
            yield rng.choice([commit, post]).SerializeToString()
        elif kind < 0.35:  # hello twice
            yield hello.SerializeToString()
            yield hello.SerializeToString()
        elif kind < 0.55:  # garbage frames after a hello
            yield hello.SerializeToString()
            yield rng.randbytes(rng.choice([1, 3, 50]))
        elif kind < 0.7:  # an empty message (no oneof set)
            yield hello.SerializeToString()
            yield b""
        else:
            yield hello.SerializeToString()
            for _ in range(rng.randint(0, 5)):
                yield rng.choice(
                    [commit, post, fuzz.message(engine_pb2.EngineMessage.DESCRIPTOR, engine_pb2.EngineMessage)]
                ).SerializeToString()

    def watch_messages() -> Iterator[bytes]:
        """WatchTransfers: fuzzed requests (ids known or not, empty, oversized; garbage, cut short)."""
        for _ in range(rng.randint(0, 3)):
            yield fuzz.payload(router_pb2.WatchTransfersRequest)

    remote = holder.client.hold_blocks(
        engine_id="holder", request_id="tmpl", block_ids=[6, 7], num_tokens=20, ttl_ms=600_000
    ).kv_transfer_params
    registration = engine_pb2.RegisterKvCacheRequest()
    registration.ParseFromString(
        engine_pb2.RegisterKvCacheRequest(
            engine_id="fuzzed",
            layout=holder_layout(holder),
            regions=[
                common_pb2.MemoryRegion(
                    kind=common_pb2.MEMORY_KIND_SHM, size_bytes=holder.spec.total_bytes, shm_name=holder.shm_name
                )
            ],
            layers=[convert.placement_to_pb(p) for p in holder.placements],
        ).SerializeToString()
    )
    templates: dict[str, Message] = {
        "HoldBlocks": engine_pb2.HoldBlocksRequest(
            engine_id="holder", request_id="t", block_ids=[0, 1], num_tokens=20, ttl_ms=1000
        ),
        "RegisterKvCache": registration,
        "UnregisterKvCache": engine_pb2.UnregisterKvCacheRequest(engine_id="fuzzed", tp_rank=0),
        "StartPull": router_pb2.StartPullRequest(
            engine_id="reader", tp_rank=0, request_id="t", local_block_ids=[1, 2], remote=remote, deadline_ms=2000
        ),
        "StartPulls": router_pb2.StartPullsRequest(
            pulls=[
                router_pb2.StartPullRequest(
                    engine_id="reader", tp_rank=0, request_id="t", local_block_ids=[1, 2], remote=remote
                ),
                router_pb2.StartPullRequest(engine_id="reader", request_id="u", local_block_ids=[3], remote=remote),
            ]
        ),
        "PreparePull": peer_pb2.PreparePullRequest(
            lease_id=remote.lease_id,
            engine_id="holder",
            block_ids=[6, 7],
            num_tokens=20,
            reader_incarnation=b.incarnation,
            reader_tp_rank=0,
            reader_tp_size=1,
            remote_tp_ranks=[0],
            reader_transfer_id="fuzz",
            read_timeout_ms=50,
        ),
        "RenewLease": router_pb2.RenewLeaseRequest(lease_id=remote.lease_id, ttl_ms=600_000),
        "SelftestHold": router_pb2.SelftestHoldRequest(size_bytes=1 << 16, seed=5),
    }
    methods = _methods()
    counts: collections.Counter[str] = collections.Counter()
    spent: collections.Counter[str] = collections.Counter()
    by_method: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    before = {node: snapshot(node) for node in daemons}
    t0 = time.monotonic()
    for i in range(CALLS):
        name, method = rng.choice(methods)
        short = name.rsplit("/", 1)[-1]
        node = rng.choice(["a", "b"])
        listener = (
            "unix" if "EngineService" in name else ("tcp" if "PeerService" in name else rng.choice(["unix", "tcp"]))
        )
        channel = channels[(node, listener)]
        request_cls = _cls(method.input_type)
        early_close = rng.random() < 0.03
        started_at = time.monotonic()
        timeout = 0.001 if early_close else 10
        try:
            if method.client_streaming:
                call = channel.stream_stream(name, ident, ident)(
                    watch_messages() if short == "WatchTransfers" else stream_messages(),
                    timeout=timeout if early_close else 3,
                )
                for _ in call:
                    pass
            elif method.server_streaming:
                for _ in channel.unary_stream(name, ident, ident)(
                    fuzz.payload(request_cls, templates.get(short)), timeout=timeout if early_close else 3
                ):
                    pass
            else:
                channel.unary_unary(name, ident, ident)(
                    fuzz.payload(request_cls, templates.get(short)), timeout=timeout
                )
            code = "OK"
            error_class = ""
            details = ""
        except grpc.RpcError as err:
            code = err.code().name
            details = err.details() or ""
            error_class = grpc_errors.error_class_name(err)
        spent[name.rsplit("/", 1)[-1]] += time.monotonic() - started_at
        label = f"{code} (client deadline)" if early_close and code == "DEADLINE_EXCEEDED" else code
        counts[label] += 1
        by_method[name.rsplit("/", 1)[-1]][code] += 1
        assert code in PRECISE, f"call {i}: {name} on {node}/{listener} -> {code}: {details[:300]}"
        assert len(details) <= 4000, f"call {i}: {name} echoed {len(details)} characters"
        if (
            code == "DEADLINE_EXCEEDED"
            and not early_close
            and "Stream" not in name
            and "Watch" not in name
            and error_class != "LeaseExpired"  # the daemon's answer about a lease, not a call that hung
        ):
            raise AssertionError(f"call {i}: {name} -> DEADLINE_EXCEEDED: {details[:300]}")
        if i % 200 == 0:
            for daemon in daemons.values():
                assert daemon.process.poll() is None, f"daemon {daemon.name} died at call {i}"
        if code == "OK" and short in READ_ONLY:
            continue  # answered without changing anything: the state is still ``before``
        if code == "OK" or early_close:
            # A successful (or cut short) call may change state: let it settle, take the new state.
            if short in ("StartPull", "StartPulls"):
                # The pull read the other daemon's lease: that daemon ends it on the reader's
                # notification, a moment after the transfer is done here. Wait until it settled.
                wait_transfers(node)
                other = "b" if node == "a" else "a"
                before[other] = settled(other)
            if early_close:
                # A call cut short still finishes (kvd.core.finishing: a registration is then
                # undone, a selftest hold kept): wait until what it does has settled.
                settled(node)
            if short in ("UnregisterKvCache", "EngineStream") or early_close:
                restore(node)
            before[node] = snapshot(node)
            continue
        after = snapshot(node)
        assert after == before[node], (
            f"call {i}: {name} failed with {code} yet changed {node}: {details[:300]}\n"
            f"before {before[node]}\nafter  {after}"
        )
    elapsed = time.monotonic() - t0
    print(f"\nfuzz: {CALLS} calls in {elapsed:.1f}s (seed {SEED}); by status: {dict(sorted(counts.items()))}")
    for method_name, per in sorted(by_method.items()):
        print(f"  {method_name:18} {spent[method_name]:5.1f}s {dict(sorted(per.items()))}")
    assert counts["INVALID_ARGUMENT"] > CALLS // 10
    for daemon in daemons.values():
        assert daemon.process.poll() is None

    # A real pull works after the fuzz, bytes verified.
    restore("a")
    restore("b")
    holder.fill_random(99)
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="after-fuzz", block_ids=[7, 8], num_tokens=25
    ).kv_transfer_params
    started = reader.client.start_pull(
        engine_id="reader", tp_rank=0, request_id="after-fuzz", local_block_ids=[9, 10], remote=params
    )
    assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
    assert reader.token_bytes([9, 10], 25).equal(holder.token_bytes([7, 8], 25))
    for channel in channels.values():
        channel.close()
