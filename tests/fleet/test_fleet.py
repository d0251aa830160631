"""CI's short fleet: 4 nodes for 1.5 minutes, every fault kind at least once, every invariant held.

Runs ``scripts/fleet.py`` as a child process, as an operator would (docs/fleet.md), and checks its
exit code (0 only when every invariant held), its last line and its JSON report. Needs root and
network namespaces (CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.chaos, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)
def test_short_fleet_holds_every_invariant(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    report = tmp_path / "fleet.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "fleet.py"),
            "--nodes",
            "4",
            "--minutes",
            "1.5",
            "--seed",
            "20",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-3000:]
    last = lines[-1]
    assert run.returncode == 0, f"fleet failed (exit {run.returncode}):\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert re.match(r"^fleet: pulls=(\d+) wrong=0 lost=0 crashed=0 .* OK$", last), last
    result = json.loads(report.read_text())
    assert result["pulls"] > 100, "the fleet moved almost nothing"
    assert result["violations"] == []
    assert set(result["faults_by_kind"]) == {
        "engine_kill",
        "daemon_kill",
        "link_cut",
        "daemon_stop",
        "netem",
        "bad_cert",
    }
    assert result["refusals"], "the callers with a certificate not allowed were never refused"
