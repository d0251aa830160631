"""Which path a NIXL READ between two processes takes, for memory a process allocated itself and
for memory it opened from another process (what kvd's data-plane worker registers).

``python -m kvd.bench.vram_paths [--device cuda|cpu] [--size-mb 64] [--iterations 5] [--json PATH]``
(the GPU check kit runs it on CUDA with ``UCX_PROTO_INFO=y``, so UCX's protocol lines for each
READ are in its output).

Why: on the first GPU run (one H200, no NVLink) a raw NIXL read of an engine's VRAM registered by
a kvd daemon moved 0.13 GB/s. kvd's worker registers memory it did not allocate: the engine's
allocation, opened through CUDA IPC. UCX's ``cuda_ipc`` transport gives a reader a handle to the
holder's memory only for memory the holder can export again (``cuIpcGetMemHandle`` of a legacy
allocation, a VMM or memory-pool fabric handle); for other CUDA memory it packs no handle
(``UCT_CUDA_IPC_KEY_HANDLE_TYPE_NO_IPC``, ``uct_cuda_ipc_mem_add_reg`` in UCX 1.19+), and the
READ falls back to a path through host memory that the holder's progress drives. That is the
hypothesis this probe tests, beside the control case, in one run:

* ``own``: the holder process allocates the source itself (torch, as vLLM's own NIXL connector
  registers its KV cache) and registers it with its NIXL agent;
* ``imported``: this process allocates the source and the holder opens it exactly as kvd's
  worker opens an engine's region (:class:`kvd.worker.regions.RegionTable`: CUDA IPC for VRAM,
  the ``/dev/shm`` file for host memory) and registers that.

The reader (this process) registers a buffer of its own and READs the whole source in one
descriptor. For each case: first one READ while the holder makes **no** progress (does it
complete without the holder: a one-sided copy?), then ``--iterations`` READs while the holder
progresses NIXL without pause; GB/s of their median, every byte checked. Not a test: a
measurement for a GPU machine (``--device cpu`` runs the same code on host memory anywhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvd.config import KvdConfig
from kvd.core.memory import cuda_ipc_spec_of
from kvd.dataplane_protocol import MemoryKind, RegionRequest
from kvd.server.startup import apply_nixl_env

CASES = ("own", "imported")
ONE_SIDED_WAIT_S = 2.0  # a READ that needs the holder's progress is still in flight after this
READ_TIMEOUT_S = 60.0


def pattern(size: int, device: torch.device, seed: int = 7) -> torch.Tensor:
    """The bytes every source holds (made on the CPU, then moved: the same on every device)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415 - NIXL loads only where it runs

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _mem(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor (the GPU index for VRAM, as kvd registers it)."""
    return ("VRAM", int(tensor.device.index or 0)) if tensor.is_cuda else ("DRAM", 0)


def holder_main(conn: multiprocessing.connection.Connection, case: str, device: str, size: int) -> None:
    """The holder process: get its source, register it, answer with its agent's metadata, then
    progress NIXL only while told to ("progress" / "pause"), until "stop"."""
    from kvd.worker.regions import RegionTable  # noqa: PLC0415 - the worker's own opening of a region

    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    regions = RegionTable(prefault=False)
    if case == "own":
        source = pattern(size, torch_device)
    else:
        request: RegionRequest = conn.recv()
        source = regions.get(regions.open(request).region_id)
    if source.is_cuda:
        torch.cuda.synchronize(source.device)
    agent = _nixl_agent(f"vram-paths-holder-{case}-{uuid.uuid4().hex[:6]}")
    registration = agent.register_memory(source)
    mem, dev = _mem(source)
    conn.send((agent.get_agent_metadata(), int(source.data_ptr()), dev, mem))
    progressing = False
    try:
        while True:
            if conn.poll(0 if progressing else None):
                command = conn.recv()
                if command == "stop":
                    break
                progressing = command == "progress"
                conn.send("ok")
                continue
            agent.get_new_notifs()  # UCX progress: what a path through the holder needs
    finally:
        agent.deregister_memory(registration)
        regions.close_all()


@contextlib.contextmanager
def holder_process(
    case: str, device: torch.device, size: int
) -> Iterator[tuple[Any, multiprocessing.connection.Connection]]:
    """Start the holder; yield (its process, this end of its pipe); the source of ``imported``
    (allocated here) stays alive until the holder has exited."""
    from kvd_client.shm import create_shm_tensor, unlink_shm  # noqa: PLC0415

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=holder_main, args=(there, case, str(device), size), daemon=True)
    process.start()
    shm_name = ""
    source: torch.Tensor | None = None
    try:
        if case == "imported":
            if device.type == "cuda":
                source = pattern(size, device)
                torch.cuda.synchronize(device)
                here.send(RegionRequest(MemoryKind.CUDA_IPC, size, cuda_ipc=cuda_ipc_spec_of(source)))
            else:
                shm_name = f"kvd-vram-paths-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                source = create_shm_tensor(shm_name, size)
                source.copy_(pattern(size, device))
                here.send(RegionRequest(MemoryKind.SHM, size, shm_name=shm_name))
        yield process, here
    finally:
        with contextlib.suppress(OSError, BrokenPipeError):
            here.send("stop")
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
        del source
        if shm_name:
            unlink_shm(shm_name)


def _tell(conn: multiprocessing.connection.Connection, command: str) -> None:
    conn.send(command)
    if not conn.poll(READ_TIMEOUT_S) or conn.recv() != "ok":
        raise RuntimeError(f"the holder did not answer {command!r}")


def _await_holder(process: Any, conn: multiprocessing.connection.Connection) -> bool:
    """Whether the holder answered within READ_TIMEOUT_S; a holder that died stops the wait at
    once rather than after the whole timeout."""
    deadline = time.monotonic() + READ_TIMEOUT_S
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            return True
        if not process.is_alive():
            return conn.poll(0)
    return False


def measure_case(case: str, device: torch.device, size: int, iterations: int) -> dict[str, Any]:
    """One case: the one-sided check, then timed READs with the holder progressing."""
    expected = pattern(size, device)
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    agent = _nixl_agent(f"vram-paths-reader-{case}-{uuid.uuid4().hex[:6]}")
    registration = agent.register_memory(buffer)
    local_mem, local_dev = _mem(buffer)
    result: dict[str, Any] = {"case": case}
    with holder_process(case, device, size) as (process, conn):
        if not _await_holder(process, conn):
            raise RuntimeError(f"the {case} holder did not start (exit code {process.exitcode})")
        metadata, address, remote_dev, remote_mem = conn.recv()
        result["memory"] = f"{remote_mem} -> {local_mem}"
        remote_name = agent.add_remote_agent(metadata)
        local_h = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", np.array([[buffer.data_ptr(), size, local_dev]], dtype=np.int64), local_mem
        )
        remote_h = agent.prep_xfer_dlist(
            remote_name, np.array([[address, size, remote_dev]], dtype=np.int64), remote_mem
        )
        index = np.array([0], np.int32)

        def read(wait_s: float) -> tuple[str, float, Any]:
            handle = agent.make_prepped_xfer("READ", local_h, index, remote_h, index)
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC" and time.perf_counter() - t0 < wait_s:
                state = agent.check_xfer_state(handle)
            return state, time.perf_counter() - t0, handle

        def finish(state: str, handle: Any) -> None:
            t0 = time.perf_counter()
            while state == "PROC" and time.perf_counter() - t0 < READ_TIMEOUT_S:
                state = agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"{case}: READ ended {state}")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not torch.equal(buffer, expected):
                raise RuntimeError(f"{case}: READ delivered wrong bytes")

        try:
            state, elapsed, handle = read(ONE_SIDED_WAIT_S)  # the holder is not progressing yet
            result["one_sided"] = state == "DONE"
            result["first_read_s"] = elapsed
            _tell(conn, "progress")
            finish(state, handle)
            times = []
            for _ in range(iterations):
                buffer.zero_()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                state, elapsed, handle = read(READ_TIMEOUT_S)
                finish(state, handle)
                times.append(elapsed)
            result.update(times_s=times, gbs=size / statistics.median(times) / 1e9, verified=True)
        finally:
            local_h.release()
            remote_h.release()
            agent.remove_remote_agent(remote_name)
            agent.deregister_memory(registration)
    return result


def run(device: torch.device, size: int, iterations: int, cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    """Every case; a case that fails is recorded with its error, and the others still run."""
    rows = []
    for case in cases:
        try:
            rows.append(measure_case(case, device, size, iterations))
        except Exception as exc:  # noqa: BLE001 - the report names it; the next case still runs
            rows.append({"case": case, "error": f"{type(exc).__name__}: {exc}", "verified": False})
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": str(device), "device_name": name, "size_bytes": size, "iterations": iterations, "cases": rows}


def resolve_device(name: str) -> torch.device:
    """The device with its index: ``cuda`` alone means the current GPU, because the holder
    process's ``torch.cuda.set_device`` refuses a CUDA device without one."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--case", action="append", choices=CASES, help="run only these cases (default: all)")
    parser.add_argument("--json", default="", metavar="PATH", help="write the report as JSON to PATH")
    args = parser.parse_args(argv)
    apply_nixl_env(KvdConfig())  # UCX's environment as kvd's daemon gives its worker
    report = run(resolve_device(args.device), args.size_mb << 20, args.iterations, tuple(args.case or CASES))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    for row in report["cases"]:
        if "error" in row:
            print(f"{row['case']:>9}: FAILED {row['error']}")
        else:
            print(
                f"{row['case']:>9}: {row['memory']}, {row['gbs']:.2f} GB/s (median of {args.iterations}), "
                f"one-sided: {row['one_sided']} "
                f"(first READ {row['first_read_s'] * 1e3:.1f} ms without the holder's progress)"
            )
    return 0 if all(row.get("verified") for row in report["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
