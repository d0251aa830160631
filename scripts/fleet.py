"""A fleet in a box: N nodes (network namespaces), kvd daemons with mTLS, engines, a router,
faults, invariants. Run as root: ``python scripts/fleet.py --nodes 6 --minutes 3 --seed 1``.

See docs/fleet.md. The code lives in tests/fleet/; this script only finds it (and the project's
virtual environment, when started with another Python).
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
    from fleet.run import main

    sys.exit(main())
