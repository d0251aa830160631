"""Fixtures of the engine-patch unit tests (``import engine_fakes`` works from every test here)."""

from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put test folders on sys.path; the shared fakes live here.
sys.path.insert(0, str(Path(__file__).resolve().parent))
