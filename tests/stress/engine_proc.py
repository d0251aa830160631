"""A stand-in engine process for stress tests: registers shm KV ranks with a daemon and waits.

    python engine_proc.py TARGET ENGINE_ID TP_SIZE NUM_BLOCKS SHM_PREFIX

Each rank's cache is ``/dev/shm/<SHM_PREFIX>-<rank>`` (the test maps the same files to write and
verify bytes). The process registers every rank with its own pid (so the daemon's liveness loop
notices a SIGKILL), prints ``ready``, and sleeps until killed; SIGTERM unregisters first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/kvtest.py

from kvtest import small_spec

from kvd.layout.spec import (
    LayoutSpec,
    contiguous_placements,
)
from kvd.server import convert
from kvd_client import KvdClient
from kvd_client.shm import create_shm_tensor
from kvd_client.v1 import common_pb2


def engine_spec(num_blocks: int, tp_rank: int, tp_size: int) -> LayoutSpec:
    """One rank of a 4-KV-head small model split over ``tp_size`` ranks."""
    return small_spec(
        num_blocks=num_blocks, tp_rank=tp_rank, tp_size=tp_size, num_kv_heads=4 // tp_size, total_num_kv_heads=4
    )


def main() -> None:
    target, engine_id, tp_size, num_blocks, prefix = sys.argv[1:6]
    client = KvdClient(target, timeout_s=30)
    buffers = []
    for rank in range(int(tp_size)):
        spec = engine_spec(int(num_blocks), rank, int(tp_size))
        name = f"{prefix}-{rank}"
        buffers.append(create_shm_tensor(name, spec.total_bytes))
        client.register_kv_cache(
            engine_id=engine_id,
            layout=convert.layout_to_pb(spec),
            regions=[
                common_pb2.MemoryRegion(kind=common_pb2.MEMORY_KIND_SHM, size_bytes=spec.total_bytes, shm_name=name)
            ],
            layers=[convert.placement_to_pb(p) for p in contiguous_placements(spec)],
            engine_pid=os.getpid(),
        )

    def stop(*_: object) -> None:
        for rank in range(int(tp_size)):
            with contextlib.suppress(Exception):  # the daemon may be gone
                client.unregister_kv_cache(engine_id=engine_id, tp_rank=rank)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
