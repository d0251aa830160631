"""The channel between kvd's control process and its data-plane worker: the one module both share.

``kvd serve`` is two processes (docs/architecture.md, "Processes"). The control process (gRPC,
registry, leases, peers, plans) never loads NIXL or UCX; the worker (``python -m kvd.worker``)
holds the NIXL agent, the engines' mapped memory, the prepared descriptor lists, staging and the
conversions. They talk over one private ``socketpair`` created by the control process and
inherited by the worker: never a listening socket, so nothing else can reach it.

**Frames.** A message is a frame: a 12-byte header (body length, number of raw buffers), the
body (pickle protocol 5), then each raw buffer (8-byte length, bytes). Numpy index arrays and
descriptor rows travel *out of band* as raw buffers (pickle's ``buffer_callback``): their bytes
are never pickled or copied into the body. Pickle is safe here because both ends are the same
daemon's processes on a private socketpair.

**Messages** (each is a tuple whose first item names its kind):

* control -> worker: ``(CALL, call_id, op, args)``: run ``op``; every call is answered exactly
  once by a ``REPLY`` unless the worker dies first.
* worker -> control: ``(REPLY, call_id, value, error)``; ``(SETTLED, xfer_id, state, error)``
  once a posted READ is final (NIXL said DONE or ERR); ``(NOTIFS, {agent: [bytes]})``;
  ``(HELLO, pid)`` once the worker has imported NIXL and waits for ``start``.

Errors cross as ``(class name, message)`` and come back as the exact :class:`KvdError` class; any
other exception becomes :class:`Internal` naming its type.

**When the worker dies** every call in flight fails ``Unavailable`` naming the restart, and every
READ it had posted is reported final with that error: the worker's death is the fence (its UCX
endpoints and mappings die with it; see docs/lifetimes.md for the exception).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import pickle
import signal
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

from kvd_client.errors import Internal, KvdError, error_class_named

if TYPE_CHECKING:
    import numpy as np

HEADER = struct.Struct("<IQ")  # body length, number of out-of-band buffers
BUFFER = struct.Struct("<Q")
MAX_BODY = 1 << 30
MAX_BUFFERS = 1024  # out-of-band buffers of one message (a READ has two index arrays)
MAX_BUFFER = 1 << 34  # one buffer (the rows of a very large descriptor list stay far below)

CALL = "call"
REPLY = "reply"
SETTLED = "settled"
NOTIFS = "notifs"
HELLO = "hello"
# Sent by the control process to a worker it is about to kill as hung: the worker's faulthandler
# writes every thread's stack to its stderr (the daemon's log) from the signal handler.
STACKS_SIGNAL = signal.SIGUSR1

LOCAL_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for the agent's own memory in prepared lists
# The default bound of the bytes one NIXL call of the worker copies (config
# dataplane_max_post_bytes; why: kvd.worker.nixl_agent, READs posted in pieces).
DEFAULT_MAX_POST_BYTES = 256 << 20
# dataplane_parallel_read_min_bytes; why: kvd.worker.nixl_agent, large READs copied by several threads.
DEFAULT_PARALLEL_READ_MIN_BYTES = 64 << 20


class CopySettings(NamedTuple):
    """How the worker's agent copies READs, sent with its ``start`` call (config
    dataplane_max_post_bytes, dataplane_copy_threads resolved, dataplane_parallel_read_min_bytes)."""

    max_post_bytes: int = DEFAULT_MAX_POST_BYTES
    copy_threads: int = 1
    parallel_read_min_bytes: int = DEFAULT_PARALLEL_READ_MIN_BYTES


WireError = tuple[str, str]  # (KvdError class name, message)


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    ERROR = "ERR"


class ReadOrder(NamedTuple):
    """One READ the control process asks its worker to post (a ``reads`` call carries several).

    The descriptor lists are named by the ids the worker gave them (``prepare_table``); the two
    index arrays travel out of band. ``xfer_id`` is the control process's name for the READ: its
    ``SETTLED`` message carries it."""

    xfer_id: int
    local_table: int
    local_indices: np.ndarray
    remote_table: int
    remote_indices: np.ndarray
    notif: bytes
    peer: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class NixlRegion:
    """One memory registration as an agent's metadata names it.

    ``serial`` tells registrations of the same addresses apart: NIXL keys a peer's regions by
    address and length, so a region deregistered and registered again is a *different* region
    that a reader must not confuse with the one it loaded before (see kvd.core.peers).
    """

    address: int
    size: int
    device_index: int
    vram: bool
    serial: int

    def overlaps(self, other: NixlRegion) -> bool:
        return (
            self.vram == other.vram
            and self.device_index == other.device_index
            and self.address < other.address + other.size
            and other.address < self.address + self.size
        )

    def covers(self, address: int, size: int, device_index: int, vram: bool) -> bool:
        return (
            self.vram == vram
            and self.device_index == device_index
            and self.address <= address
            and address + size <= self.address + self.size
        )


@dataclasses.dataclass(frozen=True)
class AgentIdentity:
    """The agent's metadata and the exact regions it names, taken together (one snapshot)."""

    metadata: bytes
    regions: tuple[NixlRegion, ...]


class MemoryKind(enum.Enum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


@dataclasses.dataclass(frozen=True)
class CudaIpcSpec:
    """The fields of ``torch.UntypedStorage._share_cuda_()``, as sent by the engine."""

    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclasses.dataclass(frozen=True)
class RegionRequest:
    """One memory region an engine asks the daemon to open (the worker maps it)."""

    kind: MemoryKind
    size_bytes: int
    shm_name: str = ""
    cuda_ipc: CudaIpcSpec | None = None


@dataclasses.dataclass(frozen=True)
class MappedRegion:
    """An engine region (or a staging buffer) as the worker mapped it: what the control side knows.

    ``region_id`` names the worker's mapping in later calls (close, duplicate, retire, convert);
    ``address`` is in the *worker's* address space, the one its NIXL registrations use.
    """

    region_id: int
    address: int
    size_bytes: int
    device_index: int
    vram: bool

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.vram else "DRAM"


@dataclasses.dataclass(eq=False)
class Xfer:
    """One posted READ, until final, as the control process knows it: ``handle`` is the READ's id,
    and ``final`` means the worker said NIXL reported DONE or ERR, or the worker is dead and
    reaped. Either way: no byte of it can land any more. (The worker's own is
    ``kvd.worker.nixl_agent.PostedRead``.)"""

    handle: Any
    peer: str
    nbytes: int
    spin_until: float
    settled: asyncio.Future[None]
    state: XferState = XferState.IN_PROGRESS
    error: KvdError | None = None

    @property
    def final(self) -> bool:
        return self.state is not XferState.IN_PROGRESS


def encode_error(exc: BaseException) -> WireError:
    """A KvdError travels as its class of the one hierarchy (kvd_client.errors): a daemon-internal
    subclass (kvd.core.workers.WorkerStartFailed, say) as the nearest class the other side knows."""
    if isinstance(exc, KvdError):
        known = next(c for c in type(exc).__mro__ if error_class_named(c.__name__) is c)
        return (known.__name__, exc.message)
    return ("Internal", f"the data-plane worker failed: {type(exc).__name__}: {exc}")


def decode_error(error: WireError) -> KvdError:
    name, message = error
    cls = error_class_named(name) or Internal
    return cls(message)


def frame(message: tuple[Any, ...]) -> list[bytes | memoryview]:
    """The bytes of one message: header, body, out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    if len(body) > MAX_BODY or len(buffers) > MAX_BUFFERS:
        raise Internal(f"a data-plane message of {len(body)} bytes and {len(buffers)} buffers is too large to send")
    parts: list[bytes | memoryview] = [HEADER.pack(len(body), len(buffers)), body]
    for buffer in buffers:
        raw = buffer.raw()
        parts.append(BUFFER.pack(raw.nbytes))
        parts.append(raw)
    return parts


async def read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    """One message; raises ``asyncio.IncompleteReadError`` at end of stream."""
    size, count = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > MAX_BODY:
        raise ValueError(f"data-plane frame of {size} bytes: the channel is corrupt")
    if count > MAX_BUFFERS:
        raise ValueError(f"data-plane frame with {count} buffers: the channel is corrupt")
    body = await reader.readexactly(size)
    buffers = []
    for _ in range(count):
        (length,) = BUFFER.unpack(await reader.readexactly(BUFFER.size))
        if length > MAX_BUFFER:
            raise ValueError(f"data-plane buffer of {length} bytes: the channel is corrupt")
        buffers.append(bytearray(await reader.readexactly(length)))  # writable: numpy views stay usable
    message = pickle.loads(body, buffers=buffers)
    assert isinstance(message, tuple)
    return message


class FrameBuffer:
    """Messages out of a byte stream that arrives in arbitrary pieces (a non-blocking socket read
    by a thread with no event loop: the NIXL thread's inbox). :func:`read_frame`'s twin for
    bytes already received; the same limits, the same errors."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[Any, ...]]:
        """Add received bytes; return every message now complete (in order)."""
        self._data += data
        messages = []
        while (message := self._take()) is not None:
            messages.append(message)
        return messages

    def _take(self) -> tuple[Any, ...] | None:
        data = self._data
        if len(data) < HEADER.size:
            return None
        size, count = HEADER.unpack_from(data, 0)
        if size > MAX_BODY:
            raise ValueError(f"data-plane frame of {size} bytes: the channel is corrupt")
        if count > MAX_BUFFERS:
            raise ValueError(f"data-plane frame with {count} buffers: the channel is corrupt")
        offset = HEADER.size + size
        spans = []
        for _ in range(count):
            if len(data) < offset + BUFFER.size:
                return None
            (length,) = BUFFER.unpack_from(data, offset)
            if length > MAX_BUFFER:
                raise ValueError(f"data-plane buffer of {length} bytes: the channel is corrupt")
            offset += BUFFER.size
            spans.append((offset, length))
            offset += length
        if len(data) < offset:
            return None
        body = bytes(data[HEADER.size : HEADER.size + size])
        buffers = [bytearray(data[start : start + length]) for start, length in spans]  # writable, as read_frame's
        del data[:offset]
        message = pickle.loads(body, buffers=buffers)
        assert isinstance(message, tuple)
        return message
