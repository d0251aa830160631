"""Creating the worker's NIXL agent: its backends, its progress thread's wait, its transport warmed.

Called once per worker incarnation, on the owner thread of kvd.worker.nixl_agent, before the
agent is used. What each step saves, measured: docs/performance.md ("The worker's NIXL agent:
figures and history").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvd.dataplane_protocol import LOCAL_AGENT
from kvd.worker.nixl_reads import SPLIT_BATCH_SIZE
from kvd_client.errors import Internal

logger = logging.getLogger(__name__)

# NIXL's own progress thread (nixl_progress_thread), when it runs, sleeps in poll() on the UCX
# worker's event fd between rounds and wakes when the worker has something to progress (a
# notification, a peer's request over TCP, a connection), or after this long at most. NIXL's
# Python API starts it with no timeout, and then it busy-polls a whole core (see
# create_agent_with_progress_wait). With it, the owner thread no longer polls fast for admitted
# readers: their READs progress as their packets arrive.
PROGRESS_THREAD_WAIT_S = 0.1
# The transport warm-up at agent creation (see warm_transport) gives up after this long.
WARMUP_TIMEOUT_S = 5.0
WARMUP_BYTES = 4096

_CREATE_LOCK = threading.Lock()


def nixl_api() -> Any:
    """Import NIXL lazily: the layout and registry code is usable (and testable) without it."""
    from nixl import _api  # noqa: PLC0415

    return _api


def open_agent(
    api: Any, name: str, backends: Sequence[str], progress_thread: bool, copy_threads: int, parallel_min_bytes: int
) -> Any:
    """A new NIXL agent named ``name`` with ``backends`` (owner thread). With ``copy_threads`` > 1
    its UCX backend is NIXL's thread pool (``num_threads``, as vLLM's NIXL connector creates it),
    created with the parameters NIXL's agent config cannot pass. Raises Internal where a backend
    could not be created."""
    threaded = copy_threads > 1 and "UCX" in backends
    config = api.nixl_agent_config(
        enable_prog_thread=progress_thread,
        # UCX with copy threads is created below, with the parameters NIXL's config cannot pass
        backends=[b for b in backends if b != "UCX"] if threaded else list(backends),
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    if progress_thread:
        agent = create_agent_with_progress_wait(api, name, config, PROGRESS_THREAD_WAIT_S)
    else:
        agent = api.nixl_agent(name, config)
    if threaded:
        params = {"num_threads": str(copy_threads), "split_batch_size": str(SPLIT_BATCH_SIZE)}
        try:
            agent.create_backend("UCX", params)
            logger.info(
                "NIXL's UCX backend copies READs of %d bytes or more with %d threads", parallel_min_bytes, copy_threads
            )
        except Exception as exc:
            raise Internal(f"NIXL's UCX backend with {copy_threads} copy threads could not be created: {exc}") from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise Internal(f"NIXL backends {missing} could not be created (available plugins: {agent.plugin_list})")
    return agent


def create_agent_with_progress_wait(api: Any, name: str, config: Any, wait_s: float) -> Any:
    """``api.nixl_agent(name, config)`` with its progress thread waiting on UCX's event fd.

    The C++ agent's config has the thread's poll timeout (``pthrDelay``, microseconds), but NIXL's
    Python API sets it to 0 itself, and with 0 the thread busy-polls a whole core (with a timeout
    a notification or a request from a peer still wakes it at once; measured: docs/performance.md).
    So the agent is created with the bindings' constructor wrapped to set the timeout: public
    fields of the public bindings, nothing else changed. A NIXL whose bindings lack the field is
    refused: its thread would busy-poll."""
    bindings = api.nixlBind
    construct = bindings.nixlAgent
    if not hasattr(bindings.nixlAgentConfig(), "pthrDelay"):
        raise Internal("this NIXL's agent config has no progress-thread timeout: set nixl_progress_thread = false")

    def with_wait(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = max(1, round(wait_s * 1e6))
        return construct(agent_name, agent_config)

    with _CREATE_LOCK:  # agents are created one at a time anyway (the owner thread)
        bindings.nixlAgent = with_wait
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = construct


def warm_transport(api: Any, agent: Any, backends: Sequence[str]) -> object:
    """Pay UCX's one-time costs of a new agent now, at worker start, instead of on a first pull.

    The first connection an agent ever initiates, and the first it ever accepts, each cost UCX
    far more than later ones (docs/performance.md), and both fell on the first pull to a new
    peer. So a throwaway agent in this process connects both ways and reads ``WARMUP_BYTES``
    with a notification each way: a pull's READ path.

    Runs on the owner thread before the agent is used (nothing else knows its name yet, so the
    only notifications it can get are the warm-up's own). Never fatal: a failure only costs the
    first pull its time. The probes are dropped after it (the warmed state stays: measured).
    Returns what could not be released (a READ that never became final keeps its buffers,
    registrations and probes alive), or None."""
    started = time.perf_counter()
    probes: list[Any] = []
    try:
        # Two throwaway agents: one this agent connects out to, one that connects in. With one
        # probe both ways, the second connection reused the first one's endpoint, and a first real
        # peer still paid for whichever side that skipped (measured both orders).
        for direction in ("out", "in"):
            probe = api.nixl_agent(
                f"{agent.name}-warmup-{direction}",
                api.nixl_agent_config(enable_prog_thread=False, backends=list(backends)),
            )
            probes.append(probe)
            initiator, target = (agent, probe) if direction == "out" else (probe, agent)
            leftover = _warm_read(initiator, target)
            if leftover is not None:  # _warm_read said why
                return (probes, leftover)
    except Exception as exc:  # noqa: BLE001 - an optimisation only
        logger.warning("NIXL transport warm-up failed (the first pull to each peer will be slower): %s", exc)
        return None
    logger.debug("NIXL transport warm-up took %.1f ms", (time.perf_counter() - started) * 1e3)
    return None  # the probes go with their last reference: their UCX workers and endpoints close


def _warm_read(initiator: Any, target: Any) -> object:
    """``initiator`` READs WARMUP_BYTES of ``target``'s memory with a notification, polling both
    to the end; returns what must stay alive if the READ never became final, else None.
    Whatever was set up is undone in reverse order, on errors too, once nothing is in flight."""
    source = np.zeros(WARMUP_BYTES, np.uint8)
    destination = np.zeros(WARMUP_BYTES, np.uint8)
    with contextlib.ExitStack() as undo:
        registration = target.register_memory([(source.ctypes.data, WARMUP_BYTES, 0, "")], "DRAM")
        undo.callback(target.deregister_memory, registration)
        registration = initiator.register_memory([(destination.ctypes.data, WARMUP_BYTES, 0, "")], "DRAM")
        undo.callback(initiator.deregister_memory, registration)
        name = loaded_agent_name(initiator.add_remote_agent(target.get_agent_metadata()))
        undo.callback(initiator.remove_remote_agent, name)
        remote = initiator.prep_xfer_dlist(name, [(source.ctypes.data, WARMUP_BYTES, 0)], "DRAM")
        undo.callback(initiator.release_dlist_handle, remote)
        local = initiator.prep_xfer_dlist(LOCAL_AGENT, [(destination.ctypes.data, WARMUP_BYTES, 0)], "DRAM")
        undo.callback(initiator.release_dlist_handle, local)
        handle = initiator.make_prepped_xfer("READ", local, [0], remote, [0], b"kvd-warmup")
        state = "PROC"
        failure: Exception | None = None
        try:
            state = initiator.transfer(handle)
            notified = False
            deadline = time.monotonic() + WARMUP_TIMEOUT_S
            while (state == "PROC" or not notified) and state != "ERR" and time.monotonic() < deadline:
                if state == "PROC":
                    state = initiator.check_xfer_state(handle)
                notified = notified or bool(target.get_new_notifs())
                time.sleep(0)
        except Exception as exc:  # noqa: BLE001 - re-raised below, once nothing is in flight
            failure = exc
        if state == "PROC":  # may still land (timed out, or a call failed mid-way): nothing is undone
            logger.warning(
                "the NIXL transport warm-up's READ is not final (%s): its buffers stay for the worker's life",
                failure if failure is not None else f"not done in {WARMUP_TIMEOUT_S:.0f} s",
            )
            return (source, destination, handle, undo.pop_all())
        if failure is not None:
            raise failure
        initiator.release_xfer_handle(handle)
    return None


def takes_strided_lists(agent: Any) -> bool:
    """Does this NIXL prepare lists from compressed rows (address, length, device, stride, count)?

    Tables come in that form (:meth:`kvd.layout.geometry.DescGeometry.strided`): a whole-block
    table of a large engine is millions of descriptors, and building them one by one held the
    GIL long enough to stall every READ the worker posts meanwhile (docs/performance.md); NIXL
    prepares the compressed form far faster. A NIXL whose ``prep_xfer_dlist`` does not document
    the form gets them expanded (its old cost)."""
    return "Nx5" in (getattr(type(agent).prep_xfer_dlist, "__doc__", None) or "")


def loaded_agent_name(loaded: bytes | str) -> str:
    """The agent name ``add_remote_agent`` returns (bytes or str, depending on NIXL's binding)."""
    return loaded.decode() if isinstance(loaded, bytes) else str(loaded)
