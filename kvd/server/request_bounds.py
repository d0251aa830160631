"""Every request kvd serves, parsed by kvd and bounded: malformed or oversized input becomes
INVALID_ARGUMENT naming the field, and is never echoed back whole.

grpc's default deserializer turns a malformed message into UNKNOWN before kvd sees it, so every
method parses through :func:`parser_of` (kvd.server.authz installs it on every handler), which
never raises; :func:`check_request` then refuses the malformed, and any message whose strings or
repeated fields exceed :data:`MAX_STRING_BYTES` / :data:`MAX_REPEATED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvd_client.errors import InvalidArgument

MAX_STRING_BYTES = 4096
"""Longest string field kvd accepts (ids, names, addresses, reasons): real ids are < 200 bytes."""
MAX_REPEATED = 1 << 20
"""Most entries of one repeated field (block ids of the largest caches are < 2^20)."""
MAX_ECHO_CHARS = 200
"""Longest piece of caller input quoted back in an error message (the rest is elided)."""


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut: input is never echoed whole."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit} more characters)"


@dataclasses.dataclass(frozen=True)
class Malformed:
    """What :func:`parser_of` returns for bytes that are not a valid message of the method's type."""

    type_name: str
    reason: str


def parser_of(cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        message = cls()
        try:
            message.ParseFromString(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's malformed bytes
            return Malformed(cls.DESCRIPTOR.full_name, clip(f"{type(exc).__name__}: {exc}"))
        return message

    return parse


def check_request(message: Message | Malformed, where: str = "") -> Message:
    """The parsed request, or InvalidArgument for malformed bytes, oversized strings or lists."""
    if isinstance(message, Malformed):
        raise InvalidArgument(f"malformed {message.type_name}: {message.reason}")
    _check_bounds(message, where)
    return message


# What a set field's value is when the field is not repeated (anything else is a container).
# A tuple made once: the union ``str | bytes | Message | int | float`` written in the loop was
# built again for every field of every request, and with the field's name (formatted whether
# or not it was needed) it made this check about 50 us per pull of a StartPulls on a loaded machine.
_SINGLE = (str, bytes, Message, int, float)
_PLAIN = frozenset((str, bytes, int, float, bool))  # the usual scalars, by type: no isinstance walk


# A message whose encoding is at most this many bytes holds no string longer than MAX_STRING_BYTES
# and no repeated field of more than MAX_REPEATED entries (every entry takes at least a byte), so
# its fields need no walk: the size is computed in C, the walk in Python (a PreparePull's walk was
# ~7 % of a holder's event-loop time at one pull in flight, a StartPulls' 1.4 % of a reader's).
_SMALL_ENOUGH = min(MAX_STRING_BYTES, MAX_REPEATED)


def _check_bounds(message: Message, where: str) -> None:
    if message.ByteSize() <= _SMALL_ENOUGH:
        return
    for field, value in message.ListFields():
        repeated = type(value) not in _PLAIN and not isinstance(value, _SINGLE)  # a repeated container
        if repeated and len(value) > MAX_REPEATED:
            raise InvalidArgument(f"{where}{field.name} has {len(value)} entries; at most {MAX_REPEATED} are accepted")
        kind = field.type
        if kind == _STRING:
            for text in value if repeated else (value,):
                if len(text) > MAX_STRING_BYTES:
                    raise InvalidArgument(
                        f"{where}{field.name} is {len(text)} characters ({clip(text, 40)!r}); "
                        f"at most {MAX_STRING_BYTES} are accepted"
                    )
        elif kind == _MESSAGE and not (field.message_type.GetOptions().map_entry if field.message_type else False):
            name = f"{where}{field.name}."
            for item in value if repeated else (value,):
                _check_bounds(item, name)


_STRING = FieldDescriptor.TYPE_STRING
_MESSAGE = FieldDescriptor.TYPE_MESSAGE
