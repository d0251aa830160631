"""What a READ is on the worker's NIXL thread, and how it is cut before NIXL posts it.

:class:`NixlRead` is a READ the owner thread is asked to post, :class:`PostedRead` one NIXL
built, followed until final, :class:`PreparedTable` a prepared descriptor list with the rows it
was prepared from. The functions here cut a READ without calling NIXL on it, except
:func:`build_parallel_xfer`, which builds one on the owner thread (kvd.worker.nixl_agent drives
them all):

* :func:`split_read`: a READ larger than ``max_post_bytes`` goes in pieces, one after the other,
  split by run count (the runs of one READ are of similar size, so a piece can be larger by up to
  one run); only the last piece carries the notification, so the holder hears of the READ once
  every byte is read.
* :func:`copies_in_parallel` and :func:`build_parallel_xfer`: a READ (or piece) of at least
  ``parallel_min_bytes`` in host memory on both sides, with ``copy_threads`` > 1, is posted as
  ad-hoc lists (``initialize_xfer``) of about ``copy_threads`` x SPLIT_BATCH_SIZE equal
  descriptors cut from its runs' addresses (:func:`cut_runs`): NIXL's thread pool splits a
  transfer by its descriptor count, not its bytes, and a small pull is as many runs as a large one.
  Smaller READs keep their prepared lists. Why, and what it gained: docs/performance.md
  ("Large pulls: several copy threads").
* :func:`nixl_error`: NIXL's exceptions as kvd errors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

import numpy as np

from kvd.dataplane_protocol import LOCAL_AGENT, XferState
from kvd_client.errors import Internal, KvdError, PeerUnavailable

logger = logging.getLogger(__name__)

# NIXL's thread pool splits a transfer of at least this many descriptors across its threads
# (UCX backend parameter ``split_batch_size``; NIXL's default made the pieces of a parallel READ
# small enough that UCX's cost per descriptor ate the gain). Above the descriptors of a 1-block
# pull of most models (2 x layers), so small READs keep one thread and finish in their post.
SPLIT_BATCH_SIZE = 256
# While a parallel READ copies, its poller sleeps for its bytes at this rate per copy thread (a
# lower bound of the copy's time: each poll costs the copy threads CPU), then every POLL_FAST_S.
PARALLEL_BYTES_PER_S = 8e9


class NixlRead(NamedTuple):
    """One READ for the owner thread to build and post: the prepared lists (NIXL's objects,
    owned by the worker's table ids) and the indices into each, one run per index. ``xfer_id``
    is the control process's name for it (its settled report carries it)."""

    xfer_id: int
    local_table: Any
    local_indices: np.ndarray
    remote_table: Any
    remote_indices: np.ndarray
    notif: bytes
    peer: str
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedTable:
    """A prepared descriptor list and the rows it was prepared from (owner: the worker's table
    id; released on the owner thread by :meth:`NixlAgent.release_tables` or with its peer).

    The rows let a large READ be re-cut into ad-hoc lists for NIXL's copy threads (see the module
    docstring): a row index is resolved to its address without NIXL, vectorised."""

    handle: Any
    agent_name: str
    mem_type: str
    rows: np.ndarray  # (address, length, device, stride, count) or (address, length, device)
    first_index: np.ndarray  # compressed rows: the index of each row's first descriptor

    @classmethod
    def of(cls, handle: Any, agent_name: str, mem_type: str, rows: np.ndarray) -> PreparedTable:
        rows = np.asarray(rows, dtype=np.int64)
        first = np.cumsum(rows[:, 4]) - rows[:, 4] if rows.shape[1] == 5 else np.zeros(0, dtype=np.int64)
        return cls(handle, agent_name, mem_type, rows, first)

    def descriptors(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Address, length and device of each descriptor named by ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.rows.shape[1] == 5:
            row = np.searchsorted(self.first_index, indices, side="right") - 1
            address = self.rows[row, 0] + (indices - self.first_index[row]) * self.rows[row, 3]
            return address, self.rows[row, 1], self.rows[row, 2]
        return self.rows[indices, 0], self.rows[indices, 1], self.rows[indices, 2]


def nixl_handle(table: Any) -> Any:
    """NIXL's own handle of a list (tests pass bare stand-ins)."""
    return table.handle if isinstance(table, PreparedTable) else table


def cut_runs(lengths: np.ndarray, pieces: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs into about ``pieces`` descriptors of equal length (the last of each run shorter),
    in order: NIXL gives each copy thread consecutive descriptors, so equal pieces give each
    thread about the same bytes. Returns per piece its run, its offset in the run, its length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    size = max(1, -(-int(lengths.sum()) // max(1, pieces)))
    per_run = -(-lengths // size)
    run = np.repeat(np.arange(lengths.size), per_run)
    offset = (np.arange(run.size, dtype=np.int64) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * size
    return run, offset, np.minimum(size, lengths[run] - offset)


@dataclasses.dataclass(eq=False)
class PostedRead:
    """A READ NIXL built, from its post until final (DONE or ERR); owner thread only. ``error``
    set with the state still in progress: it was posted only in part, and is polled to its end.

    A READ larger than the agent's max_post_bytes goes in pieces: ``handle`` is the piece in flight (None
    between pieces and once released), ``rest`` what is still to post (with the notification)."""

    xfer_id: int
    handle: Any
    peer: str
    spin_until: float  # poll without sleeping until then (see SPIN_S)
    state: XferState = XferState.IN_PROGRESS
    error: KvdError | None = None
    rest: NixlRead | None = None
    pieces_posted: int = 0
    parallel: bool = False  # the piece in flight is copied by NIXL's copy threads (poll, never spin)
    poll_from: float = 0.0  # a parallel piece: not worth polling before (its bytes' time at best)

    @property
    def final(self) -> bool:
        return self.state is not XferState.IN_PROGRESS


def split_read(read: NixlRead, max_bytes: int) -> tuple[NixlRead, NixlRead | None]:
    """The first piece of a READ to post (about ``max_bytes``, at least one run) and the rest, or
    None where it fits whole. Only the last piece carries the notification."""
    runs = len(read.local_indices)
    if read.nbytes <= max_bytes or runs <= 1:
        return read, None
    take = max(1, runs * max_bytes // read.nbytes)
    if take >= runs:
        return read, None
    piece_bytes = read.nbytes * take // runs
    piece = read._replace(
        local_indices=read.local_indices[:take],
        remote_indices=read.remote_indices[:take],
        notif=b"",
        nbytes=piece_bytes,
    )
    rest = read._replace(
        local_indices=read.local_indices[take:],
        remote_indices=read.remote_indices[take:],
        nbytes=read.nbytes - piece_bytes,
    )
    return piece, rest


def copies_in_parallel(piece: NixlRead, copy_threads: int, parallel_min_bytes: int) -> bool:
    """Is this piece posted as ad-hoc lists cut for NIXL's copy threads? Host memory on both
    sides (a GPU copy is the GPU's, not a thread's), large enough, and lists kvd prepared."""
    local, remote = piece.local_table, piece.remote_table
    return (
        copy_threads > 1
        and piece.nbytes >= parallel_min_bytes
        and isinstance(local, PreparedTable)
        and isinstance(remote, PreparedTable)
        and local.mem_type == "DRAM"
        and remote.mem_type == "DRAM"
    )


def build_parallel_xfer(agent: Any, own_name: str, piece: NixlRead, copy_threads: int) -> Any:
    """Build a piece on ``agent`` (named ``own_name``) as about ``copy_threads`` x
    SPLIT_BATCH_SIZE equal descriptors (owner thread). The same bytes as its runs, in the same
    registrations: only the cut differs."""
    local, remote = piece.local_table, piece.remote_table
    assert isinstance(local, PreparedTable) and isinstance(remote, PreparedTable)
    local_address, lengths, local_device = local.descriptors(piece.local_indices)
    remote_address, remote_lengths, remote_device = remote.descriptors(piece.remote_indices)
    if not np.array_equal(lengths, remote_lengths):  # the planner pairs runs of one length
        raise Internal(f"a READ from {piece.peer} pairs runs of different lengths")
    run, offset, length = cut_runs(lengths, copy_threads * SPLIT_BATCH_SIZE)
    local_rows = np.stack([local_address[run] + offset, length, local_device[run]], axis=1)
    remote_rows = np.stack([remote_address[run] + offset, length, remote_device[run]], axis=1)
    peer_agent = own_name if remote.agent_name == LOCAL_AGENT else remote.agent_name
    logger.debug(
        "READ %d from %s: %d bytes in %d runs, posted as %d descriptors for %d copy threads",
        piece.xfer_id,
        piece.peer,
        int(length.sum()),
        lengths.size,
        length.size,
        copy_threads,
    )
    return agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs(local_rows, "DRAM"),
        agent.get_xfer_descs(remote_rows, "DRAM"),
        peer_agent,
        piece.notif,
    )


def nixl_error(bindings: Any, exc: Exception, peer: str) -> KvdError:
    """NIXL's exception ``exc`` (raised reading from ``peer``) as a kvd error.

    ``bindings`` is the NIXL bindings module of the agent the worker created, or None: never an
    import here (a test's fake agent must not load NIXL into its process: loaded there, it made a
    later import of grpc_tools' protoc compiler segfault)."""
    if bindings is None:
        return Internal(f"NIXL error reading from {peer}: {type(exc).__name__}: {exc}")
    if isinstance(exc, (bindings.nixlRemoteDisconnectError, bindings.nixlBackendError)):
        return PeerUnavailable(f"peer {peer} disconnected: {exc}")
    if isinstance(exc, bindings.nixlNotFoundError):
        return PeerUnavailable(f"peer {peer} is not known to NIXL (restarted?): {exc}")
    if isinstance(exc, bindings.nixlInvalidParamError):
        return Internal(f"NIXL rejected a transfer built by kvd: {exc}")
    return Internal(f"NIXL error reading from {peer}: {type(exc).__name__}: {exc}")
