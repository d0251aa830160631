"""Every place that names kvd's version, read together and changed together.

The one source is ``client/version.py`` (both wheels, ``kvd --version``, ``GetStatus.version``,
``kvd_build_info`` and every client's ``user-agent`` read it at build or run time). The places
below copy it in text a person or a tool reads without running kvd: the DaemonSet's image tag,
the node image recipe, the systemd unit's header, CHANGELOG's top section, and the examples in
the README and docs/operations.md. ``tests/unit/test_versions.py`` fails when any of them
disagrees with ``client/version.py``; this command moves them all at once.

Usage: python tools/bump_version.py [NEW_VERSION]
  (no argument)  print each place and the version it names; exit 1 if they disagree
  NEW_VERSION    rewrite every place to NEW_VERSION (CHANGELOG's top heading keeps its suffix,
                 e.g. "(unreleased)"); exit 1, changing nothing, if a place is not found
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSION = r"(?P<version>\d+\.\d+\.\d+(?:[a-z]+\d+)?)"


@dataclasses.dataclass(frozen=True)
class Place:
    """One mention of the version: a file and a pattern whose ``version`` group is the version.
    ``count`` is how many times the pattern must match (every match is one mention)."""

    path: str
    pattern: str
    what: str
    count: int = 1

    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern, re.MULTILINE)


PLACES: tuple[Place, ...] = (
    Place("client/version.py", rf'^__version__ = "{VERSION}"$', "the one source: both wheels, the daemon, clients"),
    Place("CHANGELOG.md", rf"^## {VERSION}\b", "CHANGELOG's top section (the first '## ' heading)"),
    Place("deploy/daemonset.yaml", rf"image: \S+/kvd:{VERSION}$", "the DaemonSet's image tag"),
    Place("deploy/Containerfile", rf"^ARG KVD_VERSION={VERSION}$", "the node image's wheels"),
    Place("deploy/kvd.service", rf"^# systemd unit for kvd {VERSION},", "the systemd unit's header"),
    Place("README.md", rf"kvd --version +# kvd {VERSION}:", "README's `kvd --version` example"),
    Place("docs/operations.md", rf"`kvd {VERSION}`: the installed CLI", "operations.md's versions table"),
    Place("docs/operations.md", rf"`kvd {VERSION} serving: ", "operations.md's start-up log line"),
    Place("docs/operations.md", rf"up 2h03m, version {VERSION}$", "operations.md's `kvd status` example"),
)


class VersionPlaceMissing(Exception):
    """A place's pattern no longer matches its file as often as it should: the file changed
    shape, and this tool (and the test) must be told where the version went."""


def _matches(place: Place, text: str) -> list[re.Match[str]]:
    found = list(place.regex().finditer(text))
    if place.path == "CHANGELOG.md":
        found = found[:1]  # only the top section: older sections keep their versions
    if len(found) != place.count:
        raise VersionPlaceMissing(
            f"{place.path}: {place.what}: expected {place.count} match(es) of {place.pattern!r}, found {len(found)}"
        )
    return found


def versions(repo: Path = REPO) -> list[tuple[Place, str]]:
    """Each place and the version it names now."""
    named: list[tuple[Place, str]] = []
    for place in PLACES:
        text = (repo / place.path).read_text()
        named.extend((place, match["version"]) for match in _matches(place, text))
    return named


def bump(new: str, repo: Path = REPO) -> list[Path]:
    """Rewrite every place to ``new``; the files changed. Checks every place before writing any."""
    if not re.fullmatch(VERSION, new):
        raise ValueError(f"{new!r} is not a version of the form MAJOR.MINOR.PATCH (optionally rcN)")
    texts: dict[str, str] = {}
    for place in PLACES:
        text = texts.setdefault(place.path, (repo / place.path).read_text())
        match = _matches(place, text)[0]
        start, end = match.span("version")
        texts[place.path] = text[:start] + new + text[end:]
    changed = []
    for path, text in texts.items():
        target = repo / path
        if target.read_text() != text:
            target.write_text(text)
            changed.append(target)
    return changed


def main(argv: list[str]) -> int:
    try:
        if argv:
            for path in bump(argv[0]):
                print(f"updated {path.relative_to(REPO)}")
            return 0
        named = versions()
    except (VersionPlaceMissing, ValueError) as exc:
        print(f"bump_version: {exc}", file=sys.stderr)
        return 1
    for place, version in named:
        print(f"{version:<10} {place.path}: {place.what}")
    if len({version for _, version in named}) != 1:
        print("bump_version: the places disagree; run `python tools/bump_version.py VERSION`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
