"""``kvd selftest``'s holder side: a daemon-owned scratch engine, held for a pull.

One part of the daemon (:class:`kvd.core.daemon.Daemon` forwards SelftestHold to it). The
scratch engine is an ordinary registration (shm, NIXL, through :class:`~kvd.core.engines.Engines`)
held by an ordinary lease (:class:`~kvd.core.holds.Holds`), so the selftest exercises the real
path; its bytes are the pattern of a seed (:mod:`kvd.core.scratch`). Event-loop only.
"""

from __future__ import annotations

import asyncio
import mmap
import uuid
from collections.abc import Callable

import numpy as np

from kvd.core.engines import Engines
from kvd.core.finishing import Finishing
from kvd.core.holds import Holds
from kvd.core.memory import RegionRequest
from kvd.core.params import TransferParams
from kvd.core.registry import Registry
from kvd.layout.spec import LayoutSpec
from kvd_client.errors import InvalidArgument


class SelftestScratch:
    """One scratch engine per daemon; a different size or seed replaces it."""

    def __init__(
        self, engine_id: str, registry: Registry, engines: Engines, holds: Holds, require_serving: Callable[[], None]
    ) -> None:
        self.engine_id = engine_id
        self.registry = registry
        self.engines = engines
        self.holds = holds
        self._require_serving = require_serving
        self._seed = -1  # the pattern the scratch engine now registered holds
        # A hold runs to its end even if its caller is cancelled: the scratch is then always the
        # one ``_seed`` names (its lease, nobody's, expires on its own).
        self.finishing = Finishing("selftest hold")
        self._one_at_a_time = asyncio.Lock()  # two holds must not both replace the scratch

    async def hold(self, size_bytes: int, seed: int) -> tuple[LayoutSpec, TransferParams]:
        """Hold the scratch engine filled with the pattern of ``seed`` (see kvd.core.scratch)."""
        return await self.finishing.run(self._hold_alone(size_bytes, seed))

    async def _hold_alone(self, size_bytes: int, seed: int) -> tuple[LayoutSpec, TransferParams]:
        async with self._one_at_a_time:
            return await self._hold(size_bytes, seed)

    async def _hold(self, size_bytes: int, seed: int) -> tuple[LayoutSpec, TransferParams]:
        from kvd.core import scratch  # noqa: PLC0415
        from kvd.core.memory import MemoryKind  # noqa: PLC0415
        from kvd.layout.spec import contiguous_placements  # noqa: PLC0415
        from kvd_client.shm import create_shm_file, unlink_shm  # noqa: PLC0415

        self._require_serving()
        if not 0 < size_bytes <= scratch.MAX_SCRATCH_BYTES:
            raise InvalidArgument(f"selftest size must be in 1..{scratch.MAX_SCRATCH_BYTES} bytes, got {size_bytes}")
        spec = scratch.scratch_layout(size_bytes)
        ranks = self.registry.ranks_of(self.engine_id)
        current = ranks.get(0)
        if current is not None and (current.spec != spec or self._seed != seed):
            self._seed = -1
            await self.engines.unregister(current, "selftest scratch replaced")
            current = None
        if current is None:
            name = f"{self.engine_id}-{seed}"
            path = create_shm_file(name, spec.total_bytes)
            try:
                with path.open("r+b") as file, mmap.mmap(file.fileno(), spec.total_bytes) as mapped:
                    scratch.fill_pattern(np.frombuffer(mapped, dtype=np.uint8), seed)  # numpy: no torch here
                await self.engines.register(
                    self.engine_id,
                    spec,
                    [RegionRequest(MemoryKind.SHM, spec.total_bytes, shm_name=name)],
                    contiguous_placements(spec),
                )
            finally:
                unlink_shm(name)  # the daemon's mapping keeps the memory alive
            self._seed = seed
        _lease, params = self.holds.hold(
            self.engine_id,
            f"selftest-{uuid.uuid4().hex[:8]}",
            list(range(spec.num_blocks)),
            spec.num_blocks * spec.block_size,
        )
        return spec, params
