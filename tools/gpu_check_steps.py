"""The checks tools/gpu_check.py runs on the GPU machine: each a :class:`Step` run as a child
process by :class:`Runner` (own process group, time limit, output kept in gpu-check.log), with
the CUDA and import probes, the private install of the wheels, and how each step's figures are
read from its output. Standard library only: it runs before anything it installs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_check_wheels import (
    ROOT,
    TARGET,
    WHEELS,
    WheelFile,
    compatible,
    manifest_problems,
    parse_wheel,
    select_wheels,
)

PACKAGES = {"kvd": "kvd", "kvd_client": "client", "kvd_engine": "engine_patch"}  # setup.py's SOURCE_FOLDERS

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
