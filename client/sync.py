# Generated from client/aio.py by tools/gen_sync.py; do not edit.
"""The blocking client of a kvd daemon, for engines (EngineService) and routers (RouterService).

Every RPC is a snake_case method taking keyword arguments (or a prebuilt ``request=``) and a
per-call ``timeout_s`` (None: the client's default; ``math.inf``: no deadline). Every grpc error
comes out as a :mod:`kvd_client.errors` class, with the RpcError chained.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Generator, Iterable
from types import TracebackType

import grpc

from kvd_client.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

from . import _base, _health, errors
from ._engine_stream import EngineStream
from ._frames import stream_socket_path
from ._transfer_watch import TransferWatch
from .channel import ChannelOptions, TlsConfig, create_channel
from .grpc_errors import rpc_error_code, to_kvd_error, translate, translate_iter

logger = logging.getLogger(__name__)


class KvdClient:
    """A connection to one daemon (Unix socket for engines, TCP for routers).

    Pass ``channel=`` to use a channel you built (interceptors, tests); the client then does not
    close it. Thread-safe: grpc channels and stubs may be shared between threads.
    """

    def __init__(
        self,
        target: str = "",
        *,
        timeout_s: float | None = _base.DEFAULT_TIMEOUT_S,
        tls: TlsConfig | None = None,
        options: ChannelOptions = (),
        channel: grpc.Channel | None = None,
    ) -> None:
        if channel is None:
            if not target:
                raise ValueError("KvdClient needs a target or a channel")
            channel = create_channel(target, tls=tls, options=options)
            self._owns_channel = True
        else:
            self._owns_channel = False
        self.target = target
        self.default_timeout_s = timeout_s
        self._channel = channel
        self._engine = engine_pb2_grpc.EngineServiceStub(channel)
        self._router = router_pb2_grpc.RouterServiceStub(channel)
        self._health_check = _health.check_method(channel)
        self._streams: weakref.WeakSet[EngineStream] = weakref.WeakSet()
        # The one WatchTransfers stream every wait_transfer(s) of this client rides (opened at the first).
        self._watch = TransferWatch(self._router, target)

    @property
    def channel(self) -> grpc.Channel:
        """The underlying grpc channel."""
        return self._channel

    def _timeout(self, timeout_s: float | None) -> float | None:
        return _base.grpc_timeout(timeout_s, self.default_timeout_s)

    # -- EngineService -----------------------------------------------------------------------

    @translate
    def register_kv_cache(
        self,
        *,
        engine_id: str | None = None,
        layout: common_pb2.KvLayoutSpec | None = None,
        regions: Iterable[common_pb2.MemoryRegion] | None = None,
        layers: Iterable[common_pb2.LayerPlacement] | None = None,
        require_commits: bool | None = None,
        engine_pid: int | None = None,
        request: engine_pb2.RegisterKvCacheRequest | None = None,
        timeout_s: float | None = None,
    ) -> engine_pb2.RegisterKvCacheResponse:
        """Have the daemon map an engine rank's KV memory and register it with NIXL."""
        req = _base.build_request(
            engine_pb2.RegisterKvCacheRequest,
            request,
            engine_id=engine_id,
            layout=layout,
            regions=regions,
            layers=layers,
            require_commits=require_commits,
            engine_pid=engine_pid,
        )
        return self._engine.RegisterKvCache(req, timeout=self._timeout(timeout_s))

    @translate
    def unregister_kv_cache(
        self,
        *,
        engine_id: str | None = None,
        tp_rank: int | None = None,
        request: engine_pb2.UnregisterKvCacheRequest | None = None,
        timeout_s: float | None = None,
    ) -> engine_pb2.UnregisterKvCacheResponse:
        """Deregister an engine rank (its leases are released, its pulls aborted)."""
        req = _base.build_request(engine_pb2.UnregisterKvCacheRequest, request, engine_id=engine_id, tp_rank=tp_rank)
        return self._engine.UnregisterKvCache(req, timeout=self._timeout(timeout_s))

    @translate
    def hold_blocks(
        self,
        *,
        engine_id: str | None = None,
        request_id: str | None = None,
        block_ids: Iterable[int] | None = None,
        num_tokens: int | None = None,
        ttl_ms: int | None = None,
        soft: bool | None = None,
        request: engine_pb2.HoldBlocksRequest | None = None,
        timeout_s: float | None = None,
    ) -> engine_pb2.HoldBlocksResponse:
        """Hold a finished request's blocks under a lease; the answer carries kv_transfer_params.

        ``soft``: the engine did not keep the blocks; reads are verified by its scheduler stream.
        """
        req = _base.build_request(
            engine_pb2.HoldBlocksRequest,
            request,
            engine_id=engine_id,
            request_id=request_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            ttl_ms=ttl_ms,
            soft=soft,
        )
        return self._engine.HoldBlocks(req, timeout=self._timeout(timeout_s))

    def open_engine_stream(
        self, engine_id: str, tp_rank: int, *, wait_for_ready: bool = False, framed: bool = True
    ) -> EngineStream:
        """Open the rank's long-lived stream (commits and post-forward up, completions down).

        No deadline applies: the stream lives as long as the engine. ``wait_for_ready`` makes the
        RPC wait for a daemon that is still starting instead of failing UNAVAILABLE at once.
        Over a Unix socket the stream runs on the daemon's framed socket beside it, without gRPC,
        where the daemon serves one (kvd_client._frames); ``framed=False`` keeps it on gRPC.
        """
        stream_socket = stream_socket_path(self.target) if framed and self._owns_channel else None
        stream = EngineStream(
            self._engine, engine_id, tp_rank, wait_for_ready=wait_for_ready, stream_socket=stream_socket
        )
        self._streams.add(stream)
        return stream

    # -- RouterService -----------------------------------------------------------------------

    @translate
    def start_pull(
        self,
        *,
        engine_id: str | None = None,
        tp_rank: int | None = None,
        request_id: str | None = None,
        local_block_ids: Iterable[int] | None = None,
        remote: common_pb2.KvTransferParams | None = None,
        deadline_ms: int | None = None,
        request: router_pb2.StartPullRequest | None = None,
        timeout_s: float | None = None,
    ) -> router_pb2.StartPullResponse:
        """Start pulling a remote engine's held KV into a local rank's blocks.

        Safe to retry: the same pull asked again (same engine, rank, request id, local blocks and
        lease) is answered with the transfer already started, running or DONE; another pull of a
        request whose pull still runs raises :class:`~kvd_client.errors.AlreadyExists`."""
        req = _base.build_request(
            router_pb2.StartPullRequest,
            request,
            engine_id=engine_id,
            tp_rank=tp_rank,
            request_id=request_id,
            local_block_ids=local_block_ids,
            remote=remote,
            deadline_ms=deadline_ms,
        )
        return self._router.StartPull(req, timeout=self._timeout(timeout_s))

    @translate
    def start_pulls(
        self,
        pulls: Iterable[router_pb2.StartPullRequest] | None = None,
        *,
        request: router_pb2.StartPullsRequest | None = None,
        timeout_s: float | None = None,
    ) -> list[str | errors.KvdError]:
        """Start several pulls in one call (e.g. an engine step's loads), each exactly as
        :meth:`start_pull` would: one result per pull, in order, its transfer id or the exact
        error that pull alone failed with (returned, not raised). Only a failure of the whole call
        (a batch over the daemon's bound, a daemon not serving or unreachable) raises."""
        req = _base.build_request(router_pb2.StartPullsRequest, request, pulls=pulls)
        response = self._router.StartPulls(req, timeout=self._timeout(timeout_s))
        return _base.pull_results(response, len(req.pulls))

    def pull(
        self,
        *,
        engine_id: str | None = None,
        tp_rank: int | None = None,
        request_id: str | None = None,
        local_block_ids: Iterable[int] | None = None,
        remote: common_pb2.KvTransferParams | None = None,
        deadline_ms: int | None = None,
        request: router_pb2.StartPullRequest | None = None,
        timeout_s: float | None = None,
    ) -> common_pb2.TransferStatus:
        """Start a pull (as :meth:`start_pull` would) and wait for its end (as
        :meth:`wait_transfer` would): its DONE status, or the exact error it failed with, its
        start's refusal included.

        Where the daemon takes pulls on the client's ``WatchTransfers`` stream, both ride it: one
        stream message each way instead of a StartPull call beside the wait (a router's pull at
        the engine's cost, docs/performance.md); else, and for the first pull while the stream
        opens, a StartPull and a wait. ``timeout_s`` bounds the wait: DeadlineExceeded, the pull
        going on. A start whose answer the stream's end lost raises the stream's error: the pull
        may have started, and asking :meth:`start_pull` again of the same pull answers its
        transfer."""
        req = _base.build_request(
            router_pb2.StartPullRequest,
            request,
            engine_id=engine_id,
            tp_rank=tp_rank,
            request_id=request_id,
            local_block_ids=local_block_ids,
            remote=remote,
            deadline_ms=deadline_ms,
        )
        timeout = self._timeout(timeout_s)
        if self._watch.supported:
            status = self._watch.pull(req, timeout)
            if status is not None:
                return status
        started = self.start_pull(request=req, timeout_s=timeout_s)
        return self.wait_transfer(started.transfer_id, timeout_s)

    @translate
    def get_transfer(
        self,
        transfer_id: str | None = None,
        *,
        request: router_pb2.GetTransferRequest | None = None,
        timeout_s: float | None = None,
    ) -> common_pb2.TransferStatus:
        """The current status of a transfer."""
        req = _base.build_request(router_pb2.GetTransferRequest, request, transfer_id=transfer_id)
        return self._router.GetTransfer(req, timeout=self._timeout(timeout_s))

    def watch_transfer(
        self,
        transfer_id: str | None = None,
        *,
        request: router_pb2.GetTransferRequest | None = None,
        timeout_s: float | None = None,
    ) -> Generator[common_pb2.TransferStatus, None, None]:
        """Each state change of a transfer until it ends; ``timeout_s`` bounds the whole watch.

        Stopping early (``break``) cancels the RPC.
        """
        req = _base.build_request(router_pb2.GetTransferRequest, request, transfer_id=transfer_id)
        try:
            call = self._router.WatchTransfer(req, timeout=self._timeout(timeout_s))
        except grpc.RpcError as err:
            raise to_kvd_error(err) from err
        return translate_iter(call)

    def wait_transfer(self, transfer_id: str, timeout_s: float | None = None) -> common_pb2.TransferStatus:
        """Block until the transfer ends: its DONE status, or the mapped error if it failed or was
        aborted (e.g. ``errors.Unavailable`` for a peer that died) or did not end in time.

        Every wait of this client rides one ``WatchTransfers`` stream, opened at the first wait and
        opened again after a failure; a transfer that ended before the wait is answered at once.
        A daemon that is unreachable or shutting down raises ``errors.Unavailable``."""
        timeout = self._timeout(timeout_s)
        if self._watch.supported:
            try:
                return self._watch.wait(transfer_id, timeout)
            except errors.KvdError:
                if self._watch.supported:
                    raise
        return self._watch_one_transfer(transfer_id, timeout_s)  # a daemon older than WatchTransfers

    def wait_transfers(
        self, transfer_ids: Iterable[str], timeout_s: float | None = None
    ) -> list[common_pb2.TransferStatus | errors.KvdError]:
        """Wait until every transfer ends (on the stream :meth:`wait_transfer` rides): per id, in
        order, its DONE status or the exact error it ended with (returned, not raised);
        ``errors.DeadlineExceeded`` for one still running after ``timeout_s``."""
        ids = list(transfer_ids)
        timeout = self._timeout(timeout_s)
        if self._watch.supported:
            results = self._watch.wait_many(ids, timeout)
            if self._watch.supported:
                return results
        deadline = _base.deadline_after(timeout)
        out: list[common_pb2.TransferStatus | errors.KvdError] = []
        for transfer_id in ids:  # a daemon older than WatchTransfers: one watch after the other
            try:
                out.append(self._watch_one_transfer(transfer_id, _base.time_left(deadline)))
            except errors.KvdError as exc:
                out.append(exc)
        return out

    def _watch_one_transfer(self, transfer_id: str, timeout_s: float | None) -> common_pb2.TransferStatus:
        """wait_transfer on a WatchTransfer stream of its own (daemons before 0.2.0)."""
        timeout = self._timeout(timeout_s)
        deadline = _base.deadline_after(timeout)
        watch = self.watch_transfer(transfer_id, timeout_s=timeout_s)
        with contextlib.closing(watch):
            for status in watch:
                if _base.is_terminal(status):
                    return _base.final_status(status)
        # The watch ended without a final state; the daemon may still know it.
        status = self.get_transfer(transfer_id, timeout_s=_base.time_left(deadline))
        if _base.is_terminal(status):
            return _base.final_status(status)
        raise _base.watch_ended_early(transfer_id)

    @translate
    def cancel_transfer(
        self,
        transfer_id: str | None = None,
        *,
        request: router_pb2.CancelTransferRequest | None = None,
        timeout_s: float | None = None,
    ) -> common_pb2.TransferStatus:
        """Abort a transfer; its blocks are never reported loaded."""
        req = _base.build_request(router_pb2.CancelTransferRequest, request, transfer_id=transfer_id)
        return self._router.CancelTransfer(req, timeout=self._timeout(timeout_s))

    @translate
    def lookup_held(
        self,
        *,
        engine_id: str | None = None,
        request_id: str | None = None,
        request: router_pb2.LookupHeldRequest | None = None,
        timeout_s: float | None = None,
    ) -> router_pb2.LookupHeldResponse:
        """What the daemon holds for remote readers (empty filters: everything)."""
        req = _base.build_request(router_pb2.LookupHeldRequest, request, engine_id=engine_id, request_id=request_id)
        return self._router.LookupHeld(req, timeout=self._timeout(timeout_s))

    @translate
    def renew_lease(
        self,
        lease_id: str | None = None,
        *,
        ttl_ms: int | None = None,
        request: router_pb2.RenewLeaseRequest | None = None,
        timeout_s: float | None = None,
    ) -> common_pb2.LeaseInfo:
        """Push a lease's expiry out (``ttl_ms`` 0 or None: the daemon's default)."""
        req = _base.build_request(router_pb2.RenewLeaseRequest, request, lease_id=lease_id, ttl_ms=ttl_ms)
        return self._router.RenewLease(req, timeout=self._timeout(timeout_s))

    @translate
    def release_lease(
        self,
        lease_id: str | None = None,
        *,
        request: router_pb2.ReleaseLeaseRequest | None = None,
        timeout_s: float | None = None,
    ) -> router_pb2.ReleaseLeaseResponse:
        """Release a lease now (the holder's engine is told its blocks are free)."""
        req = _base.build_request(router_pb2.ReleaseLeaseRequest, request, lease_id=lease_id)
        return self._router.ReleaseLease(req, timeout=self._timeout(timeout_s))

    @translate
    def get_status(
        self,
        *,
        request: router_pb2.GetStatusRequest | None = None,
        timeout_s: float | None = None,
    ) -> router_pb2.GetStatusResponse:
        """The daemon's incarnation, engines, peers and load."""
        req = _base.build_request(router_pb2.GetStatusRequest, request)
        return self._router.GetStatus(req, timeout=self._timeout(timeout_s))

    @translate
    def selftest_hold(
        self,
        *,
        size_bytes: int | None = None,
        seed: int | None = None,
        request: router_pb2.SelftestHoldRequest | None = None,
        timeout_s: float | None = None,
    ) -> router_pb2.SelftestHoldResponse:
        """Have the daemon hold a scratch KV cache filled with a checksummed pattern (kvd selftest)."""
        req = _base.build_request(router_pb2.SelftestHoldRequest, request, size_bytes=size_bytes, seed=seed)
        return self._router.SelftestHold(req, timeout=self._timeout(timeout_s))

    # -- health and lifetime -----------------------------------------------------------------

    def health_check(self, timeout_s: float | None = None, service: str = "") -> bool:
        """Whether the daemon (or ``service``) reports SERVING on the stock grpc health service.

        An unreachable or unresponsive daemon is unhealthy (False); other failures (e.g. an unknown
        service name) raise the mapped error.
        """
        try:
            response = self._health_check(_health.check_request(service), timeout=self._timeout(timeout_s))
        except grpc.RpcError as err:
            if rpc_error_code(err) in _base.UNREACHABLE_STATUS:
                logger.debug("health check of %s failed: %s", self.target, err)
                return False
            raise to_kvd_error(err) from err
        return _health.is_serving(response)

    def close(self) -> None:
        """Close the engine streams and the transfer watch this client opened, then the channel (if
        the client made it)."""
        for stream in list(self._streams):
            stream.close()
        self._watch.close()
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> KvdClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["KvdClient", "EngineStream"]
