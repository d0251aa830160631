"""One version in every artefact: every place that names kvd's version in text (the DaemonSet's
image, the node image, the systemd unit, CHANGELOG's top section, the README's and the operations
guide's examples) names the one in client/version.py, and tools/bump_version.py moves them all.
(The wheels, `kvd --version`, GetStatus and kvd_build_info read client/version.py when built or
run: tests/integration/test_packaging.py and test_release.py check those.)"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvd_client.version import __version__

REPO = Path(__file__).resolve().parents[2]


def _bump_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bump_version", REPO / "tools" / "bump_version.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bump_version = _bump_tool()


def test_every_place_names_the_one_version() -> None:
    named = bump_version.versions()
    assert {place.path for place, _ in named} >= {
        "client/version.py", "CHANGELOG.md", "deploy/daemonset.yaml", "deploy/Containerfile", "deploy/kvd.service",
    }  # fmt: skip
    wrong = [f"{place.path} ({place.what}): {version}" for place, version in named if version != __version__]
    assert wrong == [], f"not {__version__}; run `python tools/bump_version.py {__version__}`"


def test_the_check_command_agrees() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bump_version.py")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(__version__) == len(bump_version.PLACES)


@pytest.fixture
def copy_of_places(tmp_path: Path) -> Path:
    for place in bump_version.PLACES:
        (tmp_path / place.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / place.path, tmp_path / place.path)
    return tmp_path


def test_bump_moves_every_place_and_nothing_else(copy_of_places: Path) -> None:
    changelog_before = (copy_of_places / "CHANGELOG.md").read_text()
    changed = bump_version.bump("9.8.7", repo=copy_of_places)
    assert {p.relative_to(copy_of_places).as_posix() for p in changed} == {p.path for p in bump_version.PLACES}
    assert {version for _, version in bump_version.versions(copy_of_places)} == {"9.8.7"}
    changelog = (copy_of_places / "CHANGELOG.md").read_text()
    assert changelog.replace("## 9.8.7", f"## {__version__}", 1) == changelog_before  # older sections untouched


def test_bump_refuses_a_bad_version_or_a_lost_place_and_writes_nothing(copy_of_places: Path) -> None:
    with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
        bump_version.bump("next", repo=copy_of_places)
    service = copy_of_places / "deploy" / "kvd.service"
    service.write_text(service.read_text().replace(f"kvd {__version__},", "kvd,"))
    version_file = copy_of_places / "client" / "version.py"
    before = version_file.read_text()
    with pytest.raises(bump_version.VersionPlaceMissing, match="kvd.service"):
        bump_version.bump("9.8.7", repo=copy_of_places)
    assert version_file.read_text() == before
