"""Building and installing the release as a user gets it: both distributions built from a clean
copy of the checkout, venvs made outside it. Shared by tests/integration/test_packaging.py (what
the distributions hold) and tests/integration/test_release.py (the installed release running).

Each subprocess runs with an environment stripped of what would let it see the checkout
(``PYTHONPATH``, ``VIRTUAL_ENV``, this venv's ``bin`` on ``PATH``), from a directory outside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variables that point at the checkout or its venv."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env.update(extra)
    return env


def run(
    *args: str | Path, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; a non-zero exit fails with the end of its output."""
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def tracked_files() -> list[str]:
    """What a clean clone of this checkout holds (tracked and new, unignored files)."""
    listed = run("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=REPO).stdout
    return [name for name in filter(None, listed.split("\0")) if (REPO / name).is_file()]


def source_copy(dest: Path) -> Path:
    """A clean clone's files copied to ``dest``: no build leftovers (egg-info, build/) of the
    working tree leak into the distributions."""
    for name in tracked_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest


def build_distributions(work: Path) -> Path:
    """sdists and wheels of both distributions (each wheel built from its sdist, so an sdist
    missing a file fails here), in ``work/dist``."""
    src = source_copy(work / "src")
    out = work / "dist"
    run(sys.executable, "-m", "build", "--outdir", out, src, cwd=work)
    run(sys.executable, "-m", "build", "--outdir", out, src / "client", cwd=work)
    return out


def one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


def base_python() -> str:
    """The interpreter this venv was made from: new venvs are made from it, not nested in ours."""
    return getattr(sys, "_base_executable", sys.executable)
