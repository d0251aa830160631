"""Tests that need vLLM: skipped cleanly (not collected) when vLLM is not installed.

vLLM runs here on CPU without a network: VLLM_TARGET_DEVICE=cpu, HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # vllm_harness
sys.path.insert(0, str(HERE.parent / "unit" / "engine_patch"))  # engine_fakes

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
