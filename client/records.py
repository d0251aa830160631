"""Table-driven conversions of the generated records (:mod:`kvd_client.v1.schema`).

A record's dataclass fields are its message's fields (tools/gen_proto.py writes both from the
proto), so one loop over ``dataclasses.fields`` converts any record to a message, a message to a
record, and either to the plain dict that travels in JSON (vLLM's ``kv_transfer_params``). No
field is named here: a field added to the proto reaches every conversion by regenerating.
Imports neither grpc nor protobuf (message classes are passed in).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar

__all__ = ["as_fields", "field_names", "from_fields", "from_message", "to_message"]


class Record(Protocol):
    """A generated record: a frozen dataclass naming its message in ``PROTO``."""

    PROTO: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


R = TypeVar("R", bound=Record)
M = TypeVar("M")


def field_names(record_type: type[Record]) -> tuple[str, ...]:
    """The record's (and its message's) field names, in proto order."""
    return tuple(name for name, _, _ in _schema(record_type))


@functools.cache
def _schema(record_type: type[Record]) -> tuple[tuple[str, type, bool], ...]:
    """(name, scalar type, repeated) of each field, in proto order: read once per record type
    (reading the annotations is most of a conversion's cost, and every pull converts its
    ``KvTransferParams``). The record types are the generated module's: a fixed, small set."""
    return tuple((f.name, *_element_type(f)) for f in dataclasses.fields(record_type))


def _element_type(field: dataclasses.Field[Any]) -> tuple[type, bool]:
    """(scalar type, repeated) of a generated field, read from its annotation.

    The generated module does not postpone annotations, so ``field.type`` is ``int`` or
    ``tuple[int, ...]`` itself.
    """
    annotation = field.type
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], True
    if not isinstance(annotation, type):
        raise TypeError(f"field {field.name}: unsupported annotation {annotation!r}")
    return annotation, False


def from_fields(record_type: type[R], fields: Mapping[str, Any]) -> R:
    """The record of ``fields`` (e.g. parsed JSON), each value coerced to its field's type.

    Unknown keys are ignored, missing ones take the proto default; a value that cannot be
    coerced raises ``TypeError`` or ``ValueError``.
    """
    values: dict[str, Any] = {}
    for name, scalar, repeated in _schema(record_type):
        if name not in fields:
            continue
        raw = fields[name]
        if repeated:
            if isinstance(raw, str | bytes | Mapping):
                raise TypeError(f"{record_type.PROTO}.{name} must be a sequence, got {type(raw).__name__}")
            values[name] = tuple(scalar(v) for v in raw)
        else:
            values[name] = scalar(raw)
    return record_type(**values)


def as_fields(record: Record) -> dict[str, Any]:
    """The record as a JSON-ready dict (repeated fields as lists)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def to_message(record: Record, message_type: type[M]) -> M:
    """The protobuf message of ``record`` (``message_type`` must be its ``PROTO`` message)."""
    _check(record.PROTO, message_type)
    return message_type(**as_fields(record))


def from_message(record_type: type[R], message: Any) -> R:
    """The record of a protobuf message of the record's ``PROTO`` type."""
    _check(record_type.PROTO, type(message))
    # from_fields without its dict of the message's fields: a message has every field, and its
    # repeated fields are never a str, bytes or mapping (every pull converts one of these).
    values: dict[str, Any] = {}
    for name, scalar, repeated in _schema(record_type):
        raw = getattr(message, name)
        values[name] = tuple(map(scalar, raw)) if repeated else scalar(raw)
    return record_type(**values)


def _check(proto: str, message_type: type) -> None:
    full_name = getattr(getattr(message_type, "DESCRIPTOR", None), "full_name", None)
    if full_name != proto:
        raise TypeError(f"expected a {proto} message, got {message_type.__name__}")
