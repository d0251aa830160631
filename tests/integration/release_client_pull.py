"""Run by tests/integration/test_release.py with the Python of a venv that holds kvd-client alone
(grpcio, protobuf; no torch, numpy, NIXL or daemon): one pull between two daemons of the installed
release, as a router or a light engine would make it, every byte checked.

    python release_client_pull.py HOLDER_TCP READER_UNIX_SOCKET

The holder keeps its selftest scratch engine (a checksummed pattern, kvd.core.scratch); this
script registers a shared-memory engine on the reader, pulls the held blocks into it, and checks
them against the pattern computed here in plain Python (an independent copy of its definition,
so a change to it on one side only is caught too). It pulls twice: a router's StartPull, then an
engine's start_pulls on the engine stream, which must run on the daemon's framed socket (the
client wheel's framing against the daemon wheel's).
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
import sys
import time
import uuid

from kvd_client import KvdClient
from kvd_client.shm import create_shm_file, unlink_shm
from kvd_client.v1 import common_pb2, router_pb2

SIZE = 2 << 20
SEED = 20261128
M64 = (1 << 64) - 1


def pattern_word(position: int, seed: int) -> int:
    """Word ``position`` of the scratch pattern (kvd.core.scratch), on unsigned 64-bit words."""
    word = (position * 0x9E3779B97F4A7C15 + seed * 0x632BE59BD9B4E019 % (1 << 63)) & M64
    word ^= word >> 31
    word = (word * 0xBF58476D1CE4E5B9) & M64
    return word ^ (word >> 29)


def stream_pull(reader: KvdClient, engine_id: str, params: common_pb2.KvTransferParams) -> None:
    """The same pull as an engine makes it: one start_pulls on the engine stream, which the
    release's client and daemon run on the daemon's framed socket, and its finished_recving."""
    stream = reader.open_engine_stream(engine_id, 0)
    try:
        deadline = time.monotonic() + 30
        while not stream.takes_pulls:
            assert not stream.closed and time.monotonic() < deadline, f"no ready on the engine stream: {stream.error}"
            time.sleep(0.005)
        assert stream.framed, "the release's daemon serves the framed engine stream and its client uses it"
        request = router_pb2.StartPullRequest(
            request_id=params.request_id, local_block_ids=list(params.block_ids), remote=params
        )
        stream.send_start_pulls([request])
        while True:
            assert not stream.closed and time.monotonic() < deadline, f"no finished_recving: {stream.error}"
            done = [m for m in stream.poll(timeout_s=0.05) if m.WhichOneof("kind") == "finished_recving"]
            if any(m.finished_recving.request_id == params.request_id for m in done):
                break
    finally:
        stream.close()


def main(holder_target: str, reader_socket: str) -> None:
    for absent in ("kvd", "kvd_engine", "torch", "numpy", "nixl"):
        assert importlib.util.find_spec(absent) is None, f"{absent} is importable beside the client"
    with KvdClient(holder_target, timeout_s=30) as holder, KvdClient(f"unix://{reader_socket}", timeout_s=30) as reader:
        held = holder.selftest_hold(size_bytes=SIZE, seed=SEED)
        layout = held.layout
        block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * 2  # bf16
        layer_bytes = 2 * layout.num_blocks * block_bytes  # K then V, each num_blocks blocks
        nbytes = layout.num_layers * layer_bytes
        name = f"kvd-release-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        path = create_shm_file(name, nbytes)
        try:
            with path.open("r+b") as file, mmap.mmap(file.fileno(), nbytes) as memory:
                engine_id = f"release-{uuid.uuid4().hex[:8]}"
                reader.register_kv_cache(
                    engine_id=engine_id,
                    layout=layout,
                    regions=[
                        common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=nbytes, shm_name=name)
                    ],
                    layers=[
                        common_pb2.LayerPlacement(
                            region=0,
                            k_offset=i * layer_bytes,
                            v_offset=i * layer_bytes + layout.num_blocks * block_bytes,
                        )
                        for i in range(layout.num_layers)
                    ],
                    engine_pid=os.getpid(),
                )
                params = held.kv_transfer_params
                started = reader.start_pull(
                    engine_id=engine_id,
                    tp_rank=0,
                    request_id=params.request_id,
                    local_block_ids=list(params.block_ids),
                    remote=params,
                )
                status = reader.wait_transfer(started.transfer_id, timeout_s=60)
                expected = struct.pack(f"<{nbytes // 8}Q", *(pattern_word(i, SEED) for i in range(nbytes // 8)))
                wrong = sum(a != b for a, b in zip(memory[:], expected, strict=True)) if memory[:] != expected else 0
                assert wrong == 0, f"{wrong} of {nbytes} bytes differ from the pattern (StartPull)"
                memory[:] = bytes(nbytes)
                stream_pull(reader, engine_id, holder.selftest_hold(size_bytes=SIZE, seed=SEED).kv_transfer_params)
                wrong = sum(a != b for a, b in zip(memory[:], expected, strict=True)) if memory[:] != expected else 0
                reader.unregister_kv_cache(engine_id=engine_id, tp_rank=0)
        finally:
            unlink_shm(name)
    assert wrong == 0, f"{wrong} of {nbytes} bytes differ from the pattern"
    print(f"pulled {nbytes} bytes ({status.bytes} reported), all match")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
