"""The wheels a bare GPU machine lacks, for tools/gpu_check.py: which ones (pinned), which builds
fit the GPU machine's Python and glibc, whether they fit beside the tree in what may travel
(64 MiB), the manifest that records them, and ``--prepare`` (pip download, then slimming NIXL's
wheel of what kvd never loads). Standard library only: it runs before anything it installs.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST_SCHEMA = "kvd-gpu-check-wheels/1"
BUDGET_BYTES = 64 << 20  # what the tree, shared/ and carried folders may weigh together

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREPARE, EXIT_NO_CUDA = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One wheel the GPU machine lacks, pinned to the version the tree is tested with."""

    name: str
    version: str
    why: str

    @property
    def key(self) -> str:
        return normalize(self.name)

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


WHEELS = (
    Requirement("nixl-cu13", "1.5.1", "NIXL built for CUDA 13 (the machine's torch is cu130): kvd's data plane"),
    Requirement("nixl", "1.5.1", "the `nixl` package kvd imports: picks nixl_cu13 by torch's CUDA version"),
    Requirement("grpcio-health-checking", "1.85.1", "the daemon's gRPC health service"),
    Requirement("grpcio-reflection", "1.85.1", "the daemon's gRPC reflection service"),
    Requirement("protobuf", "7.36.2", "the runtime client/v1 was generated for (gencode 7.35.1 needs >= 7.35)"),
    Requirement("grpcio", "1.85.1", "client/v1's stubs refuse an older grpcio (the GPU image has 1.84.0)"),
)

# Members of a fetched wheel that kvd never loads, dropped by --prepare so that the set fits the
# budget: nixl-cu13 carries NIXL's expert-parallel extension (nixl_ep_cu13, three builds for torch
# 2.12-2.14, ~25 MiB compressed), which nothing in nixl_cu13 or kvd imports.
SLIM = {"nixl-cu13": ("nixl_ep_cu13/",)}


@dataclasses.dataclass(frozen=True)
class Target:
    """The GPU machine's interpreter and platform, as pip download is told them."""

    python: tuple[int, int] = (3, 12)
    machine: str = "x86_64"
    glibc: tuple[int, int] = (2, 28)  # newest manylinux asked for; older ones are compatible

    def pip_flags(self) -> list[str]:
        flags = ["--python-version", f"{self.python[0]}.{self.python[1]}", "--implementation", "cp"]
        for tag in self.platforms():
            flags += ["--platform", tag]
        return flags

    def platforms(self) -> list[str]:
        """manylinux tags from the newest allowed down (pip matches each exactly)."""
        major, newest = self.glibc
        tags = [f"manylinux_{major}_{minor}_{self.machine}" for minor in range(newest, 16, -1)]
        return [*tags, f"manylinux2014_{self.machine}", f"manylinux1_{self.machine}"]


TARGET = Target()


# --- wheels: names, tags, selection, budget --------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class WheelFile:
    """A wheel's file name, parsed (PEP 427: name-version[-build]-python-abi-platform.whl)."""

    path: Path
    name: str
    version: str
    pythons: tuple[str, ...]
    abis: tuple[str, ...]
    platforms: tuple[str, ...]

    @property
    def key(self) -> str:
        return normalize(self.name)

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def parse_wheel(path: Path) -> WheelFile | None:
    """The parsed name of ``path``, or None if it is not a wheel's file name."""
    if not path.name.endswith(".whl"):
        return None
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    name, version, python, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    return WheelFile(path, name, version, tuple(python.split(".")), tuple(abi.split(".")), tuple(plat.split(".")))


def _platform_ok(tag: str, target: Target) -> bool:
    if tag == "any":
        return True
    legacy = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
    for prefix, glibc in legacy.items():
        if tag == f"{prefix}_{target.machine}":
            return glibc <= target.glibc
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if match is None:
        return False
    return match[3] == target.machine and (int(match[1]), int(match[2])) <= target.glibc


def _python_ok(python: str, abi: str, target: Target) -> bool:
    major, minor = target.python
    if abi == "none":
        return python in (f"py{major}", f"py{major}{minor}", f"cp{major}{minor}")
    if abi == "abi3":
        found = re.fullmatch(rf"cp{major}(\d+)", python)
        return found is not None and int(found[1]) <= minor
    return python == f"cp{major}{minor}" and abi == f"cp{major}{minor}"


def compatible(wheel: WheelFile, target: Target = TARGET) -> bool:
    """Whether pip on the target would install ``wheel`` (its interpreter, ABI and platform)."""
    python_ok = any(_python_ok(p, a, target) for p in wheel.pythons for a in wheel.abis)
    return python_ok and any(_platform_ok(p, target) for p in wheel.platforms)


@dataclasses.dataclass
class Selection:
    """Which wheel of a folder serves each requirement, and what is wrong with the folder."""

    chosen: dict[str, WheelFile]
    missing: list[Requirement]
    extra: list[Path]  # files that are not chosen (they travel all the same, and weigh)


def select_wheels(folder: Path, wanted: Sequence[Requirement], target: Target = TARGET) -> Selection:
    """For each requirement, the one compatible wheel of its exact version in ``folder``.

    Several candidates (a manylinux2014 and a manylinux_2_28 build, say): the newest platform
    wins, deterministically; the others are reported as extra. Only one version of each project
    may be installed, so wheels of other versions are never chosen.
    """
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    wheels = [w for w in (parse_wheel(p) for p in files) if w is not None]
    chosen: dict[str, WheelFile] = {}
    missing: list[Requirement] = []
    for req in wanted:
        candidates = [w for w in wheels if w.key == req.key and w.version == req.version and compatible(w, target)]
        if not candidates:
            missing.append(req)
            continue
        chosen[req.key] = max(candidates, key=lambda w: (_platform_rank(w), w.path.name))
    used = {w.path for w in chosen.values()}
    extra = [p for p in files if p not in used and p.name != "manifest.json"]
    return Selection(chosen, missing, extra)


def _platform_rank(wheel: WheelFile) -> tuple[int, int]:
    best = (0, 0)
    for tag in wheel.platforms:
        match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
        if match:
            best = max(best, (int(match[1]), int(match[2])))
        elif tag.startswith("manylinux2014"):
            best = max(best, (2, 17))
        elif tag.startswith("manylinux1"):
            best = max(best, (2, 5))
    return best


def tree_bytes(root: Path = ROOT) -> tuple[int, int]:
    """(bytes, files) of what travels with the tree: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    total = count = 0
    for name in filter(None, listed.decode(errors="surrogateescape").split("\0")):
        try:
            total += (root / name).lstat().st_size
            count += 1
        except FileNotFoundError:  # deleted but still in the index
            continue
    return total, count


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


@dataclasses.dataclass(frozen=True)
class Budget:
    """Whether the wheels fit beside the tree in what may travel."""

    wheels: int
    tree: int
    limit: int = BUDGET_BYTES

    @property
    def total(self) -> int:
        return self.wheels + self.tree

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def describe(self) -> str:
        verdict = "fits" if self.fits else f"is {mib(self.total - self.limit)} OVER"
        return (
            f"wheels {mib(self.wheels)} + tree {mib(self.tree)} = {mib(self.total)} "
            f"of the {mib(self.limit)} that may travel: {verdict}"
        )


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, selection: Selection, wanted: Sequence[Requirement]) -> Path:
    """folder/manifest.json: the chosen wheels with sizes and digests (the GPU side checks them)."""
    reasons = {r.key: r for r in wanted}
    entries = [
        {
            "requirement": str(reasons[key]),
            "why": reasons[key].why,
            "file": wheel.path.name,
            "bytes": wheel.size,
            "sha256": sha256(wheel.path),
        }
        for key, wheel in selection.chosen.items()
    ]
    path = folder / "manifest.json"
    path.write_text(json.dumps({"schema": MANIFEST_SCHEMA, "wheels": entries}, indent=2) + "\n")
    return path


def manifest_problems(folder: Path) -> tuple[list[Path], list[str]]:
    """(wheels to install, problems) from folder/manifest.json; a wheel missing or changed is a problem."""
    data = json.loads((folder / "manifest.json").read_text())
    if data.get("schema") != MANIFEST_SCHEMA:
        return [], [f"{folder / 'manifest.json'} is not a {MANIFEST_SCHEMA} manifest: run --prepare again"]
    files: list[Path] = []
    problems: list[str] = []
    for entry in data["wheels"]:
        path = folder / entry["file"]
        if not path.is_file():
            problems.append(f"{entry['file']} ({entry['requirement']}) is missing: was {folder} carried whole?")
        elif path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            problems.append(f"{entry['file']} differs from what --prepare fetched (size or sha256): fetch it again")
        else:
            files.append(path)
    return files, problems


# --- --prepare -------------------------------------------------------------------------------------


def slim_wheel(path: Path, drop: Sequence[str]) -> int:
    """Rewrite the wheel at ``path`` without its members under ``drop``; the bytes saved (0: nothing to drop).

    The members' RECORD lines go too, so that pip installs exactly what remains. Not a zip file
    (a placeholder in a test, say): left as it is.
    """
    if not zipfile.is_zipfile(path):
        return 0
    prefixes = tuple(drop)
    with zipfile.ZipFile(path) as source:
        kept = [m for m in source.infolist() if not m.filename.startswith(prefixes)]
        if len(kept) == len(source.infolist()):
            return 0
        before = path.stat().st_size
        slim = path.with_name(path.name + ".slim")
        with zipfile.ZipFile(slim, "w", compression=zipfile.ZIP_DEFLATED) as target:
            for member in kept:
                data = source.read(member)
                if member.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if not line.startswith(prefixes)).encode()
                target.writestr(member, data, compress_type=zipfile.ZIP_DEFLATED)
    slim.replace(path)
    return before - path.stat().st_size


def parse_requirement(text: str) -> Requirement:
    name, sep, version = text.partition("==")
    if not sep or not name or not version:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME==VERSION")
    return Requirement(name, version, "asked for with --extra")


def prepare(dest: Path, wanted: Sequence[Requirement], limit: int, pip: Sequence[str], fetch: bool = True) -> int:
    """Download what is missing from ``dest``, pick one wheel per requirement, check the budget."""
    dest.mkdir(parents=True, exist_ok=True)
    if fetch:
        for req in select_wheels(dest, wanted).missing:
            print(f"fetching {req} ({req.why}) ...", flush=True)
            command = [*pip, "download", "--no-deps", "--only-binary=:all:", *TARGET.pip_flags(), "-d", str(dest)]
            done = subprocess.run([*command, str(req)], check=False)
            if done.returncode != 0:
                print(f"gpu-check --prepare: pip could not fetch {req} (exit {done.returncode})", file=sys.stderr)
                return EXIT_PREPARE
    selection = select_wheels(dest, wanted)
    for key, drop in SLIM.items():
        if key in selection.chosen and (saved := slim_wheel(selection.chosen[key].path, drop)):
            print(f"slimmed {selection.chosen[key].path.name}: dropped {', '.join(drop)} ({mib(saved)} saved)")
    if selection.missing:
        names = ", ".join(map(str, selection.missing))
        print(f"gpu-check --prepare: no compatible wheel in {dest} for {names}", file=sys.stderr)
        return EXIT_PREPARE
    print(f"wheels in {dest} for Python {TARGET.python[0]}.{TARGET.python[1]} {TARGET.machine}:")
    for wheel in sorted(selection.chosen.values(), key=lambda w: -w.size):
        print(f"  {mib(wheel.size):>10}  {wheel.path.name}")
    for path in selection.extra:
        print(f"  {mib(path.stat().st_size):>10}  {path.name}  (not needed, but it travels: delete it)")
    tree, files = tree_bytes()
    budget = Budget(folder_bytes(dest), tree, limit)
    print(f"tree: {files} files; {budget.describe()}")
    if not budget.fits:
        print(
            f"gpu-check --prepare: {dest} and the tree weigh {mib(budget.total)}, over the {mib(limit)} that may "
            "travel: remove the extra files listed above, or carry fewer wheels",
            file=sys.stderr,
        )
        return EXIT_PREPARE
    write_manifest(dest, selection, wanted)  # only for a set that fits: the GPU side installs what it lists
    print(f"ready: carry {dest.name}/ with the tree, then run `bash scripts/gpu-check.sh` on the GPU machine")
    return EXIT_OK
