"""client/sync.py is exactly what tools/gen_sync.py makes from client/aio.py (the CI check)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "gen_sync.py"


def _gen_sync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvd_tools_gen_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_sync_client_is_generated_from_the_asyncio_one() -> None:
    """If this fails, edit client/aio.py (never client/sync.py), run `python tools/gen_sync.py`
    and commit both files."""
    result = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_fails_with_a_diff_on_a_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _gen_sync()
    stale = tmp_path / "sync.py"
    stale.write_text((REPO / "client" / "sync.py").read_text().replace("Block until", "Wait for"))
    monkeypatch.setattr(gen, "TARGET", stale)
    monkeypatch.setattr(sys, "argv", ["gen_sync.py", "--check"])
    assert gen.main() == 1
    out = capsys.readouterr().out
    assert "-        " + '"""Wait for the transfer ends' in out
    assert "+        " + '"""Block until the transfer ends' in out


def test_a_prose_pair_that_no_longer_matches_fails_the_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edited docstring whose sync wording lives in TEXT must not silently keep the async one."""
    gen = _gen_sync()
    source = tmp_path / "aio.py"
    source.write_text((REPO / "client" / "aio.py").read_text().replace("Wait until the transfer", "Wait for the"))
    monkeypatch.setattr(gen, "SOURCE", source)
    with pytest.raises(SystemExit, match="found 0 times"):
        gen.generate()


def test_the_generated_file_says_so() -> None:
    assert (REPO / "client" / "sync.py").read_text().startswith(_gen_sync().HEADER)
