"""The NIXL notification a reader's READ carries to the holder: one codec, both sides.

The tag is ``kvd2|<lease>|<admission>``: the holder hands it to the reader in PreparePull, or,
for a READ posted beside its admission, the reader builds it from the read id it asks to be
admitted under (:func:`valid_read_id`). The reader appends which part of how many parts the READ
is and its bytes. The holder's notification
handler decodes it to count the admitted read's parts. Anything else (another program's
notification, a malformed or truncated one) decodes to None and is ignored.
"""

from __future__ import annotations

import dataclasses
import re

PREFIX = "kvd2"
_MAX_LEN = 512
READ_ID_MAX = 64
_READ_ID = re.compile(rf"[A-Za-z0-9._-]{{1,{READ_ID_MAX}}}")


@dataclasses.dataclass(frozen=True)
class ReadNotification:
    lease_id: str
    admission_id: str
    part: int
    parts: int
    nbytes: int


def tag(lease_id: str, admission_id: str) -> str:
    """The holder's part of the notification (PreparePullResponse.notif_tag)."""
    for field in (lease_id, admission_id):
        if not field or "|" in field:
            raise ValueError(f"notification field {field!r} is empty or holds '|'")
    return f"{PREFIX}|{lease_id}|{admission_id}"


def valid_read_id(read_id: str) -> bool:
    """Whether a reader-chosen admission id fits a notification: 1-64 of ``[A-Za-z0-9._-]``."""
    return _READ_ID.fullmatch(read_id) is not None


def encode(notif_tag: str, part: int, parts: int, nbytes: int) -> bytes:
    """The full notification of READ ``part`` of ``parts`` (the reader's side)."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} is not a part")
    return f"{notif_tag}|{part}|{parts}|{nbytes}".encode()


def decode(message: bytes) -> ReadNotification | None:
    if len(message) > _MAX_LEN:
        return None
    fields = message.decode(errors="replace").split("|")
    if len(fields) != 6 or fields[0] != PREFIX or not fields[1] or not fields[2]:
        return None
    try:
        part, parts, nbytes = int(fields[3]), int(fields[4]), int(fields[5])
    except ValueError:
        return None
    if not 0 <= part < parts or nbytes < 0:
        return None
    return ReadNotification(fields[1], fields[2], part, parts, nbytes)
