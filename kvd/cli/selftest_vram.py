"""`kvd selftest --vram`: the selftest with both engines' KV caches in GPU memory.

The CPU selftest has the peer daemon hold a scratch cache in shared memory. Here this process
plays both engines, as vLLM's workers do on a GPU node: it allocates two KV caches on the GPU
(the holder's filled with the checksummed pattern of kvd.core.scratch, the reader's zeroed),
sends each storage's CUDA IPC handle (torch's own sharing of CUDA storages, as
``torch.multiprocessing`` does) to a daemon, the holder's to the peer and the reader's to the
local one, and each daemon opens it zero copy and registers it with NIXL as VRAM. Then the
local daemon pulls the holder's blocks, GPU to GPU, and every byte is compared on the GPU with
the pattern. The baseline is a bare NIXL agent in this process reading the same bytes from the
peer's VRAM registration into a VRAM buffer of its own.

Both engines must live on the daemons' node (CUDA IPC does not cross machines), so ``--vram``
starts both daemons itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import Callable

import torch

from kvd.cli.selftest_parts import PatternMismatch, PullMeasurement, raw_nixl_reads, timed_pull
from kvd.core import scratch
from kvd.core.memory import cuda_ipc_spec_of
from kvd.layout.spec import LayoutSpec, contiguous_placements
from kvd.server import convert
from kvd_client import KvdClient, errors
from kvd_client.v1 import common_pb2


def vram_refusal(args: argparse.Namespace) -> str:
    """Why ``--vram`` cannot run with these arguments on this machine ("" if it can)."""
    if args.target or args.peer:
        return "--vram starts both daemons itself (CUDA IPC works only on one node): drop --target/--peer"
    if not torch.cuda.is_available():
        return f"--vram needs a CUDA device; torch {torch.__version__} sees none (torch.cuda.is_available() is False)"
    if not 0 <= args.device < torch.cuda.device_count():
        return f"--device {args.device} does not exist ({torch.cuda.device_count()} CUDA devices visible)"
    return ""


def register_cuda_engine(client: KvdClient, engine_id: str, spec: LayoutSpec, buffer: torch.Tensor) -> None:
    """Register ``buffer`` (the whole KV cache of one rank, contiguous layers) by its CUDA IPC handle."""
    ipc = cuda_ipc_spec_of(buffer)
    client.register_kv_cache(
        engine_id=engine_id,
        layout=convert.layout_to_pb(spec),
        regions=[
            common_pb2.MemoryRegion(
                kind=common_pb2.MEMORY_KIND_CUDA_IPC,
                size_bytes=spec.total_bytes,
                cuda_ipc=common_pb2.CudaIpcHandle(
                    device_index=ipc.device_index,
                    handle=ipc.handle,
                    storage_size_bytes=ipc.storage_size_bytes,
                    storage_offset_bytes=ipc.storage_offset_bytes,
                    ref_counter_handle=ipc.ref_counter_handle,
                    ref_counter_offset=ipc.ref_counter_offset,
                    event_handle=ipc.event_handle,
                    event_sync_required=ipc.event_sync_required,
                ),
            )
        ],
        layers=[convert.placement_to_pb(p) for p in contiguous_placements(spec)],
        engine_pid=os.getpid(),
    )


def gpu_mismatches(expected: torch.Tensor) -> Callable[[torch.Tensor], int]:
    """Count the bytes of a GPU buffer that differ from ``expected`` (on the GPU; counted only if any)."""

    def count(buffer: torch.Tensor) -> int:
        if torch.equal(buffer, expected):
            return 0
        return int((buffer != expected).sum())

    return count


def measure_pull_vram(
    stack: contextlib.ExitStack,
    local: KvdClient,
    peer: KvdClient,
    peer_address: str,
    size: int,
    seed: int,
    iterations: int,
    progress: Callable[[str], None] = lambda _: None,
    local_done: Callable[[], None] = lambda: None,
    device: int = 0,
) -> PullMeasurement:
    """Pull a VRAM holder's whole cache into a VRAM reader ``iterations`` (+1 warm-up) times.

    ``peer`` is the peer daemon's Unix socket (the holder engine registers and holds there);
    ``peer_address`` its TCP address (the raw NIXL agent's handshake).
    """
    gpu = torch.device("cuda", device)
    spec = scratch.scratch_layout(size)
    nbytes = spec.total_bytes
    name = torch.cuda.get_device_name(gpu)
    progress(f"holder engine fills a {nbytes >> 20} MiB KV cache on cuda:{device} ({name}) with pattern {seed} ...")
    expected = torch.from_numpy(scratch.Pattern(nbytes, seed).expected).to(gpu)
    holder = expected.clone()
    reader = torch.zeros_like(expected)
    torch.cuda.synchronize(gpu)  # the holder's bytes are in place before any daemon reads them
    stack.callback(_keep_until_unregistered, holder, reader)  # runs after the unregistrations below
    tag = uuid.uuid4().hex[:8]
    holder_id, reader_id = f"selftest-vram-holder-{tag}", f"selftest-vram-reader-{tag}"
    register_cuda_engine(peer, holder_id, spec, holder)
    stack.callback(_unregister_quietly, peer, holder_id)
    register_cuda_engine(local, reader_id, spec, reader)
    registered = [True]

    def unregister_reader() -> None:
        if registered.pop():
            local.unregister_kv_cache(engine_id=reader_id, tp_rank=0)

    stack.callback(lambda: unregister_reader() if registered else None)
    mismatches = gpu_mismatches(expected)
    kvd_times: list[float] = []
    descriptors = 0
    blocks = list(range(spec.num_blocks))
    for iteration in range(iterations + 1):  # the first pull warms up (handshake, table preparation)
        params = peer.hold_blocks(
            engine_id=holder_id,
            request_id=f"selftest-vram-{tag}-{iteration}",
            block_ids=blocks,
            num_tokens=spec.num_blocks * spec.block_size,
        ).kv_transfer_params
        reader.zero_()
        torch.cuda.synchronize(gpu)  # zeroed before the pull writes
        status, elapsed = timed_pull(local, reader_id, params)
        if status.state != common_pb2.TRANSFER_STATE_DONE:
            raise PatternMismatch(
                f"pull {iteration} ended {common_pb2.TransferState.Name(status.state)}: {status.error_message}"
            )
        bad = mismatches(reader)
        if bad:
            raise PatternMismatch(f"pull {iteration} delivered {bad} wrong bytes out of {nbytes} (VRAM)")
        descriptors = status.descriptors
        if iteration:
            kvd_times.append(elapsed)
        what = "warm-up pull" if iteration == 0 else f"kvd pull {iteration}/{iterations}"
        progress(f"{what:>16}: {elapsed * 1e3:8.2f} ms, {nbytes} bytes verified (VRAM -> VRAM)")
    unregister_reader()
    local_done()
    raw_times = raw_nixl_reads(peer_address, holder_id, reader, mismatches, iterations, progress)
    return PullMeasurement(nbytes, descriptors, kvd_times, raw_times, memory="VRAM", device=f"cuda:{device} ({name})")


def _keep_until_unregistered(*buffers: torch.Tensor) -> None:
    """Holds the engines' caches until the daemons have closed their CUDA IPC mappings of them."""
    del buffers


def _unregister_quietly(client: KvdClient, engine_id: str) -> None:
    with contextlib.suppress(errors.KvdError):
        client.unregister_kv_cache(engine_id=engine_id, tp_rank=0)
