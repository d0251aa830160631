"""Shared helpers of the engine-patch unit tests: a sync-op tripwire and small fakes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

SYNC_METHODS = ("item", "cpu", "tolist", "__bool__", "__int__", "__float__")


class SyncOpCalled(AssertionError):
    """A synchronizing tensor method ran where the engine's step path forbids it."""


@contextlib.contextmanager
def forbid_sync_ops(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Make every host-synchronizing ``torch.Tensor`` method raise inside the block.

    On a CUDA tensor each of these waits for the device; on CPU they are harmless, so the
    test asserts on the *call pattern*: code that never calls them cannot stall a GPU.
    Yields the list of names that were called (empty when the code is clean).
    """
    called: list[str] = []

    def tripwire(name: str):
        def raiser(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            called.append(name)
            raise SyncOpCalled(f"torch.Tensor.{name} called on the step path")

        return raiser

    with monkeypatch.context() as patch:
        for name in SYNC_METHODS:
            patch.setattr(torch.Tensor, name, tripwire(name))
        yield called


# --- a fake kvd daemon (in process) ----------------------------------------------------------------

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import threading  # noqa: E402
import time as _time  # noqa: E402
import uuid  # noqa: E402
from typing import Any  # noqa: E402

from kvd_client import errors  # noqa: E402
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2  # noqa: E402
from kvd_engine.cache_layout import CacheGeometry, KvFormat, KvLayout  # noqa: E402

_DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}


class FakeStream:
    """The engine side of an engine stream, backed by a FakeDaemon."""

    def __init__(self, daemon: FakeDaemon, engine_id: str, tp_rank: int) -> None:
        self.daemon = daemon
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.sent: list[tuple[Any, ...]] = []
        self.inbox: list[Any] = []
        self._closed = False
        self._error: errors.KvdError | None = None
        self.lock = threading.Lock()

    def send_commit(self, request_id: str, committed_tokens: int) -> bool:
        if self._closed:
            return False
        with self.lock:
            self.sent.append(("commit", request_id, int(committed_tokens)))
        self.daemon.on_commit(self.engine_id, self.tp_rank, request_id, int(committed_tokens))
        return True

    def send_post_forward(self, step: int, finished_request_ids: Any = ()) -> bool:
        if self._closed:
            return False
        with self.lock:
            self.sent.append(("post_forward", int(step), tuple(finished_request_ids)))
        return True

    @property
    def takes_pulls(self) -> bool:
        """As kvd's stream once the daemon said so: only a FakeDaemon with ``stream_pulls``."""
        return self.daemon.stream_pulls and not self._closed

    def send_start_pulls(self, requests: Any) -> int:
        """The pulls start as StartPulls would start them; the answer (a ``pulls_started``) is
        pushed at once, unless the daemon loses it (``stream_answers_lost``)."""
        if not self.takes_pulls:
            return 0
        d = self.daemon
        seq = next(d._ids)
        d.stream_batches.append([r.request_id for r in requests])
        answer = engine_pb2.DaemonMessage()
        answer.pulls_started.seq = seq
        client = FakeClient(d)
        for request in requests:
            try:
                answer.pulls_started.results.add(transfer_id=client.start_pull(request=request).transfer_id)
            except errors.KvdError as err:
                answer.pulls_started.results.add(
                    error_code=err.code.name, error_message=err.message, error_class=type(err).__name__
                )
        if d.stream_answers_lost > 0:
            d.stream_answers_lost -= 1
        else:
            self.push(answer)
        return seq

    def poll(self, timeout_s: float = 0.0) -> list[Any]:
        with self.lock:
            out, self.inbox = self.inbox, []
        return out

    def push(self, message: Any) -> None:
        with self.lock:
            self.inbox.append(message)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> errors.KvdError | None:
        return self._error

    def kill(self, error: errors.KvdError) -> None:
        self._error = error
        self._closed = True

    def close(self, timeout_s: float = 1.0) -> None:
        self._closed = True


@dataclasses.dataclass
class FakePull:
    transfer_id: str
    engine_id: str
    tp_rank: int
    request_id: str
    local_block_ids: list[int]
    remote: Any
    done: bool = False
    failed: bool = False
    deadline_ms: int = 0


class FakeDaemon:
    """Enough of `kvd serve` for engine-side tests: registrations, streams, holds, pulls.

    With ``copy_pulls`` it performs pulls itself (same geometry only) when :meth:`process` runs,
    reading only once the holder committed the tokens (require_commits), like the real daemon.
    """

    def __init__(self, address: str = "fake:1", copy_pulls: bool = False) -> None:
        self.address = address
        self.copy_pulls = copy_pulls
        self.incarnation = uuid.uuid4().hex
        self.down = False
        self.registrations: dict[tuple[str, int], Any] = {}
        self.register_calls = 0
        self.streams: dict[tuple[str, int], FakeStream] = {}
        self.all_streams: list[FakeStream] = []
        self.commits: dict[tuple[str, int, str], int] = {}
        self.leases: dict[str, dict[str, Any]] = {}
        self.pulls: list[FakePull] = []
        self.pull_error: errors.KvdError | None = None  # fails every StartPull / StartPulls call
        self.lost_answers = 0  # the next this many StartPulls calls start their pulls, then time out
        self.cancels: list[str] = []  # transfer ids CancelTransfer was asked for
        self.cancel_confirms = True  # a cancelled running pull reports load_failed (as kvd does)
        self.pull_item_errors: dict[str, errors.KvdError] = {}  # by request id: that pull's own error
        self.batches: list[list[str]] = []  # each StartPulls call's request ids
        self.batches_unimplemented = False  # a daemon that predates StartPulls
        self.stream_pulls = False  # the daemon takes pulls on the engine stream (as kvd's does)
        self.stream_batches: list[list[str]] = []  # each stream message's request ids
        self.stream_answers_lost = 0  # the next this many stream messages start their pulls, unanswered
        self.read_log: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self.lock = threading.RLock()

    # -- control ---------------------------------------------------------------------------

    def client(self, target: str = "", timeout_s: float = 1.0) -> FakeClient:
        return FakeClient(self)

    def stop(self) -> None:
        """The daemon dies: streams end UNAVAILABLE, calls fail until :meth:`start`."""
        with self.lock:
            self.down = True
            for stream in self.streams.values():
                stream.kill(errors.Unavailable("daemon gone"))
            self.streams.clear()

    def start(self) -> None:
        """A new incarnation: nothing of the old state survives."""
        with self.lock:
            self.down = False
            self.incarnation = uuid.uuid4().hex
            self.registrations.clear()
            self.commits.clear()
            self.leases.clear()
            self.pulls = [p for p in self.pulls if p.done]

    def restart(self) -> None:
        self.stop()
        self.start()

    def check(self) -> None:
        if self.down:
            raise errors.Unavailable("kvd daemon is down")

    def stream(self, engine_id: str, tp_rank: int = 0) -> FakeStream:
        return self.streams[(engine_id, tp_rank)]

    def on_commit(self, engine_id: str, tp_rank: int, request_id: str, tokens: int) -> None:
        key = (engine_id, tp_rank, request_id)
        with self.lock:
            self.commits[key] = max(tokens, self.commits.get(key, 0))

    def finish_pull(self, pull: FakePull, error: str = "", error_class: str = "PeerUnavailable") -> None:
        pull.done = True
        pull.failed = bool(error)
        stream = self.streams.get((pull.engine_id, pull.tp_rank))
        if stream is None:
            return
        if error:
            stream.push(
                engine_pb2.DaemonMessage(
                    load_failed=engine_pb2.LoadFailed(
                        request_id=pull.request_id,
                        transfer_id=pull.transfer_id,
                        error_code="ABORTED" if error_class == "Aborted" else "UNAVAILABLE",
                        error_class=error_class,
                        error_message=error,
                        block_ids=pull.local_block_ids,
                    )
                )
            )
        else:
            stream.push(
                engine_pb2.DaemonMessage(
                    finished_recving=engine_pb2.FinishedRecving(
                        request_id=pull.request_id, transfer_id=pull.transfer_id
                    )
                )
            )

    def release(self, lease_id: str, expired: bool = False) -> None:
        lease = self.leases.pop(lease_id)
        for (engine_id, _rank), stream in list(self.streams.items()):
            if engine_id == lease["engine_id"]:
                stream.push(
                    engine_pb2.DaemonMessage(
                        finished_sending=engine_pb2.FinishedSending(
                            request_id=lease["request_id"], lease_id=lease_id, expired=expired
                        )
                    )
                )

    # -- copying pulls ----------------------------------------------------------------------

    @staticmethod
    def geometry_of(reg: Any) -> CacheGeometry:
        spec = reg.layout
        return CacheGeometry(
            num_layers=spec.num_layers,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=_DTYPES[spec.dtype],
            kv_format={1: KvFormat.SPLIT, 2: KvFormat.JOINT, 4: KvFormat.PACKED}[spec.kv_format],
            layout={1: KvLayout.NHD, 2: KvLayout.HND}[spec.layout],
            total_num_kv_heads=spec.total_num_kv_heads,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
        )

    @classmethod
    def layer_tensors(cls, reg: Any) -> tuple[CacheGeometry, list[torch.Tensor]]:
        geometry = cls.geometry_of(reg)
        region = reg.regions[0]
        mapped = torch.from_file(f"/dev/shm/{region.shm_name}", shared=True, size=region.size_bytes, dtype=torch.uint8)
        layers = []
        for placement in reg.layers:
            start = placement.k_offset
            flat = mapped[start : start + geometry.layer_bytes].view(geometry.dtype)
            layers.append(flat.view(geometry.layer_shape))
        return geometry, layers

    def process(self) -> int:
        """Run the pulls whose source tokens are committed; returns how many completed."""
        done = 0
        with self.lock:
            pending = [p for p in self.pulls if not p.done]
        for pull in pending:
            lease = self.leases.get(pull.remote.lease_id)
            if lease is None:
                self.finish_pull(pull, error="lease unknown (expired or daemon restarted)")
                continue
            holder_rank = pull.tp_rank
            committed = self.commits.get((lease["engine_id"], holder_rank, lease["request_id"]), 0)
            if committed < lease["num_tokens"]:
                continue  # require_commits: wait until the holder committed what it holds
            src_reg = self.registrations[(lease["engine_id"], holder_rank)]
            dst_reg = self.registrations[(pull.engine_id, pull.tp_rank)]
            g_src, src_layers = self.layer_tensors(src_reg)
            g_dst, dst_layers = self.layer_tensors(dst_reg)
            assert dataclasses.replace(g_src, num_blocks=2) == dataclasses.replace(g_dst, num_blocks=2), (
                "fake copies same geometry only"
            )
            remote_blocks = torch.tensor(list(pull.remote.block_ids), dtype=torch.int64)
            local_blocks = torch.tensor(pull.local_block_ids, dtype=torch.int64)
            for src, dst in zip(src_layers, dst_layers, strict=True):
                sk, sv = g_src.kv_views(src)
                dk, dv = g_dst.kv_views(dst)
                self.read_log.append(
                    {
                        "k": sk[remote_blocks].clone(),
                        "v": sv[remote_blocks].clone(),
                        "num_tokens": pull.remote.num_tokens,
                    }
                )
                dk[local_blocks] = sk[remote_blocks]
                dv[local_blocks] = sv[remote_blocks]
            self.finish_pull(pull)
            lease.setdefault("readers", set()).add(pull.tp_rank)
            if len(lease["readers"]) == dst_reg.layout.tp_size:  # every reader rank has its part
                self.release(pull.remote.lease_id)
            done += 1
        return done


class FakeClient:
    """The subset of kvd_client.KvdClient the engine patch uses, against a FakeDaemon."""

    def __init__(self, daemon: FakeDaemon) -> None:
        self.daemon = daemon
        self.closed = False

    def register_kv_cache(self, *, request: Any = None, timeout_s: float | None = None, **_: Any) -> Any:
        d = self.daemon
        d.check()
        key = (request.engine_id, request.layout.tp_rank)
        with d.lock:
            if key in d.registrations:
                raise errors.AlreadyExists(f"{key} already registered")
            d.registrations[key] = request
            d.register_calls += 1
        return engine_pb2.RegisterKvCacheResponse(
            daemon_incarnation=d.incarnation, agent_name="fake", registration_id=1
        )

    def unregister_kv_cache(self, *, engine_id: str, tp_rank: int, timeout_s: float | None = None) -> Any:
        d = self.daemon
        d.check()
        with d.lock:
            d.registrations.pop((engine_id, tp_rank), None)
            # The fence: every pull into the rank's memory is cancelled (no byte lands after this).
            for pull in d.pulls:
                if not pull.done and (pull.engine_id, pull.tp_rank) == (engine_id, tp_rank):
                    d.finish_pull(pull, error="the rank was unregistered", error_class="Aborted")
        return engine_pb2.UnregisterKvCacheResponse()

    def open_engine_stream(self, engine_id: str, tp_rank: int, **_: Any) -> FakeStream:
        d = self.daemon
        d.check()
        stream = FakeStream(d, engine_id, tp_rank)
        d.streams[(engine_id, tp_rank)] = stream
        d.all_streams.append(stream)
        return stream

    def hold_blocks(
        self,
        *,
        engine_id: str,
        request_id: str,
        block_ids: Any,
        num_tokens: int,
        ttl_ms: int = 0,
        timeout_s: float | None = None,
    ) -> Any:
        d = self.daemon
        d.check()
        lease_id = f"lease-{next(d._ids)}"
        expires = int(_time.time() * 1000) + (ttl_ms or 30_000)
        d.leases[lease_id] = {
            "engine_id": engine_id,
            "request_id": request_id,
            "block_ids": list(block_ids),
            "num_tokens": num_tokens,
        }
        params = common_pb2.KvTransferParams(
            daemon_address=d.address,
            daemon_incarnation=d.incarnation,
            engine_id=engine_id,
            tp_size=1,
            lease_id=lease_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            request_id=request_id,
            lease_expires_unix_ms=expires,
        )
        return engine_pb2.HoldBlocksResponse(
            lease=common_pb2.LeaseInfo(lease_id=lease_id, engine_id=engine_id, request_id=request_id),
            kv_transfer_params=params,
        )

    def start_pull(
        self,
        *,
        engine_id: str = "",
        tp_rank: int = 0,
        request_id: str = "",
        local_block_ids: Any = (),
        remote: Any = None,
        deadline_ms: int = 0,
        request: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        if request is not None:
            engine_id, tp_rank, request_id = request.engine_id, request.tp_rank, request.request_id
            local_block_ids, remote, deadline_ms = request.local_block_ids, request.remote, request.deadline_ms
        d = self.daemon
        d.check()
        if d.pull_error is not None:
            raise d.pull_error
        if request_id in d.pull_item_errors:
            raise d.pull_item_errors[request_id]
        with d.lock:
            for old in d.pulls:  # idempotent, as kvd's: the same order answers the same transfer
                if (
                    not old.failed
                    and (old.engine_id, old.tp_rank, old.request_id) == (engine_id, tp_rank, request_id)
                    and old.local_block_ids == list(local_block_ids)
                    and old.remote.lease_id == remote.lease_id
                ):
                    return router_pb2.StartPullResponse(transfer_id=old.transfer_id)
        transfer_id = f"t{next(d._ids)}"
        with d.lock:
            d.pulls.append(
                FakePull(
                    transfer_id, engine_id, tp_rank, request_id, list(local_block_ids), remote, deadline_ms=deadline_ms
                )
            )
        return router_pb2.StartPullResponse(transfer_id=transfer_id)

    def start_pulls(self, pulls: Any, *, timeout_s: float | None = None) -> list[str | errors.KvdError]:
        d = self.daemon
        d.check()
        if d.batches_unimplemented:
            err = errors.KvdError("Method not found!")
            err.code = errors.ErrorCode.UNIMPLEMENTED
            raise err
        if d.pull_error is not None:
            raise d.pull_error
        d.batches.append([p.request_id for p in pulls])
        results: list[str | errors.KvdError] = []
        for p in pulls:
            try:
                results.append(self.start_pull(request=p).transfer_id)
            except errors.KvdError as err:
                results.append(err)
        if d.lost_answers > 0:  # the daemon started them; the answer came too late
            d.lost_answers -= 1
            raise errors.DeadlineExceeded("Deadline Exceeded")
        return results

    def cancel_transfer(self, transfer_id: str, *, timeout_s: float | None = None) -> Any:
        d = self.daemon
        d.check()
        d.cancels.append(transfer_id)
        running = [p for p in d.pulls if p.transfer_id == transfer_id and not p.done]
        if running and d.cancel_confirms:  # kvd ends the pull, then tells the engine
            d.finish_pull(running[0], error="cancelled", error_class="Aborted")
        return common_pb2.TransferStatus(transfer_id=transfer_id)

    def close(self) -> None:
        self.closed = True


def wait_until(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    deadline = _time.monotonic() + timeout_s
    while _time.monotonic() < deadline:
        if predicate():
            return True
        _time.sleep(interval_s)
    return predicate()
