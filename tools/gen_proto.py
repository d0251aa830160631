"""Regenerate client/v1/ (import name ``kvd_client.v1``) from proto/kvd/v1/*.proto.

This is the one command after a change to ``proto/``; a test fails when the checked-in files
differ from a fresh run. It writes:

* ``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``: grpc_tools.protoc's output. The .proto files
  keep their wire path ``kvd/v1/`` (package ``kvd.v1``, so service and message names on the
  wire never change); the generated modules live in the client package, so their imports are
  rewritten from ``kvd.v1`` to ``kvd_client.v1``.
* ``schema.py``: the proto enums as ``enum.IntEnum`` (prefix and UNSPECIFIED dropped) and the
  plain-data messages in :data:`RECORDS` as frozen dataclasses. It imports neither grpc nor
  protobuf, so the daemon's core and the engine patch use the wire's types without loading
  either; :mod:`kvd_client.records` converts them to and from messages, table-driven.

Usage: python tools/gen_proto.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.resources
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_PACKAGE = "kvd/v1"
DEFAULT_OUT = ROOT / "client" / "v1"
PYTHON_PACKAGE = "kvd_client.v1"

RECORDS: tuple[str, ...] = ("LayerPlacement", "KvTransferParams")
"""Messages mirrored as dataclasses: flat messages whose fields the core or the engine reads."""

_IMPORT = re.compile(r"^(from )kvd\.v1( import )", re.MULTILINE)

# FieldDescriptorProto.Type -> Python annotation and proto3 zero value.
_SCALARS: dict[int, tuple[str, str]] = {
    1: ("float", "0.0"),  # double
    2: ("float", "0.0"),  # float
    3: ("int", "0"),  # int64
    4: ("int", "0"),  # uint64
    5: ("int", "0"),  # int32
    8: ("bool", "False"),  # bool
    9: ("str", '""'),  # string
    12: ("bytes", 'b""'),  # bytes
    13: ("int", "0"),  # uint32
    17: ("int", "0"),  # sint32
    18: ("int", "0"),  # sint64
}
_LABEL_REPEATED = 3


def _protos() -> list[str]:
    return sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc  # noqa: PLC0415 - a development tool, not a run-time dependency

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *args, *_protos()])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def _comments(file: object) -> dict[tuple[int, ...], str]:
    """Leading or trailing comment of each element path of a FileDescriptorProto."""
    out: dict[tuple[int, ...], str] = {}
    for loc in file.source_code_info.location:  # type: ignore[attr-defined]
        text = (loc.leading_comments or loc.trailing_comments).strip()
        if text:
            out[tuple(loc.path)] = " ".join(line.strip() for line in text.splitlines())
    return out


def _value_prefix(enum: object) -> str:
    """The prefix every value name of ``enum`` carries: its zero value is ``<PREFIX>UNSPECIFIED``."""
    zero = next(v.name for v in enum.value if v.number == 0)  # type: ignore[attr-defined]
    if not zero.endswith("_UNSPECIFIED"):
        raise SystemExit(f"enum value 0 must be named <PREFIX>_UNSPECIFIED, got {zero}")
    prefix = zero.removesuffix("UNSPECIFIED")
    for value in enum.value:  # type: ignore[attr-defined]
        if not value.name.startswith(prefix):
            raise SystemExit(f"enum value {value.name} does not start with {prefix}")
    return prefix


def _doc(comment: str | None, name: str) -> str:
    return f"{comment} (``kvd.v1.{name}``)" if comment else f"``kvd.v1.{name}``."


def _schema_source(descriptor_set: bytes) -> str:
    from google.protobuf import descriptor_pb2  # noqa: PLC0415 - as grpc_tools above

    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set).file
    enums: list[str] = []
    records: dict[str, str] = {}
    for file in files:
        if not file.name.startswith(PROTO_PACKAGE + "/"):
            continue
        comments = _comments(file)
        for i, enum in enumerate(file.enum_type):
            doc = _doc(comments.get((5, i)), enum.name)
            lines = [f"class {enum.name}(enum.IntEnum):", f'    """{doc}"""', ""]
            prefix = _value_prefix(enum)
            for j, value in enumerate(enum.value):
                if value.number == 0:
                    continue  # UNSPECIFIED: what an unset field reads as; refused at the edge
                note = comments.get((5, i, 2, j))
                lines.append(f"    {value.name.removeprefix(prefix)} = {value.number}")
                if note:
                    lines.append(f'    """{note}"""')
            enums.append("\n".join(lines))
        for i, message in enumerate(file.message_type):
            if message.name not in RECORDS:
                continue
            doc = _doc(comments.get((4, i)), message.name)
            lines = [
                "@dataclasses.dataclass(frozen=True)",
                f"class {message.name}:",
                f'    """{doc}"""',
                "",
                f'    PROTO: ClassVar[str] = "kvd.v1.{message.name}"',
            ]
            for j, field in enumerate(message.field):
                if field.type not in _SCALARS:
                    raise SystemExit(f"record {message.name}.{field.name}: only scalar fields are mirrored")
                annotation, zero = _SCALARS[field.type]
                if field.label == _LABEL_REPEATED:
                    annotation, zero = f"tuple[{annotation}, ...]", "()"
                lines.append(f"    {field.name}: {annotation} = {zero}")
                note = comments.get((4, i, 2, j))
                if note:
                    lines.append(f'    """{note}"""')
            records[message.name] = "\n".join(lines)
    missing = sorted(set(RECORDS) - set(records))
    if missing:
        raise SystemExit(f"RECORDS names messages that do not exist: {missing}")
    header = (
        '"""The kvd.v1 enums and plain-data messages as Python types. Generated by tools/gen_proto.py: do not edit.\n'
        "\n"
        "Enum members drop the proto prefix and the UNSPECIFIED zero value (an unset field; the edge\n"
        "refuses it); their values are the wire numbers. Records are frozen dataclasses whose fields\n"
        "are the message's, in order, with proto3 defaults; see kvd_client.records for conversions.\n"
        "Imports neither grpc nor protobuf.\n"
        '"""\n'
        "\n"
        "import dataclasses\n"
        "import enum\n"
        "from typing import ClassVar\n"
        "\n"
        "__all__ = [\n"
        + "".join(
            f'    "{name}",\n'
            for name in sorted([e.split("(")[0].removeprefix("class ") for e in enums] + list(records))
        )
        + "]\n"
    )
    body = "\n\n\n".join([*enums, *(records[name] for name in RECORDS)])
    return header + "\n\n" + body + "\n"


def generate(out_dir: pathlib.Path = DEFAULT_OUT) -> list[pathlib.Path]:
    """Write every generated module of ``kvd_client.v1`` into ``out_dir``; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp)
        descriptors = raw / "descriptors.pb"
        _protoc(
            [
                f"--python_out={raw}",
                f"--pyi_out={raw}",
                f"--grpc_python_out={raw}",
                f"--descriptor_set_out={descriptors}",
                "--include_imports",
                "--include_source_info",
            ]
        )
        for path in sorted((raw / PROTO_PACKAGE).glob("*_pb2*.py*")):
            target = out_dir / path.name
            target.write_text(_IMPORT.sub(rf"\g<1>{PYTHON_PACKAGE}\g<2>", path.read_text()))
            written.append(target)
        schema = out_dir / "schema.py"
        schema.write_text(_schema_source(descriptors.read_bytes()))
        written.append(schema)
    return sorted(written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="output folder (default: client/v1)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())
