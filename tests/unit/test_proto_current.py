"""The generated code in client/v1/ is exactly what tools/gen_proto.py makes from proto/."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "client" / "v1"
HAND_WRITTEN = {"__init__.py", "py.typed"}


def _gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvd_tools_gen_proto", REPO / "tools" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_protobuf_code_is_current(tmp_path: Path) -> None:
    """Regenerating from proto/ reproduces every generated client/v1 file byte for byte, and no stale file remains.

    If this fails, run `python tools/gen_proto.py` and commit the result; never edit client/v1 by hand.
    """
    written = _gen_proto().generate(out_dir=tmp_path)
    fresh = {path.name: path.read_bytes() for path in written}
    assert fresh, "gen_proto wrote nothing"
    assert {p.name for p in tmp_path.iterdir()} == set(fresh), "generate() did not report every file"
    checked_in = {
        path.name: path.read_bytes() for path in GENERATED.iterdir() if path.is_file() and path.name not in HAND_WRITTEN
    }
    assert sorted(checked_in) == sorted(fresh), "client/v1 has missing or stale generated files"
    stale = [name for name in sorted(fresh) if checked_in[name] != fresh[name]]
    assert not stale, f"client/v1 files differ from a fresh generation: {stale}; run python tools/gen_proto.py"


def test_every_proto_has_its_generated_modules() -> None:
    """Each proto/kvd/v1/X.proto has X_pb2.py, X_pb2.pyi and X_pb2_grpc.py in client/v1."""
    for proto in sorted((REPO / "proto" / "kvd" / "v1").glob("*.proto")):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (GENERATED / f"{proto.stem}{suffix}").is_file(), f"{proto.stem}{suffix} is missing"


def test_generated_code_keeps_the_wire_names() -> None:
    """Moving the Python package changed no wire name: files, packages and services stay kvd.v1."""
    from kvd_client.v1 import common_pb2, engine_pb2, peer_pb2, router_pb2

    assert common_pb2.DESCRIPTOR.name == "kvd/v1/common.proto"
    assert common_pb2.DESCRIPTOR.package == "kvd.v1"
    assert engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name == "kvd.v1.EngineService"
    assert peer_pb2.DESCRIPTOR.services_by_name["PeerService"].full_name == "kvd.v1.PeerService"
    assert router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name == "kvd.v1.RouterService"
