"""Each generated sync front end (client/sync.py, client/_engine_stream.py) is exactly what
tools/gen_sync.py makes from its asyncio source (the CI check)."""

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
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_checked_in_sync_front_ends_are_generated_from_the_asyncio_ones() -> None:
    """If this fails, edit the asyncio source (never the generated file), run
    `python tools/gen_sync.py` and commit both files."""
    result = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_covers_the_client_and_the_engine_stream() -> None:
    assert {(p.source, p.target) for p in _gen_sync().PAIRS} == {
        ("client/aio.py", "client/sync.py"),
        ("client/_aio_engine_stream.py", "client/_engine_stream.py"),
    }


def _pair(gen: ModuleType, target: str) -> object:
    return next(p for p in gen.PAIRS if p.target == target)


def test_check_fails_with_a_diff_on_a_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _gen_sync()
    # The generator reads sources and targets under ROOT: a copy of them, client/sync.py stale.
    root = tmp_path / "repo"
    (root / "client").mkdir(parents=True)
    for pair in gen.PAIRS:
        for path in (pair.source, pair.target):
            (root / path).write_text((REPO / path).read_text())
    stale = root / "client" / "sync.py"
    stale.write_text(stale.read_text().replace("Block until", "Wait for"))
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    monkeypatch.setattr(gen, "ROOT", root)
    monkeypatch.setattr(sys, "argv", ["gen_sync.py", "--check"])
    assert gen.main() == 1
    captured = capsys.readouterr()
    assert "-        " + '"""Wait for the transfer ends' in captured.out
    assert "+        " + '"""Block until the transfer ends' in captured.out
    assert "client/sync.py is stale" in captured.err and "_engine_stream.py is stale" not in captured.err


def test_a_prose_pair_that_no_longer_matches_fails_the_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edited docstring whose sync wording lives in a pair's text must not silently keep the async one."""
    gen = _gen_sync()
    source = tmp_path / "client" / "aio.py"
    source.parent.mkdir()
    source.write_text((REPO / "client" / "aio.py").read_text().replace("Wait until the transfer", "Wait for the"))
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="found 0 times"):
        gen.generate(_pair(gen, "client/sync.py"))


def test_an_asyncio_only_block_is_left_out_of_the_sync_twin() -> None:
    """``__aiter__`` and grpc.aio's CancelledError branch are the asyncio stream's alone."""
    aio = (REPO / "client" / "_aio_engine_stream.py").read_text()
    sync = (REPO / "client" / "_engine_stream.py").read_text()
    assert "def __aiter__" in aio and "CancelledError" in aio
    assert "__iter__" not in sync and "_iterate" not in sync and "asyncio" not in sync


def test_the_generated_files_say_so() -> None:
    gen = _gen_sync()
    for pair in gen.PAIRS:
        assert (REPO / pair.target).read_text().startswith(gen.HEADER.format(source=pair.source)), pair.target
