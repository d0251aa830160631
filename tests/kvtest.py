"""Test helpers shared by integration, chaos and benchmark tests: engines that own shm KV.

The test process plays the engine: it creates the KV cache in POSIX shared memory, registers
it with a real daemon over the daemon's Unix socket, and reads the bytes back to compare.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvd.core import metrics_text
from kvd.layout.spec import KvFormat, KvLayout, LayerPlacement, LayoutSpec, contiguous_placements
from kvd.server import convert
from kvd_client import KvdClient
from kvd_client.shm import create_shm_tensor, unlink_shm
from kvd_client.v1 import common_pb2, engine_pb2

LLAMA_8B_SHAPE: dict[str, object] = dict(
    num_layers=32,
    kv_format=KvFormat.SPLIT,
    layout=KvLayout.NHD,
    block_size=16,
    num_kv_heads=8,
    head_dim=128,
    dtype="bfloat16",
)
SMALL_SHAPE: dict[str, object] = dict(
    num_layers=4,
    kv_format=KvFormat.SPLIT,
    layout=KvLayout.NHD,
    block_size=16,
    num_kv_heads=4,
    head_dim=64,
    dtype="float16",
)

T = TypeVar("T")


def llama_spec(num_blocks: int = 128, **overrides: object) -> LayoutSpec:
    """A Llama-3-8B-shaped layout (32 layers, 8 KV heads x 128, bf16, block 16) unless overridden."""
    return LayoutSpec(**{**LLAMA_8B_SHAPE, "num_blocks": num_blocks, **overrides})  # type: ignore[arg-type]


def small_spec(num_blocks: int = 32, **overrides: object) -> LayoutSpec:
    """A small layout (4 layers, 4 heads x 64, fp16, block 16) for fast tests, unless overridden."""
    return LayoutSpec(**{**SMALL_SHAPE, "num_blocks": num_blocks, **overrides})  # type: ignore[arg-type]


class ShmEngine:
    """An engine rank whose KV cache lives in /dev/shm and is registered with a daemon."""

    def __init__(self, target: str, engine_id: str, spec: LayoutSpec, require_commits: bool = False) -> None:
        self.engine_id = engine_id
        self.spec = spec
        self.require_commits = require_commits
        self.shm_name = f"kvdtest-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.buffer = create_shm_tensor(self.shm_name, spec.total_bytes)
        self.placements: list[LayerPlacement] = contiguous_placements(spec)
        self.client = KvdClient(target, timeout_s=30)
        self.registered = False

    def register(self, **overrides: object) -> object:
        response = self.client.register_kv_cache(request=self.registration_request(**overrides))
        self.registered = True
        return response

    def registration_request(self, **overrides: object) -> engine_pb2.RegisterKvCacheRequest:
        """This engine's RegisterKvCache request, ``overrides`` replacing its fields."""
        fields: dict[str, object] = dict(
            engine_id=self.engine_id,
            layout=convert.layout_to_pb(self.spec),
            regions=[
                common_pb2.MemoryRegion(
                    kind=common_pb2.MEMORY_KIND_SHM, size_bytes=self.spec.total_bytes, shm_name=self.shm_name
                )
            ],
            layers=[convert.placement_to_pb(p) for p in self.placements],
            require_commits=self.require_commits,
            engine_pid=os.getpid(),
        )
        fields.update(overrides)
        return engine_pb2.RegisterKvCacheRequest(**fields)

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.buffer.copy_(torch.randint(0, 256, (self.buffer.numel(),), dtype=torch.uint8, generator=generator))

    def fill(self, value: int) -> None:
        self.buffer.fill_(value)

    def token_bytes(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """The bytes of the first ``num_tokens`` tokens in ``block_ids``, in a fixed logical order."""
        spec = self.spec
        pieces = []
        for placement in self.placements:
            for plane in spec.plane_offsets(placement):
                for i, block in enumerate(block_ids):
                    tokens = min(spec.block_size, num_tokens - i * spec.block_size)
                    if tokens <= 0:
                        break
                    start = plane + block * spec.block_stride
                    if spec.layout is KvLayout.NHD or spec.kv_format is KvFormat.MLA:
                        pieces.append(self.buffer[start : start + tokens * spec.token_bytes])
                    else:
                        head = spec.block_size * spec.head_bytes_per_token
                        for h in range(spec.num_kv_heads):
                            lo = start + h * head
                            pieces.append(self.buffer[lo : lo + tokens * spec.head_bytes_per_token])
        return torch.cat(pieces)

    def untouched_mask_ok(self, written_blocks: list[int], fill_value: int, num_tokens: int) -> bool:
        """True if every byte outside the pulled tokens still holds ``fill_value``."""
        return self.untouched_outside([(written_blocks, num_tokens)], fill_value)

    def untouched_outside(self, pulls: Sequence[tuple[list[int], int]], fill_value: int) -> bool:
        """True if every byte outside the tokens of every pull (its blocks, its token count)
        still holds ``fill_value``."""
        probe = self.buffer.clone()
        spec = self.spec
        for placement in self.placements:
            for plane in spec.plane_offsets(placement):
                for written_blocks, num_tokens in pulls:
                    self._mark(probe, plane, written_blocks, num_tokens, fill_value)
        return bool((probe == fill_value).all())

    def _mark(self, probe: torch.Tensor, plane: int, written_blocks: list[int], num_tokens: int, fill: int) -> None:
        """Set the pull's tokens of one plane in ``probe`` to ``fill``."""
        spec = self.spec
        for i, block in enumerate(written_blocks):
            tokens = min(spec.block_size, num_tokens - i * spec.block_size)
            start = plane + block * spec.block_stride
            if spec.layout is KvLayout.NHD or spec.kv_format is KvFormat.MLA:
                probe[start : start + tokens * spec.token_bytes] = fill
            else:
                head = spec.block_size * spec.head_bytes_per_token
                for h in range(spec.num_kv_heads):
                    lo = start + h * head
                    probe[lo : lo + tokens * spec.head_bytes_per_token] = fill

    def close(self) -> None:
        if self.registered:
            # The daemon may be gone already in chaos tests.
            with contextlib.suppress(Exception):
                self.client.unregister_kv_cache(engine_id=self.engine_id, tp_rank=self.spec.tp_rank)
        self.client.close()
        unlink_shm(self.shm_name)


@contextlib.contextmanager
def engine_pair(
    holder_target: str, reader_target: str, spec: LayoutSpec, seed: int, fill: int = 0xAB
) -> Iterator[tuple[ShmEngine, ShmEngine]]:
    """Engines "holder" (random bytes of ``seed``) and "reader" (every byte ``fill``), each
    registered with its daemon; closed (unregistered, memory unlinked) on the way out."""
    with contextlib.ExitStack() as stack:
        holder = ShmEngine(holder_target, "holder", spec)
        stack.callback(holder.close)
        reader = ShmEngine(reader_target, "reader", spec)
        stack.callback(reader.close)
        holder.register()
        reader.register()
        holder.fill_random(seed=seed)
        reader.fill(fill)
        yield holder, reader


def scrape(metrics_address: str) -> str:
    """The daemon's /metrics page (parse it with :func:`metric_value`)."""
    return metrics_text.fetch(metrics_address)


def wait_reading(client: KvdClient, transfer_id: str, timeout_s: float = 10.0) -> None:
    """Until the pull is READING (its NIXL READs posted)."""
    deadline = time.monotonic() + timeout_s
    while client.get_transfer(transfer_id).state != common_pb2.TRANSFER_STATE_READING:
        assert time.monotonic() < deadline, "the pull never started reading"
        time.sleep(0.002)


def gauges_settle(metrics_address: str, names: Sequence[str], timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until every named gauge is 0; what is left (empty when settled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = scrape(metrics_address)
        left = {name: metric_value(text, name) for name in names if metric_value(text, name)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def eventually(read: Callable[[], T], want: T, timeout_s: float = 10.0) -> T:
    """``read()`` until it equals ``want`` or ``timeout_s`` passed: its last value (assert on it).

    For what a holder does a moment after the reader reported a pull done: it ends the pull's
    lease, and counts the bytes it served, when the reader's FinishRead arrives, sent once the
    pull was reported (docs/lifetimes.md, "A read's end")."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value == want or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


def drain(stream: Any, timeout_s: float) -> list[Any]:
    """An engine stream's messages until ``timeout_s``, or 0.3 s after the first arrives."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got.extend(stream.poll(timeout_s=0.05))
        if got:
            deadline = min(deadline, time.monotonic() + 0.3)
    return got


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 if none)."""
    return sum(
        value
        for sample, sample_labels, value in metrics_text.samples(text)
        if sample == name and all(sample_labels.get(key) == want for key, want in labels.items())
    )


def make_pki(directory: Path, names: Sequence[str]) -> Path:
    """A throwaway CA (ca.pem) and a certificate per name (<name>.pem/.key) for localhost and
    127.0.0.1, usable as server and client certificates; made with the openssl command."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=kvd-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in names:
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.pem",
        )
    return directory
