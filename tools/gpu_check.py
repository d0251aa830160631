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
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The kit's parts sit next to this file; a run as a script has this folder on sys.path already,
# a test that loads the file by path does not.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_steps import (
    GPU_STEPS,
    NO_SYNC_TESTS,
    PACKAGES,
    STEPS,
    Runner,
    Step,
    gpu_test_files,
    junit_results,
    link_packages,
    probe_cuda,
    step_conversions,
    step_environment,
    step_no_sync,
    step_pytest_gpu,
    step_vram_paths,
    step_vram_selftest,
    ucx_protocol_lines,
)
from gpu_check_wheels import (
    BUDGET_BYTES,
    EXIT_FAILED,
    EXIT_NO_CUDA,
    EXIT_OK,
    EXIT_PREPARE,
    EXIT_USAGE,
    MANIFEST_SCHEMA,
    ROOT,
    SLIM,
    WHEELS,
    Budget,
    compatible,
    manifest_problems,
    normalize,
    parse_requirement,
    parse_wheel,
    prepare,
    select_wheels,
    slim_wheel,
    write_manifest,
)

# The names the kit's tests and docs reach through this module (its parts are the two above).
__all__ = [
    "BUDGET_BYTES",
    "EXIT_FAILED",
    "EXIT_NO_CUDA",
    "EXIT_OK",
    "EXIT_PREPARE",
    "EXIT_USAGE",
    "GPU_STEPS",
    "MANIFEST_SCHEMA",
    "NO_CUDA",
    "NO_SYNC_TESTS",
    "PACKAGES",
    "SCHEMA",
    "SLIM",
    "STEPS",
    "WHEELS",
    "Budget",
    "Runner",
    "Step",
    "build_report",
    "compatible",
    "gpu_test_files",
    "junit_results",
    "link_packages",
    "main",
    "manifest_problems",
    "normalize",
    "parse_wheel",
    "prepare",
    "select_wheels",
    "slim_wheel",
    "summary_text",
    "ucx_protocol_lines",
    "validate_report",
    "write_manifest",
]

SCHEMA = "kvd-gpu-check/1"
NO_CUDA = "skipped: no CUDA device"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _git_commit() -> str:
    """HEAD, with " (tree differs)" where the files differ from it: a copied tree may arrive with
    an older .git beside it, and a report must not name a commit whose code it did not run."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return "unknown (no git)"
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() + (" (tree differs)" if changed.returncode != 0 or changed.stdout.strip() else "")


def _short_commit(commit: str) -> str:
    head, _, rest = commit.partition(" ")
    return head[:12] + (f" {rest}" if rest else "")


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
        f"{report['duration_s']:.0f} s, commit {_short_commit(report['git_commit'])}",
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
