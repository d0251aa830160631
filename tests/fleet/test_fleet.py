"""CI's short fleets: 4 nodes for 2 minutes, once plain and once with ``--load``, each with the
data-plane worker faults (killed, crashed, hung) and a share of the other kinds, every invariant
held.

Runs ``scripts/fleet.py`` as a child process, as an operator would (docs/fleet.md), and checks its
exit code (0 only when every invariant held), its last line and its JSON report. Each run draws a
new seed (``KVD_FLEET_SEED`` fixes it), printed and named in every failure: ``scripts/fleet.py
--seed S`` with the same options replays it. The two runs split the fault kinds between them so
that together they cover every kind within CI's budget (a rolling restart of 4 daemons alone takes
about a minute on a loaded machine). Needs root and network namespaces (CI runs as root); skipped
with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.run import FAULT_KINDS

pytestmark = [pytest.mark.fleet, pytest.mark.slow, pytest.mark.chaos, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
WORKER_FAULTS = {"worker_kill", "worker_segv", "worker_hang"}
RUNS = {
    "plain": ([], WORKER_FAULTS | {"daemon_restart", "rolling_restart", "engine_kill", "bad_cert"}),
    "load": (["--load"], WORKER_FAULTS | {"daemon_kill", "daemon_stop", "link_cut", "netem"}),
}


def test_the_two_runs_cover_every_fault_kind() -> None:
    assert set().union(*(kinds for _, kinds in RUNS.values())) == set(FAULT_KINDS)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_short_fleet_holds_every_invariant(tmp_path: Path, run_name: str) -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    flags, kinds = RUNS[run_name]
    seed = int(os.environ.get("KVD_FLEET_SEED") or random.SystemRandom().randrange(1, 1_000_000))
    faults = ",".join(sorted(kinds))
    replay = f"scripts/fleet.py --nodes 4 --minutes 2 --seed {seed} {' '.join(flags)} --faults {faults}"
    print(f"fleet ({run_name}): seed {seed}; replay: {replay}")
    report = tmp_path / "fleet.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "fleet.py"),
            "--nodes",
            "4",
            "--minutes",
            "2",
            "--seed",
            str(seed),
            *flags,
            "--faults",
            faults,
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=640,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, f"seed {seed}: {run.stderr[-3000:]}"
    last = lines[-1]
    assert run.returncode == 0, (
        f"fleet failed (exit {run.returncode}), replay: {replay}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    )
    assert re.match(r"^fleet: pulls=(\d+) wrong=0 lost=0 crashed=0 .* OK$", last), f"{replay}: {last}"
    result = json.loads(report.read_text())
    assert result["seed"] == seed
    assert result["pulls"] > 100, f"{replay}: the fleet moved almost nothing"
    assert result["violations"] == []
    assert set(result["faults_by_kind"]) == kinds, replay
    assert {w["kind"] for w in result["worker_recovery"]} == WORKER_FAULTS
    assert all(w["exact_pull_s"] is not None for w in result["worker_recovery"]), replay
    if "bad_cert" in kinds:
        assert result["refusals"], "the callers with a certificate not allowed were never refused"
    if flags:
        assert result["load"]["hogs"] >= 1
