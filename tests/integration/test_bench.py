"""`kvd bench` end to end on a tiny configuration: real daemons, real NIXL, every section's samples
in the JSON, the plots written. Not a timed test: it checks the tool, not the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_writes_every_sample_and_the_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = [
        "bench",
        "--quick",
        "--out", str(out),
        "--sizes-mb", "2,4",
        "--samples", "2",
        "--overhead-samples", "4",
        "--levels", "1,4",
        "--pulls-per-level", "8",
        "--fresh-peers", "1",
        "--convert-tokens", "16",
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", *args], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for table in ("pull vs raw NIXL read", "control overhead", "in flight", "first pull to a new peer", "goals"):
        assert table in result.stdout, result.stdout

    data = json.loads((out / "bench.json").read_text())
    assert data["machine"]["cores"] >= 1 and data["config"]["sizes_mb"] == [2, 4]
    sizes = {row["size_bytes"]: row for row in data["sizes"]}
    assert set(sizes) == {2 << 20, 4 << 20}
    assert all(len(row["kvd_s"]) == len(row["raw_s"]) == 2 for row in sizes.values())
    assert all(s > 0 for row in sizes.values() for s in row["kvd_s"] + row["raw_s"])
    overhead = data["overhead"]
    assert len(overhead["overhead_s"]) == 4
    assert len(overhead["phase_s"]) == 4  # where each pull's time went, from the daemon's TransferStatus
    assert all(p["planned"] <= p["prepared"] <= p["posted"] <= p["read"] <= p["done"] for p in overhead["phase_s"])
    assert overhead["overhead_s"] == pytest.approx(
        [k - r for k, r in zip(overhead["kvd_s"], overhead["raw_s"], strict=True)]
    )
    levels = {row["in_flight"]: row for row in data["concurrency"]}
    assert set(levels) == {1, 4}
    for n, row in levels.items():
        assert len(row["latency_s"]) == row["pulls"] >= max(8, 4 * n)
        assert row["cpu_s"]["reader"] > 0 and row["cpu_s"]["holder"] > 0  # read from /proc of the daemons
    first = data["first_contact"]
    assert len(first["first_s"]) == 1 and len(first["later_s"]) == data["config"]["later_pulls"]
    pairs = {row["pair"]: row for row in data["conversions"]}
    assert "same layout (baseline)" in pairs and any(row["mode"] == "staged" for row in pairs.values())
    assert all("vs_copy" in row for row in pairs.values() if row["mode"] == "staged")

    for name in ("throughput.png", "latency_cdf.png", "concurrency.png"):
        png = (out / name).read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name


def test_bench_refuses_an_odd_size() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", "bench", "--sizes-mb", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "sizes must be even MiB" in result.stderr
