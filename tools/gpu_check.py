"""kvd GPU check: prove kvd's GPU paths on a bare, offline accelerator machine, in one command.

Usage (through scripts/gpu-check.sh, which runs this file):

  bash scripts/gpu-check.sh --prepare      on a machine that reaches PyPI: download into .whl/
                                            the wheels the GPU machine lacks, and check that they
                                            fit beside the tree in what may travel (64 MiB)
  bash scripts/gpu-check.sh [--out DIR]    on the GPU machine (offline): install those wheels to
                                            a private folder, then run the GPU checks and write
                                            the report under DIR (default $OUT, else
                                            build/gpu-check/out)

The GPU machine is assumed bare and offline, as many cluster nodes are: Python 3.12, torch
2.11+cu130, numpy, grpcio, protobuf, prometheus-client, pytest, pytest-timeout and hypothesis,
and no package registry; the tree arrives as a copy. What it lacks travels as wheels in .whl/:
NIXL's CUDA 13 build (nixl-cu13, 59 MB, slimmed to ~34 MB by dropping its expert-parallel
extension, which kvd never loads) and the `nixl` shim that loads it, the gRPC health and
reflection services, the protobuf runtime client/v1 was generated for, and a grpcio new enough
for the generated stubs (the GPU image has 1.84.0; they need 1.85.1). They are installed
with `pip install --no-index --no-deps --target build/gpu-check/site` (nothing outside the tree
is touched), and kvd, kvd_client and kvd_engine are made importable from the tree through a
folder of links (build/gpu-check/src: kvd_client -> client/, kvd_engine -> engine_patch/, as
pyproject.toml maps them), both put on PYTHONPATH of every step.

The steps, in order (each with its own time limit; output in gpu-check.log):
  environment    install the wheels; import everything the GPU tests and the daemon import
  pytest_gpu     `pytest -m gpu` over the test files that hold GPU tests (tests/gpu, ...)
  vram_selftest  `kvd selftest --vram`: two daemons, the engines' KV caches in GPU memory
                 registered through CUDA IPC, pulled VRAM to VRAM, every byte verified, GB/s
                 beside a raw NIXL VRAM -> VRAM read of the same bytes
  vram_paths     bare NIXL READs between two processes (kvd.bench.vram_paths): from VRAM the
                 holder allocated and from VRAM it opened by CUDA IPC as kvd's worker does;
                 GB/s, and whether each READ completes without the holder's progress
  conversions    every layout-conversion pair of `kvd bench` on the GPU against torch copy_
  no_sync        the engine's step path under torch.cuda.set_sync_debug_mode("error")

Output under the out folder: gpu-check.json (the report: machine, CUDA, wheels, every step
with its status, reason, figures and per-test results), gpu-check.txt (a short summary, also
printed), gpu-check.log (every step's output), pytest-gpu.xml (JUnit).

Without a CUDA device (torch absent, or torch.cuda.is_available() False) the kit says so, runs
the environment step, marks every GPU step "skipped: no CUDA device" with the reason, still
writes the report, and exits 4.

Exit status: 0 every step passed; 1 a step failed (the report says which and why); 2 bad usage
or the kit itself could not run; 3 (--prepare) the wheels could not be fetched or do not fit
the budget; 4 no CUDA device (nothing GPU was run).

Only the standard library is used here: the kit runs before anything it installs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "kvd-gpu-check/1"
MANIFEST_SCHEMA = "kvd-gpu-check-wheels/1"
BUDGET_BYTES = 64 << 20  # what the tree, shared/ and carried folders may weigh together
PACKAGES = {"kvd": "kvd", "kvd_client": "client", "kvd_engine": "engine_patch"}  # setup.py's SOURCE_FOLDERS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREPARE, EXIT_NO_CUDA = 0, 1, 2, 3, 4
NO_CUDA = "skipped: no CUDA device"


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


# --- the run on the GPU machine --------------------------------------------------------------------


CUDA_PROBE = r"""
import json, sys
out = {"available": False, "torch": None, "torch_cuda": None, "devices": [], "reason": "",
       "python": list(sys.version_info[:2])}
try:
    import torch
except Exception as exc:
    out["reason"] = f"torch is not importable: {type(exc).__name__}: {exc}"
else:
    out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
    try:
        out["available"] = bool(torch.cuda.is_available())
        if out["available"]:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                out["devices"].append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                                       "capability": f"{p.major}.{p.minor}"})
        elif torch.version.cuda is None:
            out["reason"] = f"torch {torch.__version__} is a CPU-only build"
        else:
            out["reason"] = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device: " \
                            "torch.cuda.is_available() is False"
    except Exception as exc:
        out["available"] = False
        out["reason"] = f"CUDA failed to initialise: {type(exc).__name__}: {exc}"
json.dump(out, sys.stdout)
"""

# What the GPU tests, the daemon and the selftest import; each is reported with its version.
IMPORTS = (
    "torch",
    "numpy",
    "grpc",
    "google.protobuf",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "prometheus_client",
    "nixl._api",
    "pytest",
    "pytest_timeout",
    "hypothesis",
    "kvd",
    "kvd_client",
    "kvd_engine",
    "kvd.server.app",
    "kvd.cli.selftest_vram",
)

IMPORT_PROBE = r"""
import importlib, json, sys
from importlib import metadata
out = {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        continue
    version = getattr(module, "__version__", None)
    top = name.split(".")[0]
    dist = {"google": "protobuf", "grpc": "grpcio", "nixl": "nixl-cu13", "grpc_health": "grpcio-health-checking",
            "grpc_reflection": "grpcio-reflection", "prometheus_client": "prometheus-client",
            "pytest_timeout": "pytest-timeout"}.get(top, top)
    if version is None:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = None
    where = getattr(module, "__file__", None) or ""
    out[name] = {"ok": True, "version": str(version) if version else None, "file": where}
json.dump(out, sys.stdout)
"""


@dataclasses.dataclass
class Step:
    """One check, as the report holds it."""

    name: str
    title: str
    status: str = "pending"  # passed | failed | skipped
    reason: str = ""
    summary: str = ""
    duration_s: float = 0.0
    command: list[str] = dataclasses.field(default_factory=list)
    exit_code: int | None = None
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.status, self.reason, self.summary = "skipped", reason, reason

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


STEPS = (
    ("environment", "install the wheels; everything the GPU tests and the daemon import"),
    ("pytest_gpu", "pytest -m gpu over the files that hold GPU tests"),
    ("vram_selftest", "kvd selftest --vram: CUDA IPC registration, VRAM -> VRAM pulls vs raw NIXL"),
    ("vram_paths", "bare NIXL READs of VRAM a process allocated vs VRAM it opened by CUDA IPC (kvd.bench.vram_paths)"),
    ("conversions", "layout-conversion pairs on the GPU against torch copy_"),
    ("no_sync", "no GPU -> CPU sync on the engine's step path (set_sync_debug_mode)"),
)
GPU_STEPS = tuple(name for name, _ in STEPS if name != "environment")
TIMEOUTS_S = {
    "environment": 120,
    "pytest_gpu": 240,
    "vram_selftest": 120,
    "vram_paths": 120,
    "conversions": 120,
    "no_sync": 60,
}
NO_SYNC_TESTS = (
    "tests/unit/engine_patch/test_engine_gpu.py::test_nwor_commit_path_never_syncs_on_the_device",
    "tests/unit/engine_patch/test_engine_gpu.py::test_signals_wait_for_the_steps_kernels_off_the_step_path",
)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Test files holding a ``gpu``-marked test (pytest collects only these: no unrelated imports)."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        if re.search(r"pytest\.mark\.gpu\b", path.read_text(errors="replace")):
            found.append(str(path.relative_to(root)))
    return found


class Runner:
    """Runs the steps as child processes (own process group, time limit), logging their output."""

    def __init__(self, python: str, out: Path, work: Path, env: dict[str, str]) -> None:
        self.python, self.out, self.work, self.env = python, out, work, env
        self.log = (out / "gpu-check.log").open("a")

    def close(self) -> None:
        self.log.close()

    def run(
        self, step: Step, args: Sequence[str], timeout_s: float, extra_env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """Run ``python args`` for ``step`` (its environment plus ``extra_env``); return (exit code,
        the tail of its output). 124: timed out."""
        step.command = [self.python, *args]
        self.log.write(f"\n===== {step.name}: {' '.join(step.command)}\n")
        self.log.flush()
        capture = self.work / f"{step.name}.out"
        env = {**self.env, **(extra_env or {})}
        with capture.open("wb") as sink:
            child = subprocess.Popen(
                step.command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # the step and the daemons it started
                child.wait()
                code = 124
            else:
                _kill_group(child.pid)  # daemons a failed test left behind
        text = capture.read_text(errors="replace")
        self.log.write(text)
        if code == 124:
            self.log.write(f"\n[gpu-check: {step.name} killed after {timeout_s:.0f} s]\n")
        self.log.flush()
        step.exit_code = code
        return code, "\n".join(text.splitlines()[-15:])


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def probe_cuda(python: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([python, "-c", CUDA_PROBE], env=env, capture_output=True, text=True, timeout=120)
    try:
        return dict(json.loads(done.stdout))
    except json.JSONDecodeError:
        reason = f"the CUDA probe failed (exit {done.returncode}): {done.stderr.strip()[-400:]}"
        version = list(sys.version_info[:2]) if python == sys.executable else None
        return {
            "available": False,
            "torch": None,
            "torch_cuda": None,
            "devices": [],
            "reason": reason,
            "python": version,
        }


def link_packages(src: Path, root: Path = ROOT) -> None:
    """src/<import name> -> the source folder, for kvd, kvd_client and kvd_engine (no install needed)."""
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    for name, folder in PACKAGES.items():
        os.symlink(root / folder, src / name, target_is_directory=True)


def install_wheels(step: Step, runner: Runner, wheels: Path, site: Path, python: Sequence[int] | None) -> bool:
    """pip install the carried wheels into ``site`` (skipped when the same set is already there).

    Wheels built for another interpreter than ``python`` (the kit tried on a development machine
    after --prepare, say) are left out, and the report says so: the imports then decide.
    """
    if (wheels / "manifest.json").is_file():
        files, problems = manifest_problems(wheels)
    else:
        selection = select_wheels(wheels, WHEELS)
        files, problems = [w.path for w in selection.chosen.values()], []
    if problems:
        step.status, step.reason = "failed", "; ".join(problems)
        return False
    if python is not None:
        here = dataclasses.replace(TARGET, python=(int(python[0]), int(python[1])))
        foreign = [p for p in files if not compatible(parse_wheel(p) or _unknown(p), here)]
        if foreign:
            step.results["wheels_not_for_this_python"] = [p.name for p in foreign]
            files = [p for p in files if p not in foreign]
    step.results["wheels"] = [{"file": p.name, "bytes": p.stat().st_size} for p in files]
    if not files:
        step.results["wheels_note"] = f"no wheels in {wheels} for this Python: relying on what it has"
        return True
    stamp = site / ".kvd-gpu-check-wheels"
    wanted = "\n".join(sorted(f"{p.name} {p.stat().st_size}" for p in files))
    if stamp.is_file() and stamp.read_text() == wanted:
        return True
    shutil.rmtree(site, ignore_errors=True)
    args = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    code, tail = runner.run(step, [*args, "--target", str(site), *map(str, files)], TIMEOUTS_S["environment"])
    if code != 0:
        step.status, step.reason = "failed", f"pip install --target {site} failed (exit {code}): {tail}"
        return False
    stamp.write_text(wanted)
    return True


def _unknown(path: Path) -> WheelFile:
    return WheelFile(path, path.stem, "", (), (), ())


def step_environment(step: Step, runner: Runner, wheels: Path, site: Path, python: Sequence[int] | None) -> None:
    if not install_wheels(step, runner, wheels, site, python):
        step.summary = step.reason
        return
    done = subprocess.run(
        [runner.python, "-c", IMPORT_PROBE, *IMPORTS],
        cwd=ROOT,
        env=runner.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUTS_S["environment"],
    )
    try:
        imports = json.loads(done.stdout)
    except json.JSONDecodeError:
        step.status = "failed"
        step.reason = step.summary = f"the import probe failed (exit {done.returncode}): {done.stderr[-400:]}"
        return
    step.results["imports"] = imports
    broken = {name: info["error"] for name, info in imports.items() if not info["ok"]}
    if broken:
        step.status = "failed"
        step.reason = "not importable: " + "; ".join(f"{n} ({e})" for n, e in broken.items())
        step.summary = f"not importable: {', '.join(broken)} (carry their wheels: --prepare --extra NAME==VERSION)"
        return
    versions = {n: imports[n]["version"] for n in ("torch", "nixl._api", "grpc", "google.protobuf")}
    step.status = "passed"
    step.summary = (
        f"{len(step.results['wheels'])} wheels installed; all {len(imports)} imports ok "
        f"(torch {versions['torch']}, nixl {versions['nixl._api']}, grpcio {versions['grpc']}, "
        f"protobuf {versions['google.protobuf']})"
    )


def junit_results(path: Path) -> list[dict[str, Any]]:
    """Per-test outcomes of a JUnit XML file (pytest's --junitxml)."""
    if not path.is_file():
        return []
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or "")[:500]
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        results.append({"test": name, "outcome": outcome, "time_s": float(case.get("time") or 0), "message": message})
    return results


def _pytest_step(step: Step, runner: Runner, targets: Sequence[str], xml: Path, timeout_s: float) -> None:
    args = ["-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", "-q", *targets]
    code, tail = runner.run(step, args, timeout_s)
    tests = junit_results(xml)
    step.results["tests"] = tests
    counts = {k: sum(1 for t in tests if t["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    step.results["counts"] = counts
    step.summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    if code == 124:
        step.status, step.reason = "failed", f"timed out after {timeout_s:.0f} s"
    elif code != 0 or counts["failed"] or counts["error"]:
        bad = [t["test"] for t in tests if t["outcome"] in ("failed", "error")]
        step.status, step.reason = "failed", f"pytest exit {code}; failed: {', '.join(bad) or tail}"
    elif counts["passed"] == 0:
        # CUDA is present, so a GPU test that skips is a fault of the kit or the machine, not a pass
        step.status, step.reason = "failed", "no GPU test ran (all skipped or none collected)"
    elif counts["skipped"]:
        skipped = "; ".join(f"{t['test']}: {t['message']}" for t in tests if t["outcome"] == "skipped")
        step.status, step.reason = "failed", f"GPU tests skipped on a CUDA machine: {skipped}"
    else:
        step.status = "passed"


def step_pytest_gpu(step: Step, runner: Runner) -> None:
    files = gpu_test_files()
    step.results["files"] = files
    _pytest_step(step, runner, files, runner.out / "pytest-gpu.xml", TIMEOUTS_S["pytest_gpu"])


def step_no_sync(step: Step, runner: Runner) -> None:
    _pytest_step(step, runner, NO_SYNC_TESTS, runner.work / "no-sync.xml", TIMEOUTS_S["no_sync"])


def step_vram_selftest(step: Step, runner: Runner, size_mb: int, iterations: int) -> None:
    result = runner.work / "selftest-vram.json"
    result.unlink(missing_ok=True)
    args = ["-m", "kvd.cli.main", "selftest", "--vram", "--size-mb", str(size_mb), "--iterations", str(iterations)]
    # UCX prints the protocols it picks for each kind of transfer: which path VRAM -> VRAM took
    # (the first GPU run measured 0.13 GB/s for a raw NIXL read on one GPU, cause not found).
    code, tail = runner.run(
        step, [*args, "--json", str(result)], TIMEOUTS_S["vram_selftest"], extra_env={"UCX_PROTO_INFO": "y"}
    )
    data = json.loads(result.read_text()) if result.is_file() else {}
    step.results.update(data)
    step.results["ucx_protocols"] = ucx_protocol_lines((runner.work / f"{step.name}.out").read_text(errors="replace"))
    if code == 0 and data.get("passed"):
        step.status = "passed"
        step.summary = (
            f"{data['bytes'] >> 20} MiB VRAM -> VRAM verified x{iterations + 1}; kvd {data['kvd_gbs']:.2f} GB/s, "
            f"raw NIXL {data['raw_gbs']:.2f} GB/s, ratio {data['ratio']:.2f}"
        )
    else:
        step.status = "failed"
        step.reason = f"exit {code}" + (f": {data['error']}" if data.get("error") else f": {tail}")
        step.summary = step.reason.splitlines()[0][:200]


def step_vram_paths(step: Step, runner: Runner, iterations: int) -> None:
    """Why VRAM -> VRAM is slow between two processes on one GPU (0.13 GB/s raw on the first run):
    the same bare READ from memory the holder allocated and from memory it opened by CUDA IPC,
    as kvd's worker does; whether each completes without the holder's progress (one-sided)."""
    result = runner.work / "vram-paths.json"
    result.unlink(missing_ok=True)
    args = ["-m", "kvd.bench.vram_paths", "--device", "cuda", "--size-mb", "64", "--iterations", str(iterations)]
    code, tail = runner.run(
        step, [*args, "--json", str(result)], TIMEOUTS_S["vram_paths"], extra_env={"UCX_PROTO_INFO": "y"}
    )
    data = json.loads(result.read_text()) if result.is_file() else {}
    step.results.update(data)
    step.results["ucx_protocols"] = ucx_protocol_lines((runner.work / f"{step.name}.out").read_text(errors="replace"))
    cases = data.get("cases", [])
    step.summary = "; ".join(
        f"{c['case']} {c['gbs']:.2f} GB/s, one-sided {c['one_sided']}" if "gbs" in c else f"{c['case']} failed"
        for c in cases
    )
    if code == 0 and cases and all(c.get("verified") for c in cases):
        step.status = "passed"
    else:
        step.status = "failed"
        errors = [f"{c['case']}: {c['error']}" for c in cases if "error" in c]
        step.reason = f"exit {code}: " + ("; ".join(errors) if errors else tail)
        step.summary = step.summary or step.reason.splitlines()[0][:200]


def ucx_protocol_lines(output: str, limit: int = 60) -> list[str]:
    """The lines of UCX's protocol tables (``UCX_PROTO_INFO=y``) that concern GPU memory."""
    return [line.strip() for line in output.splitlines() if "|" in line and "cuda" in line.lower()][:limit]


def step_conversions(step: Step, runner: Runner, repeat: int) -> None:
    result = runner.work / "conversions.json"
    result.unlink(missing_ok=True)
    args = ["-m", "kvd.bench.convert", "--device", "cuda", "--repeat", str(repeat), "--json", str(result)]
    code, tail = runner.run(step, args, TIMEOUTS_S["conversions"])
    if code != 0 or not result.is_file():
        step.status, step.reason = "failed", f"exit {code}: {tail}"
        step.summary = f"exit {code}"
        return
    data = json.loads(result.read_text())
    step.results.update(data)
    staged = [row for row in data["rows"] if "vs_copy" in row]
    step.status = "passed"
    if staged:
        worst = min(staged, key=lambda row: row["vs_copy"])
        ratios = sorted(row["vs_copy"] for row in staged)
        step.summary = (
            f"{len(staged)} staged pairs on {data['device_name']}: conversion/copy_ median "
            f"{ratios[len(ratios) // 2]:.2f}, lowest {worst['vs_copy']:.2f} ({worst['pair']})"
        )
    else:
        step.summary = "no staged pair"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown (no git)"


def verdict_of(steps: Sequence[Step], cuda_available: bool) -> tuple[str, int]:
    if any(s.status == "failed" for s in steps):
        return "failed", EXIT_FAILED
    if not cuda_available:
        return "no_cuda", EXIT_NO_CUDA
    return "passed", EXIT_OK


def build_report(
    steps: Sequence[Step], cuda: dict[str, Any], started: str, elapsed_s: float, python: str, out: Path
) -> dict[str, Any]:
    verdict, code = verdict_of(steps, bool(cuda.get("available")))
    return {
        "schema": SCHEMA,
        "verdict": verdict,
        "exit_code": code,
        "started_at": started,
        "duration_s": round(elapsed_s, 2),
        "git_commit": _git_commit(),
        "host": {"hostname": socket.gethostname(), "python": python, "platform": platform.platform()},
        "cuda": cuda,
        "files": sorted(p.name for p in out.iterdir() if p.is_file()) + ["gpu-check.json", "gpu-check.txt"],
        "steps": [s.to_json() for s in steps],
    }


STATUSES = ("passed", "failed", "skipped")
VERDICTS = {"passed": EXIT_OK, "failed": EXIT_FAILED, "no_cuda": EXIT_NO_CUDA}


def validate_report(report: dict[str, Any]) -> list[str]:
    """What is wrong with a report (empty: it follows the schema). Consumers and the tests use it."""
    problems = []
    for key, kind in (("schema", str), ("verdict", str), ("exit_code", int), ("cuda", dict), ("steps", list)):
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: missing or not {kind.__name__}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema is {report['schema']!r}, not {SCHEMA!r}")
    if VERDICTS.get(report["verdict"]) != report["exit_code"]:
        problems.append(f"verdict {report['verdict']!r} does not go with exit code {report['exit_code']}")
    if not isinstance(report["cuda"].get("available"), bool):
        problems.append("cuda.available: missing or not bool")
    names = [s.get("name") for s in report["steps"]]
    if names != [name for name, _ in STEPS]:
        problems.append(f"steps are {names}, not {[name for name, _ in STEPS]}")
    for s in report["steps"]:
        if s.get("status") not in STATUSES:
            problems.append(f"step {s.get('name')}: status {s.get('status')!r} not in {STATUSES}")
        elif s["status"] != "passed" and not s.get("reason"):
            problems.append(f"step {s.get('name')}: {s['status']} without a reason")
        if not report["cuda"]["available"] and s.get("name") in GPU_STEPS and s.get("status") != "skipped":
            problems.append(f"step {s.get('name')}: {s.get('status')} although no CUDA device was seen")
    return problems


def summary_text(report: dict[str, Any]) -> str:
    cuda = report["cuda"]
    if cuda.get("available"):
        gpus = ", ".join(f"{d['name']} (cuda:{d['index']})" for d in cuda["devices"])
        machine = f"{gpus}; torch {cuda['torch']}"
    else:
        machine = f"NO CUDA DEVICE: {cuda.get('reason')}"
    lines = [
        f"kvd GPU check {report['started_at']}: {report['verdict'].upper()} (exit {report['exit_code']}), "
        f"{report['duration_s']:.0f} s, commit {report['git_commit'][:12]}",
        f"machine: {machine}",
    ]
    for s in report["steps"]:
        lines.append(f"  {s['name']:<14} {s['status']:<8} {s['summary'] or s['reason']}")
    return "\n".join(lines) + "\n"


def run_checks(args: argparse.Namespace) -> int:
    started, t0 = _now(), time.monotonic()
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    for name in ("gpu-check.json", "gpu-check.txt", "gpu-check.log", "pytest-gpu.xml"):
        (out / name).unlink(missing_ok=True)
    site, src = work / "site", work / "src"
    link_packages(src)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), str(site), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    runner = Runner(args.python, out, work, env)
    steps = {name: Step(name, title) for name, title in STEPS}
    try:
        cuda = probe_cuda(args.python, env)
        if not cuda["available"]:
            print(f"gpu-check: CUDA is absent: {cuda['reason']}; the GPU steps are skipped", flush=True)
        _run_steps(steps, runner, cuda, args)
    finally:
        runner.close()
    report = build_report(list(steps.values()), cuda, started, time.monotonic() - t0, args.python, out)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    text = summary_text(report)
    (out / "gpu-check.txt").write_text(text)
    print(text, end="")
    print(f"report: {out / 'gpu-check.json'}")
    return int(report["exit_code"])


def _run_steps(steps: dict[str, Step], runner: Runner, cuda: dict[str, Any], args: argparse.Namespace) -> None:
    for name, step in steps.items():
        if name in args.skip:
            step.skip("skipped: --skip " + name)
            continue
        if name in GPU_STEPS and not cuda["available"]:
            step.skip(f"{NO_CUDA} ({cuda['reason']})")
            continue
        if name in GPU_STEPS and steps["environment"].status != "passed":
            step.skip("skipped: the environment step did not pass")
            continue
        print(f"gpu-check: {name}: {step.title} ...", flush=True)
        t0 = time.monotonic()
        if name == "environment":
            step_environment(step, runner, Path(args.wheels), runner.work / "site", cuda.get("python"))
        elif name == "pytest_gpu":
            step_pytest_gpu(step, runner)
        elif name == "vram_selftest":
            step_vram_selftest(step, runner, args.size_mb, args.iterations)
        elif name == "vram_paths":
            step_vram_paths(step, runner, args.iterations)
        elif name == "conversions":
            step_conversions(step, runner, args.repeat)
        elif name == "no_sync":
            step_no_sync(step, runner)
        step.duration_s = round(time.monotonic() - t0, 2)
        print(f"gpu-check: {name}: {step.status} ({step.duration_s:.0f} s) {step.summary}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prepare", action="store_true", help="fetch the wheels into --wheels and check the budget")
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="the wheels' folder (default .whl/, ignored)")
    parser.add_argument(
        "--extra",
        action="append",
        default=[],
        type=parse_requirement,
        metavar="NAME==VERSION",
        help="--prepare: one more wheel the GPU machine lacks (repeatable)",
    )
    parser.add_argument(
        "--budget-mib", type=int, default=BUDGET_BYTES >> 20, help="--prepare: what may travel, MiB (64)"
    )
    parser.add_argument("--no-fetch", action="store_true", help="--prepare: only check the wheels already there")
    parser.add_argument("--out", default=str(ROOT / "build" / "gpu-check" / "out"), help="report folder")
    parser.add_argument("--work", default=str(ROOT / "build" / "gpu-check"), help="private folder (site, links)")
    parser.add_argument("--python", default=sys.executable, help="the Python that holds torch (default: this one)")
    parser.add_argument("--skip", action="append", default=[], choices=[n for n, _ in STEPS], help="skip a step")
    parser.add_argument("--size-mb", type=int, default=128, help="VRAM selftest MiB per pull (128)")
    parser.add_argument("--iterations", type=int, default=5, help="VRAM selftest timed pulls (5)")
    parser.add_argument("--repeat", type=int, default=5, help="samples per conversion pair (5)")
    return parser


def main(argv: Iterable[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    if args.prepare:
        pip = [sys.executable, "-m", "pip"]
        return prepare(Path(args.wheels), [*WHEELS, *args.extra], args.budget_mib << 20, pip, fetch=not args.no_fetch)
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
