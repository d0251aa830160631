from __future__ import annotations

import sys
from pathlib import Path

# The reference engine's tests share the engine patch's fakes (tests/unit/engine_patch/engine_fakes.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine_patch"))
