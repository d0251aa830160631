"""Regenerate kvd/v1/*_pb2*.py from proto/kvd/v1/*.proto (the one command; CI checks it is current).

Usage: python tools/gen_proto.py [--out DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run grpc_tools.protoc over every proto file; return the files written."""
    from grpc_tools import protoc  # only needed by developers and CI, not at run time

    import importlib.resources

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kvd" / "v1").glob("*.proto"))
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted((out_dir / "kvd" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="output root (default: repository root)")
    args = parser.parse_args()
    written = generate(args.out)
    for path in written:
        print(path.relative_to(args.out))


if __name__ == "__main__":
    sys.exit(main())
