"""A fleet engine: one process, one or more TP ranks of shm KV registered with its node's daemon.

    python tests/fleet/engine.py CONFIG_JSON

It stands in for a vLLM engine the way kvd sees one: its KV cache (a chosen layout, format, block
size and TP degree, float16) lives in ``/dev/shm`` and is registered with the daemon over the
Unix socket, with the engine's pid; it holds a finished request's blocks (``HoldBlocks``, hard)
and gets them back only at ``finished_sending``; it re-registers when its daemon restarts. KV
values are a pure function of (token, position, layer, head, dim) (:func:`kv_values`, the
reference engine's formula), so any engine can say what a request's bytes must be.

The router drives it over a Unix socket of its own, one JSON line in, one out:

* ``prefill {req, tokens, ttl_ms}``: allocate, write the tokens' KV, hold; answers the
  ``KvTransferParams`` (base64) and the per-chunk checksums of what it holds;
* ``alloc {req, n}``: blocks for ``n`` tokens, filled with :data:`UNWRITTEN` (a pull that
  reports DONE without writing them is caught);
* ``write {req, tokens, start}``: compute tokens ``start..`` (recompute after a failed pull,
  or decode);
* ``sums {req, n}``: per-chunk checksums of the first ``n`` tokens as this engine holds them,
  and how many values are :data:`RELEASED` / :data:`UNWRITTEN` markers;
* ``hold {req, n, ttl_ms}``: hold a request's blocks (decode holding a conversation for its next
  turn);
* ``free {req}``: the request is over (a held one is freed at its ``finished_sending``);
* ``status``: free blocks, requests, leases, registration;
* ``reregister``: (no request open) unregister every rank, drop its shm, and register again on
  fresh shm files (the soak's engine restart without a new process).

Freed blocks are overwritten with :data:`RELEASED` at once, so a pull that reads blocks after
their lease ended shows it in its checksums.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import mmap
import os
import signal
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kvd_client import errors
from kvd_client.aio import AsyncKvdClient
from kvd_client.shm import create_shm_file, unlink_shm
from kvd_client.v1 import common_pb2

logger = logging.getLogger("fleet.engine")

CHUNK_TOKENS = 16  # checksums are per chunk of this many tokens, whatever the block size
RELEASED = np.float16(4.0)  # a freed block (kv_values are all in [-125/128, 125/128])
UNWRITTEN = np.float16(-4.0)  # a block allocated for a pull and not written yet
FORMATS = {"SPLIT": common_pb2.KV_FORMAT_SPLIT, "JOINT": common_pb2.KV_FORMAT_JOINT}
LAYOUTS = {"NHD": common_pb2.KV_LAYOUT_NHD, "HND": common_pb2.KV_LAYOUT_HND}


def kv_values(tokens: np.ndarray, start: int, layer: int, heads: np.ndarray, head_dim: int, which: int) -> np.ndarray:
    """``[T, H, D]`` float16 K (``which=0``) or V (1) of ``tokens`` at positions ``start..``.

    The formula of ``kvd.demo.reference_engine.kv_values``: multiples of 1/128, exact in float16.
    """
    positions = np.arange(start, start + len(tokens), dtype=np.int64)
    dims = np.arange(head_dim, dtype=np.int64)
    x = (
        tokens.astype(np.int64)[:, None, None] * 131
        + positions[:, None, None] * 31
        + layer * 17
        + heads.astype(np.int64)[None, :, None] * 7
        + dims[None, None, :] * 3
        + which * 53
    )
    return (((x % 251) - 125).astype(np.float32) / 128.0).astype(np.float16)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The engine's model and cache: every engine of a fleet shares layers, heads, head_dim, dtype."""

    engine_id: str
    tp_size: int
    block_size: int
    layout: str  # NHD | HND
    kv_format: str  # SPLIT | JOINT
    num_blocks: int
    num_layers: int = 4
    total_heads: int = 4
    head_dim: int = 64

    @property
    def heads(self) -> int:
        return self.total_heads // self.tp_size

    @property
    def block_shape(self) -> tuple[int, int, int]:
        if self.layout == "NHD":
            return (self.block_size, self.heads, self.head_dim)
        return (self.heads, self.block_size, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.heads * self.head_dim * 2

    @property
    def layer_bytes(self) -> int:
        return 2 * self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layout_pb(self, rank: int) -> common_pb2.KvLayoutSpec:
        return common_pb2.KvLayoutSpec(
            num_layers=self.num_layers,
            kv_format=FORMATS[self.kv_format],
            layout=LAYOUTS[self.layout],
            block_size=self.block_size,
            num_kv_heads=self.heads,
            total_num_kv_heads=self.total_heads,
            head_dim=self.head_dim,
            dtype=common_pb2.DTYPE_FLOAT16,
            num_blocks=self.num_blocks,
            tp_rank=rank,
            tp_size=self.tp_size,
        )

    def placements_pb(self) -> list[common_pb2.LayerPlacement]:
        out = []
        for layer in range(self.num_layers):
            start = layer * self.layer_bytes
            v = start + self.num_blocks * self.block_bytes if self.kv_format == "SPLIT" else 0
            out.append(common_pb2.LayerPlacement(region=0, k_offset=start, v_offset=v))
        return out


class Rank:
    """One TP rank's cache over its shm file: logical ``[blocks, block_size, heads, dim]`` K and V views."""

    def __init__(self, shape: Shape, rank: int, shm_name: str) -> None:
        self.rank = rank
        self.shm_name = shm_name
        path = create_shm_file(shm_name, shape.total_bytes)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), shape.total_bytes)
        flat = np.frombuffer(self._map, dtype=np.float16)
        per_layer = shape.layer_bytes // 2
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        for layer in range(shape.num_layers):
            view = flat[layer * per_layer : (layer + 1) * per_layer]
            if shape.kv_format == "SPLIT":
                t = view.reshape(2, shape.num_blocks, *shape.block_shape)
                k, v = t[0], t[1]
            else:
                t = view.reshape(shape.num_blocks, 2, *shape.block_shape)
                k, v = t[:, 0], t[:, 1]
            if shape.layout == "HND":
                k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
            self.k.append(k)
            self.v.append(v)
        self.head_ids = np.arange(rank * shape.heads, (rank + 1) * shape.heads)

    def release(self) -> None:
        """Drop the views and unmap (a view still exported keeps the map: then the GC does it)."""
        self.k.clear()
        self.v.clear()
        with contextlib.suppress(BufferError):
            self._map.close()


@dataclasses.dataclass
class Request:
    blocks: list[int]
    lease_id: str = ""
    free_when_sent: bool = False


class Engine:
    """The engine's state and the router's operations on it (one event loop)."""

    def __init__(self, shape: Shape, daemon_socket: str, shm_prefix: str) -> None:
        self.shape = shape
        self.daemon_socket = daemon_socket
        self.shm_prefix = shm_prefix
        self.generation = 0  # fresh shm files after each reregister: <prefix>-r<rank> first, then -g<N>-r<rank>
        self.ranks = [Rank(shape, r, f"{shm_prefix}-r{r}") for r in range(shape.tp_size)]
        self.link_task: asyncio.Task[None] | None = None
        self.free: list[int] = list(range(1, shape.num_blocks))  # block 0 stays unused, as vLLM's null block
        self.requests: dict[str, Request] = {}
        self.leases: dict[str, str] = {}  # lease id -> request id
        self.client = AsyncKvdClient(daemon_socket, timeout_s=5.0)
        self.registered = asyncio.Event()
        self.registrations = 0
        self._tasks: list[asyncio.Task[None]] = []
        for rank in self.ranks:
            for layer in range(shape.num_layers):
                rank.k[layer][...] = RELEASED
                rank.v[layer][...] = RELEASED

    # -- the daemon --------------------------------------------------------------------------

    async def register(self) -> None:
        """Register every rank (retrying while the daemon is down or still has our old ranks)."""
        delay = 0.1
        while True:
            try:
                for rank in self.ranks:
                    with contextlib.suppress(errors.AlreadyExists):
                        await self.client.register_kv_cache(
                            engine_id=self.shape.engine_id,
                            layout=self.shape.layout_pb(rank.rank),
                            regions=[
                                common_pb2.MemoryRegion(
                                    kind=common_pb2.MEMORY_KIND_SHM,
                                    size_bytes=self.shape.total_bytes,
                                    shm_name=rank.shm_name,
                                )
                            ],
                            layers=self.shape.placements_pb(),
                            engine_pid=os.getpid(),
                        )
                break
            except errors.KvdError as err:
                logger.info("register: %s: %s; retrying", type(err).__name__, err)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        self.registrations += 1
        self.registered.set()

    async def link(self) -> None:
        """Keep registered: open every rank's stream, serve finished_sending; on its end (the daemon
        died or restarted), drop the leases it held and register again."""
        while True:
            await self.register()
            streams = [
                self.client.open_engine_stream(self.shape.engine_id, r.rank, wait_for_ready=True) for r in self.ranks
            ]
            readers = [asyncio.create_task(self._read(s)) for s in streams]
            try:
                await asyncio.wait(readers, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.registered.clear()
                for task in readers:
                    task.cancel()
                for stream in streams:
                    with contextlib.suppress(Exception):
                        await stream.close(timeout_s=0.5)
            # The daemon that held our leases is gone: nobody can read through it any more.
            for req_id in [r for r, q in self.requests.items() if q.lease_id]:
                self._lease_over(self.requests[req_id].lease_id)
            await asyncio.sleep(0.2)

    async def _read(self, stream: Any) -> None:
        async for message in stream:
            if message.WhichOneof("kind") == "finished_sending":
                self._lease_over(message.finished_sending.lease_id)

    async def reregister(self) -> dict[str, Any]:
        """Unregister every rank, unlink its shm, register again on fresh shm files."""
        if self.requests or self.leases:
            raise errors.FailedPrecondition(f"engine {self.shape.engine_id}: requests open, cannot re-register")
        if self.link_task is not None:
            self.link_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.link_task
        for rank in self.ranks:
            with contextlib.suppress(errors.UnknownEngine):
                await self.client.unregister_kv_cache(engine_id=self.shape.engine_id, tp_rank=rank.rank, timeout_s=5.0)
        self.close()
        self.generation += 1
        self.ranks = [
            Rank(self.shape, r, f"{self.shm_prefix}-g{self.generation}-r{r}") for r in range(self.shape.tp_size)
        ]
        self.free = list(range(1, self.shape.num_blocks))
        self.link_task = asyncio.create_task(self.link())
        await self.registered.wait()
        return {"shm": [r.shm_name for r in self.ranks]}

    def _lease_over(self, lease_id: str) -> None:
        req_id = self.leases.pop(lease_id, None)
        if req_id is None:
            return
        request = self.requests.get(req_id)
        if request is None:
            return
        request.lease_id = ""
        if request.free_when_sent:
            self._free(req_id)

    # -- blocks and bytes ----------------------------------------------------------------------

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise errors.ResourceExhausted(f"engine {self.shape.engine_id}: {n} blocks wanted, {len(self.free)} free")
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def _fill(self, blocks: list[int], value: np.float16) -> None:
        idx = np.asarray(blocks, dtype=np.int64)
        for rank in self.ranks:
            for layer in range(self.shape.num_layers):
                rank.k[layer][idx] = value
                rank.v[layer][idx] = value

    def _free(self, req_id: str) -> None:
        request = self.requests.pop(req_id)
        self._fill(request.blocks, RELEASED)
        self.free.extend(request.blocks)

    def _slots(self, request: Request, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, stop, dtype=np.int64)
        bs = self.shape.block_size
        return np.asarray(request.blocks, dtype=np.int64)[pos // bs], pos % bs

    def _write(self, request: Request, tokens: np.ndarray, start: int) -> None:
        b, o = self._slots(request, start, len(tokens))
        for rank in self.ranks:
            for layer in range(self.shape.num_layers):
                rank.k[layer][b, o] = kv_values(tokens[start:], start, layer, rank.head_ids, self.shape.head_dim, 0)
                rank.v[layer][b, o] = kv_values(tokens[start:], start, layer, rank.head_ids, self.shape.head_dim, 1)

    def _sums(self, request: Request, n: int) -> dict[str, Any]:
        b, o = self._slots(request, 0, n)
        per_layer = []
        for layer in range(self.shape.num_layers):
            for plane in ("k", "v"):
                heads = [getattr(rank, plane)[layer][b, o] for rank in self.ranks]  # [T, Hloc, D] each
                per_layer.append(np.concatenate(heads, axis=1))
        stacked = np.stack(per_layer, axis=1)  # [T, 2L, H, D]: layout- and TP-independent
        sums = [
            zlib.crc32(np.ascontiguousarray(stacked[i : i + CHUNK_TOKENS]).tobytes()) for i in range(0, n, CHUNK_TOKENS)
        ]
        return {
            "sums": sums,
            "released": int(np.count_nonzero(stacked == RELEASED)),
            "unwritten": int(np.count_nonzero(stacked == UNWRITTEN)),
        }

    def _need_blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.shape.block_size)

    async def _hold(self, req_id: str, n: int, ttl_ms: int) -> dict[str, Any]:
        request = self.requests[req_id]
        if request.lease_id:
            raise errors.AlreadyExists(f"request {req_id} is held already")
        if not self.registered.is_set():
            raise errors.Unavailable(f"engine {self.shape.engine_id} is not registered (its daemon is restarting)")
        answer = self._sums(request, n)  # what the holder holds, before any reader can read it
        response = await self.client.hold_blocks(
            engine_id=self.shape.engine_id,
            request_id=req_id,
            block_ids=request.blocks[: self._need_blocks(n)],
            num_tokens=n,
            ttl_ms=ttl_ms,
            timeout_s=3.0,
        )
        params = response.kv_transfer_params
        request.lease_id = params.lease_id
        self.leases[params.lease_id] = req_id
        answer["params"] = base64.b64encode(params.SerializeToString()).decode()
        return answer

    # -- the router's operations -------------------------------------------------------------

    async def handle(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        req_id = str(msg.get("req", ""))
        if op == "status":
            return {
                "free_blocks": len(self.free),
                "total_blocks": self.shape.num_blocks - 1,
                "requests": len(self.requests),
                "leases": len(self.leases),
                "registered": self.registered.is_set(),
                "registrations": self.registrations,
                "shm": [r.shm_name for r in self.ranks],
            }
        if op == "prefill":
            tokens = np.asarray(msg["tokens"], dtype=np.int64)
            self.requests[req_id] = Request(self._alloc(self._need_blocks(len(tokens))))
            self._write(self.requests[req_id], tokens, 0)
            try:
                answer = await self._hold(req_id, len(tokens), int(msg.get("ttl_ms", 0)))
            except BaseException:
                self._free(req_id)
                raise
            self.requests[req_id].free_when_sent = True
            return answer
        if op == "alloc":
            blocks = self._alloc(self._need_blocks(int(msg["n"])))
            self.requests[req_id] = Request(blocks)
            self._fill(blocks, UNWRITTEN)
            return {"blocks": blocks}
        if op == "write":
            request = self.requests[req_id]
            tokens = np.asarray(msg["tokens"], dtype=np.int64)
            more = self._need_blocks(len(tokens)) - len(request.blocks)
            if more > 0:
                request.blocks += self._alloc(more)
            self._write(request, tokens, int(msg.get("start", 0)))
            return {"blocks": request.blocks}
        if op == "sums":
            return self._sums(self.requests[req_id], int(msg["n"]))
        if op == "hold":
            return await self._hold(req_id, int(msg["n"]), int(msg.get("ttl_ms", 0)))
        if op == "free":
            request = self.requests.get(req_id)
            if request is not None:
                if request.lease_id:
                    request.free_when_sent = True
                else:
                    self._free(req_id)
            return {}
        if op == "reregister":
            return await self.reregister()
        raise errors.InvalidArgument(f"unknown op {op!r}")

    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            msg = json.loads(line)
            try:
                answer = {"ok": True, **(await self.handle(str(msg.get("op")), msg))}
            except errors.KvdError as err:
                answer = {"ok": False, "error_class": type(err).__name__, "message": str(err)[:300]}
            except KeyError as err:
                answer = {"ok": False, "error_class": "UnknownRequest", "message": f"no request {err}"}
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        """Unmap and unlink every rank's shm file."""
        for rank in self.ranks:
            unlink_shm(rank.shm_name)
            rank.release()


async def amain(config: dict[str, Any]) -> None:
    shape = Shape(**config["shape"])
    engine = Engine(shape, config["daemon_socket"], config["shm_prefix"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    control = Path(config["control_socket"])
    control.unlink(missing_ok=True)
    server = await asyncio.start_unix_server(engine.serve_client, path=str(control))
    link = engine.link_task = asyncio.create_task(engine.link())
    try:
        await engine.registered.wait()
        print("ready", flush=True)
        await stop.wait()
    finally:
        (engine.link_task or link).cancel()
        server.close()
        for rank in engine.ranks:
            with contextlib.suppress(Exception):
                await engine.client.unregister_kv_cache(engine_id=shape.engine_id, tp_rank=rank.rank, timeout_s=2.0)
        with contextlib.suppress(Exception):
            await engine.client.close()
        engine.close()
        control.unlink(missing_ok=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    config = json.loads(sys.argv[1])
    asyncio.run(amain(config))


if __name__ == "__main__":
    main()
