"""The soak: two kvd daemons, 2 MiB pulls both ways for ``--minutes N`` (default 30), engines
re-registered on fresh shm every 25th iteration, a refused and a cancelled pull every 10th; it
reports each daemon's private memory (RssAnon, control process + workers) and fds over time and
whether they are flat after warm-up. ``python scripts/soak.py --minutes 30`` (no root needed).

See docs/fleet.md ("The soak"). The code lives in tests/fleet/soak.py; this script only finds it
(and the project's virtual environment, when started with another Python).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python_with_kvd() -> None:
    """Re-run under the project's .venv when this interpreter cannot import kvd."""
    try:
        import kvd  # noqa: F401, PLC0415
    except ImportError:
        venv = ROOT / ".venv" / "bin" / "python"
        if venv.exists() and Path(sys.executable).resolve() != venv.resolve():
            os.execv(str(venv), [str(venv), *sys.argv])
        raise


if __name__ == "__main__":
    _python_with_kvd()
    sys.path.insert(0, str(ROOT / "tests"))
    from fleet.soak import main

    sys.exit(main())
