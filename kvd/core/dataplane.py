"""The NIXL data plane: one agent per daemon incarnation, prepared tables, reads, notifications.

This is the only module that talks to NIXL. It turns NIXL's string states and exceptions into
:class:`XferState` and kvd errors, and caches prepared descriptor tables (``prep_xfer_dlist``)
per (owner, geometry): once per local engine registration and once per (peer agent, remote
engine registration), so a pull is only ``make_prepped_xfer`` over numpy index arrays.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from kvd.layout.geometry import DescGeometry
from kvd_client.errors import Internal, InvalidArgument, PeerUnavailable

logger = logging.getLogger(__name__)

LOCAL = "NIXL_INIT_AGENT"


class XferState(enum.Enum):
    IN_PROGRESS = "PROC"
    DONE = "DONE"
    ERROR = "ERR"


def _nixl() -> Any:
    """Import NIXL lazily: the layout and registry code is usable (and testable) without it."""
    from nixl import _api  # noqa: PLC0415

    return _api


def _bindings() -> Any:
    import nixl._api as api  # noqa: PLC0415

    return api.nixlBind


class DataPlane:
    """A NIXL agent plus the tables and transfers kvd keeps on it."""

    def __init__(self, agent_name: str, backends: Sequence[str] = ("UCX",), progress_thread: bool = False) -> None:
        api = _nixl()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(agent_name, config)
        self.name = agent_name
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise Internal(f"NIXL backends {missing} could not be created (available plugins: {self.agent.plugin_list})")
        self._tables: dict[tuple[tuple[Hashable, ...], DescGeometry], Any] = {}
        self._lock = threading.Lock()

    # --- identity -----------------------------------------------------------------------

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    # --- memory -------------------------------------------------------------------------

    def register(self, address: int, size: int, device_index: int, mem_type: str) -> Any:
        """Register one region with every backend that takes its memory type."""
        return self.agent.register_memory([(address, size, device_index, "")], mem_type)

    def deregister(self, registration: Any) -> None:
        self.agent.deregister_memory(registration)

    # --- peers --------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as exc:  # NIXL raises its own exception types here
            raise InvalidArgument(f"peer agent metadata rejected by NIXL: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, agent_name: str) -> None:
        """Forget a peer agent and every table prepared against it."""
        self.drop_tables(("remote", agent_name))
        try:
            self.agent.remove_remote_agent(agent_name)
        except Exception as exc:  # already gone: nothing to release
            logger.debug("remove_remote_agent(%s): %s", agent_name, exc)

    # --- tables -------------------------------------------------------------------------

    def table(
        self,
        owner: tuple[Hashable, ...],
        agent_name: str,
        geometry: DescGeometry,
        region_addresses: Sequence[int],
        device_index: int,
        mem_type: str,
    ) -> Any:
        """The prepared table of ``geometry`` over ``owner``'s regions (prepared on first use).

        ``owner`` names whose memory it is, for release by prefix: ``("local", registration_id)``
        or ``("remote", agent_name, registration_id)``; ``agent_name`` is LOCAL for local memory.
        """
        key = (owner, geometry)
        with self._lock:
            handle = self._tables.get(key)
        if handle is not None:
            return handle
        rows = geometry.descriptors(region_addresses, device_index)
        handle = self.agent.prep_xfer_dlist(agent_name, rows, mem_type)
        with self._lock:
            existing = self._tables.get(key)
            if existing is not None:
                handle.release()
                return existing
            self._tables[key] = handle
        logger.debug("prepared %d descriptors for %s", geometry.table_size, owner)
        return handle

    def cached_table(self, owner: tuple[Hashable, ...], geometry: DescGeometry) -> Any | None:
        """The prepared table if it exists already (no NIXL call: safe on the event loop)."""
        with self._lock:
            return self._tables.get((owner, geometry))

    def one_off_table(self, rows: np.ndarray, mem_type: str) -> Any:
        """A local list prepared for one transfer (staging chunks); release after use."""
        return self.agent.prep_xfer_dlist(LOCAL, rows, mem_type)

    def drop_tables(self, owner_prefix: tuple[Hashable, ...]) -> None:
        """Release every table whose owner starts with ``owner_prefix`` (engine gone, peer died)."""
        n = len(owner_prefix)
        with self._lock:
            keys = [key for key in self._tables if key[0][:n] == owner_prefix]
            handles = [self._tables.pop(key) for key in keys]
        for handle in handles:
            try:
                handle.release()
            except Exception as exc:  # releasing a dead peer's list may fail; nothing else to do
                logger.debug("releasing a prepared list of %s: %s", owner_prefix, exc)

    # --- transfers ----------------------------------------------------------------------

    def read(
        self,
        local_table: Any,
        local_indices: np.ndarray,
        remote_table: Any,
        remote_indices: np.ndarray,
        notif: bytes,
        peer: str,
    ) -> Any:
        """Post a READ; returns the transfer handle. Raises PeerUnavailable if the peer is gone."""
        try:
            handle = self.agent.make_prepped_xfer(
                "READ",
                local_table,
                np.ascontiguousarray(local_indices, dtype=np.int32),
                remote_table,
                np.ascontiguousarray(remote_indices, dtype=np.int32),
                notif,
            )
            state = self.agent.transfer(handle)
        except Exception as exc:
            raise self._map(exc, peer) from exc
        if state == "ERR":
            self.release(handle)
            raise PeerUnavailable(f"NIXL could not post a read from peer {peer}")
        return handle

    def state(self, handle: Any, peer: str) -> XferState:
        try:
            return XferState(self.agent.check_xfer_state(handle))
        except Exception as exc:
            raise self._map(exc, peer) from exc

    def release(self, handle: Any) -> bool:
        """Release (and if still active, cancel) a transfer; False if NIXL could not cancel it."""
        try:
            handle.release()
            return True
        except Exception as exc:
            logger.warning("NIXL could not release transfer %r: %s", handle, exc)
            return False

    def notifications(self) -> dict[str, list[bytes]]:
        return dict(self.agent.get_new_notifs())

    def _map(self, exc: Exception, peer: str) -> Exception:
        bindings = _bindings()
        if isinstance(exc, (bindings.nixlRemoteDisconnectError, bindings.nixlBackendError)):
            return PeerUnavailable(f"peer {peer} disconnected: {exc}")
        if isinstance(exc, bindings.nixlNotFoundError):
            return PeerUnavailable(f"peer {peer} is not known to NIXL (restarted?): {exc}")
        if isinstance(exc, bindings.nixlInvalidParamError):
            return Internal(f"NIXL rejected a transfer built by kvd: {exc}")
        return Internal(f"NIXL error reading from {peer}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Release every prepared table (the agent itself goes with the process)."""
        with self._lock:
            handles = list(self._tables.values())
            self._tables.clear()
        for handle in handles:
            try:
                handle.release()
            except Exception as exc:
                logger.debug("releasing a prepared list at shutdown: %s", exc)
