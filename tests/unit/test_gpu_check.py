"""The GPU check kit's CPU side (tools/gpu_check.py, scripts/gpu-check.sh): which wheels it picks
for the GPU machine, the budget of what may travel, the manifest that guards the carried wheels,
the report's schema, and what it does where no CUDA device is present (this machine, CI).

Wheels are fake files with real names (sparse where they must be large): nothing is downloaded.
The GPU steps themselves run only on a GPU machine (docs/gpu-check.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvd_tools_gpu_check", REPO / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gc = _load()

NIXL = "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl"
SHIM = "nixl-1.5.1-py3-none-any.whl"
HEALTH = "grpcio_health_checking-1.85.1-py3-none-any.whl"
REFLECTION = "grpcio_reflection-1.85.1-py3-none-any.whl"
PROTOBUF = "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl"
GRPCIO = "grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
ALL = (NIXL, SHIM, HEALTH, REFLECTION, PROTOBUF, GRPCIO)


def fake_wheels(folder: Path, names: tuple[str, ...] = ALL, size: int = 1000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        with (folder / name).open("wb") as f:
            f.truncate(size)  # sparse: a "58 MB" wheel costs no disk
    return folder


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        (NIXL, True),
        (SHIM, True),
        (PROTOBUF, True),  # abi3 from cp310 on: fine for 3.12
        ("nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl", False),  # another Python
        ("nixl_cu13-1.5.1-cp312-cp312-manylinux_2_34_x86_64.whl", False),  # newer glibc than asked for
        ("nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_aarch64.whl", False),
        ("nixl_cu13-1.5.1-cp312-cp312-musllinux_1_2_x86_64.whl", False),
        ("protobuf-7.36.2-cp313-abi3-manylinux2014_x86_64.whl", False),  # abi3 from a newer Python
        ("numpy-2.4.6-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),  # compressed tags
        ("pkg-1.0-py2.py3-none-any.whl", True),
        ("pkg-1.0-1build-py3-none-any.whl", True),  # a build tag
    ],
)
def test_compatibility_with_the_gpu_machine(name: str, ok: bool) -> None:
    wheel = gc.parse_wheel(Path(name))
    assert wheel is not None
    assert gc.compatible(wheel) is ok


def test_file_names_that_are_not_wheels_are_ignored() -> None:
    assert gc.parse_wheel(Path("manifest.json")) is None
    assert gc.parse_wheel(Path("nixl-1.5.1.tar.gz")) is None
    assert gc.parse_wheel(Path("broken-name.whl")) is None
    assert gc.normalize("grpcio_health.Checking") == "grpcio-health-checking"


def test_selection_picks_one_wheel_per_requirement_and_reports_the_rest(tmp_path: Path) -> None:
    folder = fake_wheels(
        tmp_path / "whl",
        (
            *ALL,
            "nixl_cu13-1.5.1-cp312-cp312-manylinux2014_x86_64.whl",  # an older platform build: not chosen
            "nixl_cu13-1.4.0-cp312-cp312-manylinux_2_28_x86_64.whl",  # another version: never chosen
            "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl",  # not asked for
        ),
    )
    selection = gc.select_wheels(folder, gc.WHEELS)
    assert not selection.missing
    assert sorted(w.path.name for w in selection.chosen.values()) == sorted(ALL)
    assert sorted(p.name for p in selection.extra) == [
        "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "nixl_cu13-1.4.0-cp312-cp312-manylinux_2_28_x86_64.whl",
        "nixl_cu13-1.5.1-cp312-cp312-manylinux2014_x86_64.whl",
    ]


def test_selection_names_what_is_missing(tmp_path: Path) -> None:
    folder = fake_wheels(tmp_path / "whl", (SHIM, HEALTH, REFLECTION, PROTOBUF, GRPCIO, NIXL.replace("cp312", "cp311")))
    selection = gc.select_wheels(folder, gc.WHEELS)
    assert [str(r) for r in selection.missing] == ["nixl-cu13==1.5.1"]
    assert gc.select_wheels(tmp_path / "absent", gc.WHEELS).missing == list(gc.WHEELS)


def test_the_wheels_the_kit_carries_are_pinned_to_what_the_tree_needs() -> None:
    pinned = {r.key: r.version for r in gc.WHEELS}
    assert pinned["nixl-cu13"] == pinned["nixl"]  # the shim requires its backend's exact version
    generated = (REPO / "client" / "v1" / "common_pb2.py").read_text()
    gencode = generated.split("# Protobuf Python Version: ")[1].split()[0]
    assert gencode.split(".")[0] == pinned["protobuf"].split(".")[0]  # protobuf runtimes accept one major
    assert tuple(map(int, pinned["protobuf"].split("."))) >= tuple(map(int, gencode.split(".")))


def test_the_grpcio_the_kit_carries_is_one_the_generated_stubs_accept() -> None:
    # The GPU image's own grpcio (1.84.0) is older than client/v1's stubs accept: they raise at import.
    pinned = tuple(map(int, {r.key: r.version for r in gc.WHEELS}["grpcio"].split(".")))
    for stub in (REPO / "client" / "v1").glob("*_pb2_grpc.py"):
        generated = stub.read_text().split("GRPC_GENERATED_VERSION = '")[1].split("'")[0]
        assert pinned >= tuple(map(int, generated.split("."))), stub.name
    versions = {r.key: r.version for r in gc.WHEELS}
    assert versions["grpcio-health-checking"] == versions["grpcio-reflection"] == versions["grpcio"]


def _zip_wheel(path: Path, members: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for name, data in members.items():
            wheel.writestr(name, data)
        wheel.writestr("nixl_cu13-1.5.1.dist-info/RECORD", record + "nixl_cu13-1.5.1.dist-info/RECORD,,\n")
    return path


def test_slimming_drops_the_members_kvd_never_loads_and_their_record_lines(tmp_path: Path) -> None:
    members = {
        "nixl_cu13/__init__.py": b"kept",
        "nixl_cu13.libs/libucp.so": os.urandom(4096),
        "nixl_ep_cu13/__init__.py": b"dropped",
        "nixl_ep_cu13/nixl_ep_cpp_torch214.so": os.urandom(1 << 16),
    }
    wheel = _zip_wheel(tmp_path / NIXL, members)
    saved = gc.slim_wheel(wheel, gc.SLIM["nixl-cu13"])
    assert saved > 1 << 15
    with zipfile.ZipFile(wheel) as slim:
        assert sorted(slim.namelist()) == sorted(
            ["nixl_cu13/__init__.py", "nixl_cu13.libs/libucp.so", "nixl_cu13-1.5.1.dist-info/RECORD"]
        )
        assert slim.read("nixl_cu13.libs/libucp.so") == members["nixl_cu13.libs/libucp.so"]
        record = slim.read("nixl_cu13-1.5.1.dist-info/RECORD").decode()
    assert "nixl_ep_cu13" not in record and "nixl_cu13/__init__.py" in record
    assert gc.slim_wheel(wheel, gc.SLIM["nixl-cu13"]) == 0  # already slim: left as it is
    placeholder = fake_wheels(tmp_path / "fake", (NIXL,)) / NIXL
    assert gc.slim_wheel(placeholder, gc.SLIM["nixl-cu13"]) == 0  # not a zip: left as it is


def test_prepare_slims_nixl_so_that_the_set_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_wheels(tmp_path / "whl", tuple(n for n in ALL if n != NIXL))
    _zip_wheel(folder / NIXL, {"nixl_cu13/__init__.py": b"", "nixl_ep_cu13/big.so": os.urandom(1 << 20)})
    assert gc.prepare(folder, gc.WHEELS, 64 << 20, pip=["false"], fetch=False) == gc.EXIT_OK
    assert "dropped nixl_ep_cu13/" in capsys.readouterr().out
    files, problems = gc.manifest_problems(folder)  # the manifest describes the slimmed file
    assert not problems and len(files) == len(ALL)


def test_a_step_runs_with_its_extra_environment_and_the_ucx_protocol_lines_are_picked(tmp_path: Path) -> None:
    runner = gc.Runner(sys.executable, tmp_path, tmp_path, dict(os.environ))
    step = gc.Step("probe", "a probe")
    script = "import os; print('| rma | cuda_copy/cuda |'); print('| host | tcp |'); print(os.environ['KVD_X'])"
    code, tail = runner.run(step, ["-c", script], 30, extra_env={"KVD_X": "seen"})
    runner.close()
    assert code == 0 and tail.splitlines()[-1] == "seen"
    assert gc.ucx_protocol_lines((tmp_path / "probe.out").read_text()) == ["| rma | cuda_copy/cuda |"]


class _ScriptedRunner(gc.Runner):
    """A runner whose child "wrote" ``report`` to the step's --json path and exited ``code``."""

    def __init__(self, folder: Path, report: dict[str, object], code: int) -> None:
        super().__init__(sys.executable, folder, folder, {})
        self.report, self.code = report, code
        self.extra_env: dict[str, str] | None = None

    def run(
        self, step: gc.Step, args: object, timeout_s: float, extra_env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        argv = list(args)  # type: ignore[call-overload]
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(self.report))
        (self.work / f"{step.name}.out").write_text("| rma | cuda_ipc/cuda |\n| am | tcp |\n")
        self.extra_env, step.exit_code = extra_env, self.code
        return self.code, "the tail"


def test_the_vram_paths_step_reports_each_case_and_fails_on_a_failed_case(tmp_path: Path) -> None:
    own = {"case": "own", "gbs": 180.5, "one_sided": True, "verified": True}
    imported = {"case": "imported", "gbs": 0.13, "one_sided": False, "verified": True}
    runner = _ScriptedRunner(tmp_path, {"device": "cuda:0", "cases": [own, imported]}, 0)
    step = gc.Step("vram_paths", "t")
    gc.step_vram_paths(step, runner, iterations=3)
    runner.close()
    assert step.status == "passed"
    assert step.summary == "own 180.50 GB/s, one-sided True; imported 0.13 GB/s, one-sided False"
    assert step.results["cases"] == [own, imported]
    assert step.results["ucx_protocols"] == ["| rma | cuda_ipc/cuda |"]
    assert runner.extra_env == {"UCX_PROTO_INFO": "y"}
    broken = {"case": "imported", "error": "RuntimeError: imported: READ ended ERR", "verified": False}
    runner = _ScriptedRunner(tmp_path, {"cases": [own, broken]}, 1)
    step = gc.Step("vram_paths", "t")
    gc.step_vram_paths(step, runner, iterations=3)
    runner.close()
    assert step.status == "failed"
    assert step.reason == "exit 1: imported: RuntimeError: imported: READ ended ERR"
    assert step.summary == "own 180.50 GB/s, one-sided True; imported failed"


def test_budget() -> None:
    tree = 2_300_000
    fits = gc.Budget(wheels=58_800_000 + 400_000, tree=tree)
    assert fits.fits and "fits" in fits.describe()
    over = gc.Budget(wheels=58_800_000 + 7_000_000, tree=tree)  # with grpcio's 7 MB wheel, say
    assert not over.fits
    assert "OVER" in over.describe() and "64.0 MiB" in over.describe()


def test_prepare_checks_the_folder_and_writes_a_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_wheels(tmp_path / "whl", size=1 << 20)
    code = gc.prepare(folder, gc.WHEELS, 64 << 20, pip=["false"], fetch=False)
    assert code == gc.EXIT_OK
    out = capsys.readouterr().out
    assert NIXL in out and "fits" in out
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["schema"] == gc.MANIFEST_SCHEMA
    assert sorted(e["file"] for e in manifest["wheels"]) == sorted(ALL)
    files, problems = gc.manifest_problems(folder)
    assert not problems and len(files) == len(ALL)


def test_prepare_fails_clearly_over_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = fake_wheels(tmp_path / "whl", size=60 << 20)  # 6 x 60 MiB, sparse
    code = gc.prepare(folder, gc.WHEELS, 64 << 20, pip=["false"], fetch=False)
    assert code == gc.EXIT_PREPARE
    assert "over the 64.0 MiB that may travel" in capsys.readouterr().err


def test_prepare_fails_clearly_when_a_wheel_cannot_be_fetched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = fake_wheels(tmp_path / "whl", (SHIM, HEALTH, REFLECTION, PROTOBUF, GRPCIO))
    code = gc.prepare(folder, gc.WHEELS, 64 << 20, pip=["false"])  # `false download ...` exits 1
    assert code == gc.EXIT_PREPARE
    assert "could not fetch nixl-cu13==1.5.1" in capsys.readouterr().err


def test_manifest_catches_a_missing_or_damaged_wheel(tmp_path: Path) -> None:
    folder = fake_wheels(tmp_path / "whl")
    gc.write_manifest(folder, gc.select_wheels(folder, gc.WHEELS), gc.WHEELS)
    (folder / SHIM).unlink()
    (folder / PROTOBUF).write_bytes(b"truncated in transit")
    files, problems = gc.manifest_problems(folder)
    assert len(files) == len(ALL) - 2
    assert any(SHIM in p and "missing" in p for p in problems)
    assert any(PROTOBUF in p and "differs" in p for p in problems)


def test_gpu_test_files_are_found_by_their_marker() -> None:
    files = gc.gpu_test_files()
    assert "tests/gpu/test_cuda_ipc.py" in files
    assert "tests/unit/engine_patch/test_engine_gpu.py" in files
    assert "tests/unit/test_gpu_check.py" not in files
    for node in gc.NO_SYNC_TESTS:  # the no-sync step names tests that exist
        path, name = node.split("::")
        assert f"def {name}(" in (REPO / path).read_text()


def test_link_tree_maps_the_packages_as_setup_py_does(tmp_path: Path) -> None:
    gc.link_packages(tmp_path / "src")
    assert (tmp_path / "src" / "kvd_client" / "sync.py").is_file()
    assert (tmp_path / "src" / "kvd_engine" / "connector.py").is_file()
    assert (tmp_path / "src" / "kvd" / "cli" / "selftest_vram.py").is_file()
    setup_py = (REPO / "setup.py").read_text()
    for name, folder in gc.PACKAGES.items():
        assert f'"{name}": "{folder}"' in setup_py


def test_junit_results_per_test(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_cuda_ipc" name="test_a" time="1.5"/>'
        '<testcase classname="tests.gpu.test_cuda_ipc" name="test_b" time="0.1">'
        '<failure message="assert 1 == 2">trace</failure></testcase>'
        '<testcase classname="t" name="test_c" time="0"><skipped message="needs a CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert [(r["test"], r["outcome"]) for r in gc.junit_results(xml)] == [
        ("tests.gpu.test_cuda_ipc::test_a", "passed"),
        ("tests.gpu.test_cuda_ipc::test_b", "failed"),
        ("t::test_c", "skipped"),
    ]
    assert gc.junit_results(tmp_path / "absent.xml") == []


def _report(available: bool, statuses: dict[str, str]) -> dict[str, object]:
    steps = []
    for name, title in gc.STEPS:
        step = gc.Step(name, title, status=statuses.get(name, "passed"))
        if step.status != "passed":
            step.reason = "because"
        steps.append(step)
    cuda = {"available": available, "devices": [{"index": 0, "name": "H100", "memory_bytes": 1, "capability": "9.0"}]}
    return gc.build_report(steps, {**cuda, "torch": "2.11.0+cu130", "reason": ""}, "now", 1.0, "python3", Path("."))


def test_report_verdicts_and_schema() -> None:
    passed = _report(True, {})
    assert (passed["verdict"], passed["exit_code"]) == ("passed", gc.EXIT_OK)
    assert gc.validate_report(passed) == []
    failed = _report(True, {"vram_selftest": "failed"})
    assert (failed["verdict"], failed["exit_code"]) == ("failed", gc.EXIT_FAILED)
    assert gc.validate_report(failed) == []
    no_cuda = _report(False, {name: "skipped" for name in gc.GPU_STEPS})
    assert (no_cuda["verdict"], no_cuda["exit_code"]) == ("no_cuda", gc.EXIT_NO_CUDA)
    assert gc.validate_report(no_cuda) == []
    assert "H100" in gc.summary_text(passed) and "FAILED" in gc.summary_text(failed)


def test_report_validation_names_what_is_wrong() -> None:
    report = _report(True, {})
    report["exit_code"] = 4
    report["steps"][1]["status"] = "skipped"  # type: ignore[index]
    report["steps"][1]["reason"] = ""  # type: ignore[index]
    problems = gc.validate_report(report)
    assert any("does not go with exit code 4" in p for p in problems)
    assert any("pytest_gpu: skipped without a reason" in p for p in problems)
    ran_without_cuda = _report(False, {})
    assert any("although no CUDA device" in p for p in gc.validate_report(ran_without_cuda))
    assert gc.validate_report({}) != []


@pytest.mark.slow
def test_without_cuda_the_script_says_so_writes_the_report_and_exits_4(tmp_path: Path) -> None:
    """The whole kit through its shell wrapper on this CUDA-less machine, out folder from $OUT."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    foreign = () if sys.version_info[:2] == (3, 12) else (NIXL,)  # a cp312 wheel is left out here, not installed
    args = ["--work", str(tmp_path / "work"), "--wheels", str(fake_wheels(tmp_path / "whl", foreign))]
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == gc.EXIT_NO_CUDA, done.stdout + done.stderr
    assert "CUDA is absent" in done.stdout
    report = json.loads((out / "gpu-check.json").read_text())
    assert gc.validate_report(report) == []
    assert report["verdict"] == "no_cuda" and report["cuda"]["available"] is False
    steps = {s["name"]: s for s in report["steps"]}
    for name in gc.GPU_STEPS:
        assert steps[name]["status"] == "skipped"
        assert steps[name]["reason"].startswith(gc.NO_CUDA + " (")  # and why: e.g. a CPU-only torch
    environment = steps["environment"]
    assert environment["status"] == "passed", environment["reason"]
    assert environment["results"].get("wheels_not_for_this_python", []) == list(foreign)
    assert (out / "gpu-check.txt").read_text().splitlines()[1].startswith("machine: NO CUDA DEVICE")
    assert (out / "gpu-check.log").is_file()


def test_help_says_what_the_kit_does() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), "--help"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    for words in ("--prepare", "64 MiB", "pytest -m gpu", "CUDA IPC", "copy_", "set_sync_debug_mode", "exits 4"):
        assert words in done.stdout, words
