"""A real in-process grpc server with small fake kvd servicers, for the client's unit tests.

Imported by this folder's conftest (fixtures) and tests (types, constants); the name is unique
because the test folders are not packages.

The fakes answer from canned data and record what they received; they are the client's test
double, not a model of the daemon. The server listens on 127.0.0.1:0 and on a Unix socket.
"""

from __future__ import annotations

import dataclasses
import queue
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvd_client.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

END = object()
"""Put on a FakeStream's outbound queue: the server ends the stream with OK."""

INCARNATION = "kvd-test-0000"


def abort_with_class(context: grpc.ServicerContext, code: grpc.StatusCode, details: str, class_name: str = "") -> None:
    """Abort like the daemon's edge does: the exact class in trailing metadata (when given)."""
    if class_name:
        context.set_trailing_metadata((("kvd-error-class", class_name),))
    context.abort(code, details)


@dataclasses.dataclass
class FakeStream:
    """One EngineStream RPC as the fake daemon sees it."""

    received: list[engine_pb2.EngineMessage] = dataclasses.field(default_factory=list)
    outbound: queue.Queue[Any] = dataclasses.field(default_factory=queue.Queue)
    client_done: threading.Event = dataclasses.field(default_factory=threading.Event)
    handler_done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def wait_received(self, count: int, timeout_s: float = 5.0) -> list[engine_pb2.EngineMessage]:
        """Wait until ``count`` messages arrived; return them all."""
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return list(self.received)


class FakeEngineService(engine_pb2_grpc.EngineServiceServicer):
    """EngineService answering from the request; remembers every request."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.streams: list[FakeStream] = []
        self._stream_added = threading.Condition()
        self.reads_held: threading.Event | None = None  # set by a test: streams read nothing until it is set

    def RegisterKvCache(
        self, request: engine_pb2.RegisterKvCacheRequest, context: grpc.ServicerContext
    ) -> engine_pb2.RegisterKvCacheResponse:
        self.requests["RegisterKvCache"] = request
        if request.engine_id == "dup":
            abort_with_class(context, grpc.StatusCode.ALREADY_EXISTS, "dup registered", "")
        return engine_pb2.RegisterKvCacheResponse(
            daemon_incarnation=INCARNATION,
            agent_name="agent-0",
            registration_id=len(request.layers),
        )

    def UnregisterKvCache(
        self, request: engine_pb2.UnregisterKvCacheRequest, context: grpc.ServicerContext
    ) -> engine_pb2.UnregisterKvCacheResponse:
        self.requests["UnregisterKvCache"] = request
        if request.engine_id == "ghost":
            abort_with_class(context, grpc.StatusCode.NOT_FOUND, "no engine ghost", "UnknownEngine")
        return engine_pb2.UnregisterKvCacheResponse()

    def HoldBlocks(
        self, request: engine_pb2.HoldBlocksRequest, context: grpc.ServicerContext
    ) -> engine_pb2.HoldBlocksResponse:
        self.requests["HoldBlocks"] = request
        lease = common_pb2.LeaseInfo(
            lease_id=f"lease-{request.request_id}",
            engine_id=request.engine_id,
            request_id=request.request_id,
            block_ids=request.block_ids,
            num_tokens=request.num_tokens,
            expires_unix_ms=1000 + request.ttl_ms,
        )
        params = common_pb2.KvTransferParams(
            daemon_address="127.0.0.1:7070",
            daemon_incarnation=INCARNATION,
            engine_id=request.engine_id,
            lease_id=lease.lease_id,
            block_ids=request.block_ids,
            num_tokens=request.num_tokens,
            request_id=request.request_id,
        )
        return engine_pb2.HoldBlocksResponse(lease=lease, kv_transfer_params=params)

    def EngineStream(
        self, request_iterator: Iterator[engine_pb2.EngineMessage], context: grpc.ServicerContext
    ) -> Iterator[engine_pb2.DaemonMessage]:
        stream = FakeStream()
        with self._stream_added:
            self.streams.append(stream)
            self._stream_added.notify_all()

        def read() -> None:
            try:
                if self.reads_held is not None:
                    self.reads_held.wait()
                for message in request_iterator:
                    stream.received.append(message)
            except Exception:  # noqa: BLE001 - background thread of a test fake: the RPC died
                pass
            finally:
                stream.client_done.set()
                stream.outbound.put(END)

        threading.Thread(target=read, daemon=True).start()
        try:
            while context.is_active():
                try:
                    item = stream.outbound.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is END:
                    return
                if isinstance(item, tuple):
                    context.abort(item[0], item[1])
                yield item
        finally:
            stream.handler_done.set()

    def wait_stream(self, index: int = 0, timeout_s: float = 5.0) -> FakeStream:
        """The ``index``-th EngineStream RPC, once it has started."""
        with self._stream_added:
            ok = self._stream_added.wait_for(lambda: len(self.streams) > index, timeout_s)
        assert ok, "the engine stream never reached the server"
        return self.streams[index]


class FakeRouterService(router_pb2_grpc.RouterServiceServicer):
    """RouterService answering from canned data; GetStatus can be made slow."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}
        self.status_delay_s = 0.0
        self.release = threading.Event()
        self.watch_scripts: dict[str, list[Any]] = {}
        self.transfers: dict[str, common_pb2.TransferStatus] = {}
        self.watch_cancelled = threading.Event()
        self.watch_transfers_unimplemented = False  # a daemon older than WatchTransfers
        self.watch_transfers_requests: list[router_pb2.WatchTransfersRequest] = []
        self.watch_transfers_streams = 0

    def StartPull(
        self, request: router_pb2.StartPullRequest, context: grpc.ServicerContext
    ) -> router_pb2.StartPullResponse:
        self.requests["StartPull"] = request
        return router_pb2.StartPullResponse(transfer_id=f"xfer-{request.request_id}")

    # StartPulls items by request id prefix: an error with that (code, class), else a transfer id.
    PULL_ERRORS: ClassVar[dict[str, tuple[str, str]]] = {
        "gone-": ("NOT_FOUND", "UnknownEngine"),
        "bad-": ("INVALID_ARGUMENT", "InvalidArgument"),
        "odd-": ("UNAVAILABLE", "NoSuchClass"),  # an unknown class: the code's general class
        "lying-": ("UNAVAILABLE", "UnknownLease"),  # a class of another code: the code wins
    }

    def StartPulls(
        self, request: router_pb2.StartPullsRequest, context: grpc.ServicerContext
    ) -> router_pb2.StartPullsResponse:
        self.requests["StartPulls"] = request
        if len(request.pulls) > 4:
            abort_with_class(context, grpc.StatusCode.INVALID_ARGUMENT, "at most 4 pulls per call", "InvalidArgument")
        response = router_pb2.StartPullsResponse()
        for pull in request.pulls:
            error = next((e for p, e in self.PULL_ERRORS.items() if pull.request_id.startswith(p)), None)
            if error is None:
                response.results.add(transfer_id=f"xfer-{pull.request_id}")
            else:
                response.results.add(error_code=error[0], error_message=f"no {pull.request_id}", error_class=error[1])
        return response

    def GetTransfer(
        self, request: router_pb2.GetTransferRequest, context: grpc.ServicerContext
    ) -> common_pb2.TransferStatus:
        self.requests["GetTransfer"] = request
        status = self.transfers.get(request.transfer_id)
        if status is None:
            abort_with_class(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no transfer {request.transfer_id}",
                "UnknownTransfer",
            )
        assert status is not None  # abort raised
        return status

    def WatchTransfer(
        self, request: router_pb2.GetTransferRequest, context: grpc.ServicerContext
    ) -> Iterator[common_pb2.TransferStatus]:
        self.requests["WatchTransfer"] = request
        context.add_callback(self.watch_cancelled.set)
        for item in self.watch_scripts.get(request.transfer_id, []):
            if isinstance(item, float):  # a pause, for deadline tests
                self.release.wait(item)
            elif isinstance(item, tuple):
                abort_with_class(context, *item)
            else:
                yield item

    def WatchTransfers(
        self, request_iterator: Iterator[router_pb2.WatchTransfersRequest], context: grpc.ServicerContext
    ) -> Iterator[router_pb2.WatchTransfersResponse]:
        """Answers each id from :meth:`final_answer` as soon as it is sent (or never)."""
        if self.watch_transfers_unimplemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        self.watch_transfers_streams += 1
        yield router_pb2.WatchTransfersResponse(incarnation=INCARNATION)
        for request in request_iterator:
            self.watch_transfers_requests.append(request)
            response = router_pb2.WatchTransfersResponse()
            for transfer_id in request.transfer_ids:
                answer = self.final_answer(transfer_id)
                if isinstance(answer, common_pb2.TransferStatus):
                    response.finished.append(answer)
                elif answer is not None:
                    response.refused.append(answer)
            if response.finished or response.refused:
                yield response

    def final_answer(self, transfer_id: str) -> common_pb2.TransferStatus | router_pb2.TransferWatchRefusal | None:
        """What WatchTransfers answers for an id: its final status in ``transfers``, else its watch
        script's first final status (None: never, if a pause comes first; an error tuple is a
        refusal), else a refusal NOT_FOUND."""
        status = self.transfers.get(transfer_id)
        if status is not None and status.state in (
            common_pb2.TRANSFER_STATE_DONE,
            common_pb2.TRANSFER_STATE_FAILED,
            common_pb2.TRANSFER_STATE_ABORTED,
        ):
            return status
        script = self.watch_scripts.get(transfer_id)
        if script is None:
            return router_pb2.TransferWatchRefusal(
                transfer_id=transfer_id,
                error_code="NOT_FOUND",
                error_message=f"no transfer {transfer_id}",
                error_class="UnknownTransfer",
            )
        for item in script:
            if isinstance(item, float):
                return None
            if isinstance(item, tuple):
                code, details, *rest = item
                return router_pb2.TransferWatchRefusal(
                    transfer_id=transfer_id,
                    error_code=code.name,
                    error_message=details,
                    error_class=rest[0] if rest else "",
                )
            if item.state in (
                common_pb2.TRANSFER_STATE_DONE,
                common_pb2.TRANSFER_STATE_FAILED,
                common_pb2.TRANSFER_STATE_ABORTED,
            ):
                return item
        return None

    def CancelTransfer(
        self, request: router_pb2.CancelTransferRequest, context: grpc.ServicerContext
    ) -> common_pb2.TransferStatus:
        self.requests["CancelTransfer"] = request
        return common_pb2.TransferStatus(
            transfer_id=request.transfer_id,
            state=common_pb2.TRANSFER_STATE_ABORTED,
            error_code="CANCELLED",
            error_message="cancelled by the caller",
        )

    def LookupHeld(
        self, request: router_pb2.LookupHeldRequest, context: grpc.ServicerContext
    ) -> router_pb2.LookupHeldResponse:
        self.requests["LookupHeld"] = request
        return router_pb2.LookupHeldResponse(
            held=[
                common_pb2.KvTransferParams(engine_id=request.engine_id, request_id=request.request_id, lease_id="l1")
            ]
        )

    def RenewLease(self, request: router_pb2.RenewLeaseRequest, context: grpc.ServicerContext) -> common_pb2.LeaseInfo:
        self.requests["RenewLease"] = request
        if request.lease_id == "expired":
            abort_with_class(context, grpc.StatusCode.DEADLINE_EXCEEDED, "lease expired", "LeaseExpired")
        return common_pb2.LeaseInfo(lease_id=request.lease_id, expires_unix_ms=request.ttl_ms)

    def ReleaseLease(
        self, request: router_pb2.ReleaseLeaseRequest, context: grpc.ServicerContext
    ) -> router_pb2.ReleaseLeaseResponse:
        self.requests["ReleaseLease"] = request
        if request.lease_id == "unknown":
            abort_with_class(context, grpc.StatusCode.NOT_FOUND, "no lease unknown", "UnknownLease")
        if request.lease_id == "plain-missing":
            abort_with_class(context, grpc.StatusCode.NOT_FOUND, "no lease plain-missing")
        if request.lease_id == "mismatch":
            # A class whose code disagrees with the status: the status code wins.
            abort_with_class(context, grpc.StatusCode.INVALID_ARGUMENT, "bad", "UnknownLease")
        if request.lease_id == "bogus-class":
            abort_with_class(context, grpc.StatusCode.NOT_FOUND, "gone", "NoSuchClass")
        if request.lease_id == "unimplemented":
            abort_with_class(context, grpc.StatusCode.UNIMPLEMENTED, "not yet")
        return router_pb2.ReleaseLeaseResponse()

    def GetStatus(
        self, request: router_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> router_pb2.GetStatusResponse:
        self.requests["GetStatus"] = request
        if self.status_delay_s:
            self.release.wait(self.status_delay_s)
        return router_pb2.GetStatusResponse(
            incarnation=INCARNATION,
            agent_name="agent-0",
            serving=True,
            leases_held=3,
            engines=[router_pb2.EngineSummary(engine_id="e0", tp_size=2)],
        )


@dataclasses.dataclass
class FakeDaemon:
    """The running fake: its services and the targets it listens on."""

    server: grpc.Server
    engine: FakeEngineService
    router: FakeRouterService
    health: health.HealthServicer
    tcp: str
    unix_path: Path

    @property
    def unix(self) -> str:
        return f"unix://{self.unix_path}"


def short_dir(tmp_path: Path) -> Path:
    """``tmp_path`` if a socket path in it fits sun_path (108 bytes), else a short temp dir."""
    if len(str(tmp_path / "kvd.sock")) < 100:
        return tmp_path
    return Path(tempfile.mkdtemp(prefix="kvdc-"))


def start_fake_daemon(sock_dir: Path) -> FakeDaemon:
    """Start a fake daemon on 127.0.0.1:0 and on ``sock_dir``/kvd.sock."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    engine, router = FakeEngineService(), FakeRouterService()
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("kvd.v1.RouterService", health_pb2.HealthCheckResponse.NOT_SERVING)
    engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    sock = sock_dir / "kvd.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return FakeDaemon(server, engine, router, health_servicer, f"127.0.0.1:{port}", sock)
