"""kvd.bench.runs: the phases of pulls the reader daemon no longer keeps (a run of more pulls
than its finished-transfer table) leave an empty entry instead of failing the bench."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from kvd.bench import report
from kvd.bench.runs import _phases
from kvd_client.errors import UnknownTransfer


class _Reader:
    """The reader daemon's client: keeps only the transfers named in ``kept``."""

    def __init__(self, kept: dict[str, float]) -> None:
        self.kept = kept

    async def get_transfer(self, transfer_id: str) -> Any:
        if transfer_id not in self.kept:
            raise UnknownTransfer(f"no transfer {transfer_id!r} is known here (finished long ago, or never started)")
        return types.SimpleNamespace(phase_s={"planned": 0.0001, "prepared": 0.0005}, elapsed_s=self.kept[transfer_id])


def test_phases_of_forgotten_transfers_are_empty_entries_in_order_and_the_report_reads_the_rest() -> None:
    session: Any = types.SimpleNamespace(local=_Reader({"b": 0.001, "d": 0.002}))

    phases = asyncio.run(_phases(session, ["a", "b", "c", "d"]))

    assert phases == [
        {},
        {"planned": 0.0001, "prepared": 0.0005, "done": 0.001},
        {},
        {"planned": 0.0001, "prepared": 0.0005, "done": 0.002},
    ]
    line = report.phase_line({"kvd_s": [0.003, 0.0015, 0.003, 0.0025], "phase_s": phases})
    assert "planned +0.10" in line and "outside (the engine stream's two messages) 0.50" in line
