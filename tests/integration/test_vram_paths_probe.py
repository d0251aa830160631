"""kvd.bench.vram_paths (the GPU kit's vram_paths step) on host memory: both cases start a holder
process, register its source (allocated there, or opened as kvd's worker opens an engine's
region), and READ it whole from this side with real NIXL, every byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_vram_paths_reads_both_cases_exactly_on_host_memory(tmp_path: Path) -> None:
    out = tmp_path / "paths.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvd.bench.vram_paths",
            "--device",
            "cpu",
            "--size-mb",
            "4",
            "--iterations",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["size_bytes"] == 4 << 20
    cases = {row["case"]: row for row in report["cases"]}
    assert set(cases) == {"own", "imported"}
    for row in cases.values():
        assert row["verified"] is True and row["memory"] == "DRAM -> DRAM"
        assert len(row["times_s"]) == 2 and row["gbs"] > 0
        assert isinstance(row["one_sided"], bool)  # True over cma (the reader copies), False over tcp
    assert "imported: DRAM -> DRAM" in done.stdout
